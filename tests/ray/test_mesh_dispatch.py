"""Mesh-declared dispatch on a real group, on a split of a pool that crosses placement
groups: each mesh's dp ranks asked once, parts put in the object store once for the
ranks that share them, the collecting ranks' answers in dp order, jagged TensorDicts,
non-blocking calls answering a future whose ``get()`` concatenates; and the split's
other part, ``worker_env`` and its refusals."""

from __future__ import annotations

import os

import pytest
import ray
import torch
from tensordict import TensorDict

from single_controller import DataProto, DataProtoFuture
from single_controller import tensordict_utils as tu
from single_controller.base import Worker
from single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, split_resource_pool
from tests.ray.pool_workers import EnvReader


@ray.remote
class MeshWorker(Worker):
    """Two meshes over 4 ranks: "infer" is dp x tp = 2 x 2 (tp fastest, tp 0 collects);
    "train" numbers its dp ranks the other way round and collects on the second rank."""

    def __init__(self) -> None:
        super().__init__()
        self._register_dispatch_collect_info("infer", dp_rank=self.rank // 2, is_collect=self.rank % 2 == 0)
        self._register_dispatch_collect_info("train", dp_rank=1 - self.rank // 2, is_collect=self.rank % 2 == 1)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("infer"))
    def infer(self, data: DataProto) -> DataProto:
        data.batch["who"] = torch.full((len(data),), self.rank)
        return data

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("train"), blocking=False)
    def train(self, data: TensorDict) -> TensorDict:
        data = tu.contiguous(data)
        data["ids"] = data["ids"] + 100
        data["who"] = torch.full((len(data),), self.rank)
        return data

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def rows(self, data: TensorDict) -> TensorDict:
        data["who"] = torch.full((len(data),), self.rank)
        return data

    @register(Dispatch.ONE_TO_ALL)
    def env(self, key: str) -> str | None:
        return os.environ.get(key)


@pytest.fixture(scope="module")
def pools(ray_cluster):
    pool = RayResourcePool([3, 3], use_gpu=True, name_prefix="meshsplit")
    small, large = split_resource_pool(pool, [2, 4])
    yield small, large
    pool.remove()


@pytest.fixture(scope="module")
def mesh_group(pools):
    _, large = pools
    group = RayWorkerGroup(large, RayClassWithInitArgs(cls=MeshWorker), worker_env={"MESH_TEST": "yes"})
    yield group
    group.shutdown()


def jagged(lengths):
    return torch.nested.as_nested_tensor([torch.arange(n) for n in lengths], layout=torch.jagged)


def test_a_mesh_splits_by_dp_and_collects_from_its_collecting_ranks(mesh_group):
    puts = mesh_group.object_store_puts
    out = mesh_group.infer(DataProto.from_dict({"x": torch.arange(4.0)}, {"tag": list("abcd")}))
    assert out.batch["who"].tolist() == [0, 0, 2, 2] and out.non_tensor_batch["tag"].tolist() == list("abcd")
    assert mesh_group._dispatch_info["infer"] == [0, 0, 1, 1]
    assert mesh_group.object_store_puts - puts == 2  # one put per part, shared by its two ranks


def test_a_jagged_tensordict_non_blocking_answers_a_future(mesh_group):
    lengths = [1, 5, 2, 4, 3]  # 5 rows: padded to 6 on the way in, 5 come back
    future = mesh_group.train(tu.get_tensordict({"ids": jagged(lengths), "x": torch.arange(5.0)}))
    assert isinstance(future, DataProtoFuture)
    out = future.get(timeout=120)
    assert isinstance(out, TensorDict) and out["x"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    # train's dp rank 0 is ranks 2-3 (rank 3 collects), dp rank 1 ranks 0-1 (rank 1)
    assert out["who"].tolist() == [3, 3, 3, 1, 1]
    assert [t.tolist() for t in out["ids"].unbind(0)] == [(torch.arange(n) + 100).tolist() for n in lengths]


def test_every_proto_mode_answers_a_future_for_a_tensordict(mesh_group):
    future = mesh_group.rows(TensorDict({"x": torch.arange(4.0)}, batch_size=[4]))
    assert isinstance(future, DataProtoFuture) and future.get(timeout=120)["who"].tolist() == [0, 1, 2, 3]


def test_the_group_reports_each_meshs_dp_size_and_collect_ranks(mesh_group):
    assert {name: mesh.describe() for name, mesh in mesh_group.meshes().items()} == {
        "infer": {"dp_size": 2, "dp_ranks": [0, 0, 1, 1], "collect_ranks": [0, 2]},
        "train": {"dp_size": 2, "dp_ranks": [1, 1, 0, 0], "collect_ranks": [3, 1]},
    }


def test_worker_env_reaches_every_rank_and_never_overrides_the_groups(pools, mesh_group):
    assert mesh_group.env("MESH_TEST") == ["yes"] * 4
    with pytest.raises(ValueError, match=r"worker_env may not set \['WORLD_SIZE'\]"):
        RayWorkerGroup(pools[1], RayClassWithInitArgs(cls=MeshWorker), worker_env={"WORLD_SIZE": "100"})


def test_the_split_crosses_placement_groups_and_shares_no_bundle(pools, mesh_group):
    small, large = pools
    assert [pg.id for pg in large.pgs] == [small.pgs[0].id, pools[0].parent.pgs[1].id]
    # large's ranks: bundle 2 of the first placement group, then bundles 0-2 of the second
    assert mesh_group.env("LOCAL_RANK") == ["0", "0", "1", "2"]
    assert mesh_group.env("LOCAL_WORLD_SIZE") == ["1", "3", "3", "3"]
    other = RayWorkerGroup(small, RayClassWithInitArgs(cls=EnvReader))
    try:
        assert other.world_size == 2 and other.env("RANK") == ["0", "1"]
        gpus = other.execute_all_sync("get_cuda_visible_devices") + mesh_group.execute_all_sync(
            "get_cuda_visible_devices"
        )
        assert len(set(gpus)) == 6  # six bundles, one GPU each, none shared
    finally:
        other.shutdown()

"""verl v0.4's group API on a real group: DataProto through the PROTO modes (blocking,
DataProtoFuture, auto padding), driver functions on the ranks, groups attached to
running workers, verl's local-rank variables, and parallel_put."""

from __future__ import annotations

import os
import time

import pytest
import ray
import torch

from single_controller import DataProto, DataProtoFuture
from single_controller.protocol import DataProtoConfig
from single_controller.ray import (
    NVMegatronRayWorkerGroup,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
)
from single_controller.ray.transfer import parallel_put
from tests.ray.verl_workers import ProtoWorker, SelfStartingMegatron


def rows_seen(worker, data: DataProto) -> DataProto:
    """A driver function: runs on each rank with its rows."""
    return DataProto.from_dict({"rank": torch.full((len(data),), worker.rank), "x": data.batch["x"]})


def rank_zero_env() -> tuple[str, int]:
    return os.environ["RANK"], os.getpid()


def batch(n: int, auto_padding: bool = False) -> DataProto:
    return DataProto.from_dict(
        {"x": torch.arange(float(n))}, {"id": [f"s{i}" for i in range(n)]}, {"step": 7}, auto_padding=auto_padding
    )


@pytest.fixture(scope="module")
def group(ray_cluster):
    pool = RayResourcePool([4], use_gpu=False, name_prefix="verlapi")
    g = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ProtoWorker), name_prefix="verlapi_")
    yield g
    g.shutdown()
    pool.remove()



def test_workers_get_verls_local_rank_names(group):
    assert group.env("RAY_LOCAL_RANK") == ["0", "1", "2", "3"] == group.env("LOCAL_RANK")
    assert group.env("RAY_LOCAL_WORLD_SIZE") == ["4"] * 4


def test_a_dataproto_goes_through_dp_compute_proto(group, no_global_padding):
    out = group.add_rank(batch(8))
    assert isinstance(out, DataProto)
    assert out.batch["x"].tolist() == [0.0, 1.0, 3.0, 4.0, 6.0, 7.0, 9.0, 10.0]
    assert out.non_tensor_batch["id"].tolist() == [f"s{i}" for i in range(8)]
    assert out.non_tensor_batch["who"].tolist() == ["rank0"] * 2 + ["rank1"] * 2 + ["rank2"] * 2 + ["rank3"] * 2
    assert out.meta_info == {"step": 7, "seen_by": "workers"}


def test_auto_padding_pads_on_the_way_in_and_unpads_on_the_way_out(group, no_global_padding):
    with pytest.raises(ValueError, match=r"add_rank: .*6 rows, which do not split into 4 equal parts"):
        group.add_rank(batch(6))
    data = batch(6, auto_padding=True)
    out = group.add_rank(data)
    # 6 rows padded to 8: two per rank, the last rank's two are padding and dropped
    assert out.batch["x"].tolist() == [0.0, 1.0, 3.0, 4.0, 6.0, 7.0]
    assert out.non_tensor_batch["who"].tolist() == ["rank0", "rank0", "rank1", "rank1", "rank2", "rank2"]
    assert len(data) == 6 and data.batch["x"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    DataProtoConfig.auto_padding = True
    assert len(group.add_rank(batch(1))) == 1


def test_non_blocking_proto_calls_with_a_dataproto_return_a_future(group):
    future = group.square_later(batch(4))
    assert isinstance(future, DataProtoFuture)
    out = future.get(timeout=60)
    assert isinstance(out, DataProto) and out.batch["x"].tolist() == [0.0, 1.0, 4.0, 9.0]
    # a future is accepted where a DataProto is: it is resolved before dispatch
    chained = group.add_rank(group.square_later(batch(4)))
    assert chained.batch["x"].tolist() == [0.0, 2.0, 6.0, 12.0]
    second_half = group.square_later(batch(4)).chunk(2)[1]
    assert second_half.get(timeout=60).non_tensor_batch["id"].tolist() == ["s2", "s3"]


def test_metric_mode_answers_one_value_per_rank(group, no_global_padding):
    assert group.row_sum(batch(8)) == [1.0, 5.0, 9.0, 13.0]
    assert ray.get(group.call_method("row_sum", batch(8), blocking=False), timeout=60) == [1.0, 5.0, 9.0, 13.0]


def test_megatron_proto_modes_take_dataprotos_and_answer_futures(ray_cluster, no_global_padding):
    pool = RayResourcePool([2], use_gpu=False, name_prefix="nvmegatron")
    group = NVMegatronRayWorkerGroup(pool, RayClassWithInitArgs(SelfStartingMegatron))
    try:
        assert (group.tp_size, group.dp_size, group.pp_size) == (1, 2, 1)
        for method in (group.tag, group.tag_pp):
            future = method(batch(4))
            assert isinstance(future, DataProtoFuture)
            out = future.get(timeout=120)
            assert out.non_tensor_batch["dp"].tolist() == [0, 0, 1, 1]
            assert out.non_tensor_batch["id"].tolist() == ["s0", "s1", "s2", "s3"] and out.meta_info == {"step": 7}
        padded = group.tag(batch(3, auto_padding=True)).get(timeout=120)
        assert padded.non_tensor_batch["dp"].tolist() == [0, 0, 1]
    finally:
        group.shutdown()
        pool.remove()


def test_driver_functions_run_on_the_ranks(group):
    out = group.execute_with_func_generator(rows_seen, batch(8))
    assert out.batch["rank"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert out.batch["x"].tolist() == [float(i) for i in range(8)]
    rank, pid = group.execute_func_rank_zero(rank_zero_env)
    assert rank == "0" and pid == group.rank_info()[0]["pid"]


@ray.remote(num_cpus=0)
def call_from_another_process(worker_names: list[str]) -> tuple[list[float], list[str]]:
    attached = RayWorkerGroup.from_detached(
        worker_names=worker_names, ray_cls_with_init=RayClassWithInitArgs(cls=ProtoWorker), name_prefix=None
    )
    return attached.add_rank(batch(4)).batch["x"].tolist(), attached.worker_names


def test_from_detached_attaches_to_running_workers_by_name_or_handle(group, no_global_padding):
    values, names = ray.get(call_from_another_process.remote(group.worker_names), timeout=120)
    assert values == [0.0, 2.0, 4.0, 6.0] and names == group.worker_names
    # the workers outlive the attached group
    assert group.env("RANK") == ["0", "1", "2", "3"]
    by_handle = RayWorkerGroup.from_detached(worker_handles=group.workers, ray_cls_with_init=RayClassWithInitArgs(ProtoWorker))
    assert by_handle.world_size == 4 and by_handle.env("RANK") == ["0", "1", "2", "3"]
    plain = RayWorkerGroup.from_detached(worker_names=group.worker_names)
    assert plain.execute_all_sync("env", "RANK") == ["0", "1", "2", "3"]
    with pytest.raises(ValueError, match="2 worker_names for 4 worker_handles"):
        RayWorkerGroup.from_detached(worker_names=group.worker_names[:2], worker_handles=group.workers)


def test_dropping_a_group_ends_its_workers(ray_cluster):
    """verl's tests `del` a group and reuse its actor names: the group holds no reference
    to itself, so its handles go with it and Ray ends the actors."""
    pool = RayResourcePool([2], use_gpu=False, name_prefix="dropped")
    doomed = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ProtoWorker), name_prefix="dropped_")
    names = doomed.worker_names
    assert doomed.env("RANK") == ["0", "1"]
    del doomed
    deadline = time.monotonic() + 30
    while any(_named(name) for name in names) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_named(name) for name in names)
    again = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ProtoWorker), name_prefix="dropped_")
    assert again.worker_names == names and again.env("RANK") == ["0", "1"]
    again.shutdown()
    pool.remove()


def _named(name: str) -> bool:
    try:
        ray.get_actor(name)
        return True
    except ValueError:
        return False


def test_parallel_put_keeps_order(ray_cluster):
    data = [{"k": i} for i in range(20)] + [torch.arange(5)]
    refs = parallel_put(data, max_workers=3)
    values = ray.get(refs)
    assert values[:20] == data[:20] and torch.equal(values[20], data[20])
    with pytest.raises(ValueError, match="at least one object") as info:
        parallel_put([])
    assert isinstance(info.value, AssertionError)  # what verl raises
    with pytest.raises(ValueError, match="max_workers"):
        parallel_put([1], max_workers=0)

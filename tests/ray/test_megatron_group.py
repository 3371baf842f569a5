"""MegatronRayWorkerGroup with the tp Llama MLP on megatron-core (CPU, gloo): layout,
shard shapes, outputs equal to an unsharded reference built from the shards, the layer
loaded from a safetensors checkpoint with a config that travels as JSON, the Megatron
layout declared as a mesh (as verl's Megatron workers do), and the Megatron PROTO modes
called with ``blocking=False``.

A Megatron rank is the costliest process of the suite (megatron-core's import), so the
module keeps two groups, tp=4 and tp=2 x dp=2, and runs every test that fits on them."""

from __future__ import annotations

import json

import pytest
import ray
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict

from single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from single_controller.megatron.parallel_info import MegatronGlobalInfo, MegatronRankInfo
from single_controller.megatron.worker import MegatronWorker
from single_controller.models.mlp_worker import MLPLayerWorker
from single_controller.ray import MegatronRayWorkerGroup, RayClassWithInitArgs, RayResourcePool
from tests.mlp_reference import checkpoint_mlp, write_llama_mlp_checkpoint
from tests.ray.test_non_blocking_modes import resolve, shifted, tensordict

HIDDEN, FFN = 64, 128


@ray.remote
class MeshLayerWorker(MLPLayerWorker.__ray_actor_class__):
    """The tutorial's layer worker, plus a verl v0.7-style method on the Megatron mesh and
    two non-blocking Megatron PROTO methods that move each dp rank's rows by 100 * dp rank."""

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(MegatronWorker.megatron_mesh_name))
    def run_rows(self, data: TensorDict) -> TensorDict:
        with torch.no_grad():
            y = self.parallel_layer(data["x"])
        return TensorDict({"y": y, "dp": torch.full((len(data),), self.get_megatron_rank_info().dp_rank)},
                          batch_size=data.batch_size)

    @register(Dispatch.MEGATRON_COMPUTE_PROTO, blocking=False)
    def forward(self, batch):
        return shifted(batch, self.get_megatron_rank_info().dp_rank)

    @register(Dispatch.MEGATRON_PP_AS_DP_PROTO, blocking=False)
    def forward_pp(self, batch):
        return shifted(batch, self.get_megatron_rank_info().dp_rank)


def make_group(world: int, tp: int, prefix: str, cls=MLPLayerWorker, **worker_kwargs):
    pool = RayResourcePool([world], use_gpu=False, name_prefix=prefix)
    group = MegatronRayWorkerGroup(
        resource_pool=pool,
        ray_cls_with_init=RayClassWithInitArgs(cls=cls, **worker_kwargs),
        default_megatron_kwargs={
            "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": 1,
            "num_layers_per_virtual_pipeline_stage": None,
        },
    )
    return pool, group


def config(tp: int):
    return OmegaConf.create(
        {"hidden_size": HIDDEN, "intermediate_size": FFN, "hidden_act": "silu", "pretraining_tp": 1, "tp": tp}
    )


def reference(shards: list[dict[str, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    """The unsharded layer, assembled from one tp group's shards, in float64."""
    gate = torch.cat([s["gate_up_proj.weight"].double().chunk(2, dim=0)[0] for s in shards], dim=0)
    up = torch.cat([s["gate_up_proj.weight"].double().chunk(2, dim=0)[1] for s in shards], dim=0)
    down = torch.cat([s["down_proj.weight"].double() for s in shards], dim=1)
    h = x.double()
    return (torch.nn.functional.silu(h @ gate.T) * (h @ up.T)) @ down.T


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


@pytest.fixture(scope="module")
def tp4(ray_cluster, tmp_path_factory):
    # the workers read checkpoints only under the tests' temporary directory
    pool, group = make_group(4, 4, "tp4", MeshLayerWorker, checkpoint_dirs=[str(tmp_path_factory.getbasetemp())])
    yield group
    group.shutdown()
    pool.remove()


def test_tutorial_layout_numbers(tp4):
    assert (tp4.world_size, tp4.tp_size, tp4.pp_size, tp4.dp_size) == (4, 4, 1, 1)
    assert tp4.get_megatron_global_info() == MegatronGlobalInfo(tp_size=4, dp_size=1, pp_size=1, cp_size=1)
    assert [tp4.get_megatron_rank_info(r) for r in range(4)] == [
        MegatronRankInfo(tp_rank=r, dp_rank=0, pp_rank=0, cp_rank=0) for r in range(4)
    ]


def test_tp4_matches_reference(tp4):
    assert tp4.init_model(config(4)) == [None] * 4
    shards = tp4.get_weights()
    for shard in shards:
        assert shard["gate_up_proj.weight"].shape == (2 * FFN // 4, HIDDEN)
        assert shard["down_proj.weight"].shape == (HIDDEN, FFN // 4)
    x = torch.rand(8, 2, HIDDEN)
    (y,) = tp4.run_layer([x])
    assert y.shape == (8, 2, HIDDEN)
    assert rel_err(y, reference(shards, x)) <= 1e-5
    # bitwise the same when run again
    assert torch.equal(tp4.run_layer([x])[0], y)
    # re-initialising with the same seed rebuilds the same weights, and the same output
    tp4.init_model(config(4))
    again = tp4.get_weights()
    assert all(torch.equal(a[k], b[k]) for a, b in zip(shards, again, strict=True) for k in a)
    assert torch.equal(tp4.run_layer([x])[0], y)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A two-layer Hugging Face Llama layout (MLP tensors only), and its tensors."""
    return write_llama_mlp_checkpoint(tmp_path_factory.mktemp("llama"), HIDDEN, FFN, layers=2, seed=3)


def test_tp4_loads_a_checkpoint_layer_from_a_json_config(tp4, checkpoint):
    path, tensors = checkpoint
    # the body of POST /v1/groups/mlp/init_model, and a serve config's init_calls kwargs
    body = json.loads(json.dumps({"kwargs": {"config": {"checkpoint": str(path), "layer_index": 1}}}))
    assert tp4.init_model(**body["kwargs"]) == [None] * 4
    shards = tp4.get_weights()
    gate, up = tensors["model.layers.1.mlp.gate_proj.weight"], tensors["model.layers.1.mlp.up_proj.weight"]
    down = tensors["model.layers.1.mlp.down_proj.weight"]
    for rank, shard in enumerate(shards):
        rows = slice(rank * FFN // 4, (rank + 1) * FFN // 4)
        assert torch.equal(shard["gate_up_proj.weight"], torch.cat([gate[rows], up[rows]]))
        assert torch.equal(shard["down_proj.weight"], down[:, rows])
    x = torch.rand(5, 2, HIDDEN)
    (y,) = tp4.run_layer([x])
    assert rel_err(y, checkpoint_mlp(tensors, 1, x)) <= 1e-5


def test_bad_init_model_keeps_the_layer(tp4, checkpoint):
    path, _ = checkpoint
    tp4.init_model(config(4))
    before = tp4.get_weights()
    bad = {
        "layer_index 2 out of range": {"checkpoint": str(path), "layer_index": 2},
        "does not exist": {"checkpoint": str(path) + ".missing", "layer_index": 0},
        "config hidden_size 32 but the checkpoint's layer 0 has 64": {
            "checkpoint": str(path), "layer_index": 0, "hidden_size": 32
        },
        # 3 * 2**40 parameters: refused by the worker's default bound, before allocating
        "exceeds max_parameters": {"hidden_size": 1 << 20, "intermediate_size": 1 << 20},
    }
    for message, bad_config in bad.items():
        with pytest.raises(ValueError, match=message):
            tp4.init_model(bad_config)
    after = tp4.get_weights()
    assert all(torch.equal(a[k], b[k]) for a, b in zip(before, after, strict=True) for k in a)


def test_bad_inputs_raise_value_errors(tp4):
    tp4.init_model(config(4))
    with pytest.raises(ValueError, match="one item per dp rank: expected length 1, got 2"):
        tp4.run_layer([torch.rand(2, 1, HIDDEN), torch.rand(2, 1, HIDDEN)])
    with pytest.raises(Exception, match=r"input must be \[seq, batch, 64\]"):
        tp4.run_layer([torch.rand(2, 1, HIDDEN + 1)])


#: Workers bounded to exactly one layer of this size (3 * 64 * 128 parameters).
LAYER_PARAMETERS = 3 * HIDDEN * FFN


def dp0_shards(group) -> list[dict[str, torch.Tensor]]:
    """The weights of dp rank 0's tp group, in tp order: the whole layer once."""
    shards = group.get_weights()
    return [shards[r] for r in range(group.world_size) if group.get_megatron_rank_info(r).dp_rank == 0]


def check_layer_and_bound(group, tp: int) -> None:
    """The layer matches the reference built from one tp group's shards, and a layer past
    the workers' bound is refused, leaving the layer as it was."""
    group.init_model(config(tp))
    shards = dp0_shards(group)
    x = torch.rand(6, 3, HIDDEN)
    y = group.run_layer([x] * group.dp_size)[0]
    assert rel_err(y, reference(shards, x)) <= 1e-5
    bigger = OmegaConf.merge(config(tp), {"intermediate_size": 2 * FFN})
    with pytest.raises(ValueError, match=f"exceeds max_parameters {LAYER_PARAMETERS}"):
        group.init_model(bigger)
    assert torch.equal(group.run_layer([x] * group.dp_size)[0], y)


def test_tp1_matches_reference(ray_cluster):
    pool, group = make_group(1, 1, "tp1", max_parameters=LAYER_PARAMETERS)
    try:
        assert (group.tp_size, group.dp_size) == (1, 1)
        check_layer_and_bound(group, 1)
    finally:
        group.shutdown()
        pool.remove()


@pytest.fixture(scope="module")
def tp2dp2(ray_cluster):
    pool, group = make_group(4, 2, "tp2dp2", MeshLayerWorker, max_parameters=LAYER_PARAMETERS)
    yield group
    group.shutdown()
    pool.remove()


def test_tp2_matches_reference(tp2dp2):
    check_layer_and_bound(tp2dp2, 2)


def test_tp2_dp2_each_dp_rank_gets_its_input(tp2dp2):
    group = tp2dp2
    assert (group.tp_size, group.dp_size, group.pp_size, group.cp_size) == (2, 2, 1, 1)
    assert group.get_megatron_global_info() == MegatronGlobalInfo(tp_size=2, dp_size=2, pp_size=1, cp_size=1)
    # megatron's default order puts tp fastest: ranks 0,1 are dp 0 and ranks 2,3 dp 1
    assert [group.get_megatron_rank_info(r) for r in range(4)] == [
        MegatronRankInfo(tp_rank=r % 2, dp_rank=r // 2, pp_rank=0, cp_rank=0) for r in range(4)
    ]
    group.init_model(config(2))
    dp0 = dp0_shards(group)
    # large enough (>= 64 KiB) to travel through the object store
    x0, x1 = torch.rand(128, 4, HIDDEN), torch.rand(130, 3, HIDDEN)
    before = group.object_store_puts
    y0, y1 = group.run_layer([x0, x1])
    # each dp input went to the object store once, for its two tp ranks
    assert group.object_store_puts - before == 2
    assert y0.shape == (128, 4, HIDDEN) and y1.shape == (130, 3, HIDDEN)
    assert rel_err(y0, reference(dp0, x0)) <= 1e-5
    assert rel_err(y1, reference(dp0, x1)) <= 1e-5


def test_megatron_proto_modes_non_blocking(tp2dp2):
    """MEGATRON_COMPUTE_PROTO and MEGATRON_PP_AS_DP_PROTO with ``blocking=False`` answer
    futures that collect to the blocking answer (see test_non_blocking_modes.py)."""
    # dp rank 0 gets rows 0-1, dp rank 1 rows 2-3 (moved by 100); 3 rows pad to 4
    assert resolve(tp2dp2.forward(tensordict(4)))["x"].tolist() == [0.0, 1.0, 102.0, 103.0]
    assert resolve(tp2dp2.forward(tensordict(3)))["x"].tolist() == [0.0, 1.0, 102.0]
    assert resolve(tp2dp2.forward_pp(tensordict(4)))["x"].tolist() == [0.0, 1.0, 102.0, 103.0]


def test_the_megatron_mesh_is_dp_collected_on_tp_zero_of_the_last_stage(tp4, tp2dp2):
    assert tp4.meshes()["megatron"].describe() == {"dp_size": 1, "dp_ranks": [0] * 4, "collect_ranks": [0]}
    assert tp2dp2.meshes()["megatron"].describe() == {"dp_size": 2, "dp_ranks": [0, 0, 1, 1], "collect_ranks": [0, 2]}


def test_megatron_compute_and_the_mesh_method_run_the_same_layer(tp4):
    tp4.init_model(config(4))
    x = torch.rand(6, 2, HIDDEN)
    (y,) = tp4.run_layer([x])
    puts = tp4.object_store_puts
    out = tp4.run_rows(TensorDict({"x": x}, batch_size=[6]))
    assert tp4.object_store_puts - puts == 1  # the one dp part, put once for the four tp ranks
    assert out["dp"].tolist() == [0] * 6
    torch.testing.assert_close(out["y"], y)


def test_example_chapter_4_small(tp4):
    """examples/megatron_mlp.py's chapter 4 on the same pool (its own group, colocated)."""
    from examples.megatron_mlp import run_chapter_4

    out = run_chapter_4(
        tp4.resource_pool, seq_len=8, batch_size=2, hidden_size=HIDDEN, ffn_hidden_size=FFN, check=True
    )
    assert out["layout"] == (4, 4, 1, 1)
    assert out["init_model"] == [None] * 4
    assert out["output_shape"] == (8, 2, HIDDEN)
    assert out["rel_err"] <= 1e-5

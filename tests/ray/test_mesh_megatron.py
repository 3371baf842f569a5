"""A Megatron group declares its layout as a mesh, as verl's Megatron workers do: on the
tutorial's tp=4 MLP layer group, the tutorial's MEGATRON_COMPUTE method and a method
dispatched by the Megatron mesh (``make_nd_compute_dataproto_dispatch_fn``) both run the
layer, and agree."""

from __future__ import annotations

import pytest
import ray
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict

from single_controller.base.decorator import make_nd_compute_dataproto_dispatch_fn, register
from single_controller.megatron.worker import MegatronWorker
from single_controller.models.mlp_worker import MLPLayerWorker
from single_controller.ray import MegatronRayWorkerGroup, RayClassWithInitArgs, RayResourcePool

HIDDEN, FFN = 64, 128


@ray.remote
class MeshMLPLayerWorker(MLPLayerWorker.__ray_actor_class__):
    """The tutorial's layer worker, plus a verl v0.7-style method on the Megatron mesh."""

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(MegatronWorker.megatron_mesh_name))
    def run_rows(self, data: TensorDict) -> TensorDict:
        with torch.no_grad():
            y = self.parallel_layer(data["x"])
        return TensorDict({"y": y, "dp": torch.full((len(data),), self.get_megatron_rank_info().dp_rank)},
                          batch_size=data.batch_size)


@pytest.fixture(scope="module")
def layer_group(ray_cluster):
    pool = RayResourcePool([4], use_gpu=False, name_prefix="meshmlp")
    group = MegatronRayWorkerGroup(
        pool, RayClassWithInitArgs(cls=MeshMLPLayerWorker), default_megatron_kwargs={"tensor_model_parallel_size": 4}
    )
    group.init_model(OmegaConf.create(
        {"hidden_size": HIDDEN, "intermediate_size": FFN, "hidden_act": "silu", "pretraining_tp": 1, "tp": 4}
    ))
    yield group
    group.shutdown()
    pool.remove()


def test_the_megatron_mesh_is_dp_collected_on_tp_zero_of_the_last_stage(layer_group):
    assert (layer_group.tp_size, layer_group.dp_size, layer_group.pp_size) == (4, 1, 1)
    assert layer_group.meshes()["megatron"].describe() == {"dp_size": 1, "dp_ranks": [0] * 4, "collect_ranks": [0]}


def test_megatron_compute_and_the_mesh_method_run_the_same_layer(layer_group):
    x = torch.rand(6, 2, HIDDEN)
    (y,) = layer_group.run_layer([x])
    puts = layer_group.object_store_puts
    out = layer_group.run_rows(TensorDict({"x": x}, batch_size=[6]))
    assert layer_group.object_store_puts - puts == 1  # the one dp part, put once for the four tp ranks
    assert out["dp"].tolist() == [0] * 6
    torch.testing.assert_close(out["y"], y)

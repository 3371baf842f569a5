"""The served MLP layer loaded from a checkpoint named in the config, then from another
layer by a call, survives a worker's death: the rebuilt ranks read the same slices again
(the config's ``init_calls``, then the journal's ``init_model``) and answer bit for bit as
before. The controller runs in this process, on the session's cluster (no Serve)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import ray
import torch
from safetensors.torch import save_file

from deployments.builder import PoolSet, units
from deployments.config import load_config
from deployments.contract import CallRequest, ErrorKind
from deployments.controller import GroupController
from deployments.placement import GpuBudget, plan_deployment

HIDDEN, FFN, LAYERS = 64, 128, 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    g = torch.Generator().manual_seed(7)
    tensors = {}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}.mlp."
        tensors[prefix + "gate_proj.weight"] = torch.randn(FFN, HIDDEN, generator=g) / 8
        tensors[prefix + "up_proj.weight"] = torch.randn(FFN, HIDDEN, generator=g) / 8
        tensors[prefix + "down_proj.weight"] = torch.randn(HIDDEN, FFN, generator=g) / 8
    path = tmp_path_factory.mktemp("llama") / "model.safetensors"
    save_file(tensors, str(path))
    return path, tensors


@pytest.fixture(scope="module")
def served(ray_cluster, checkpoint):
    """A controller of one tp=2 MLP group whose config names layer 0 of the checkpoint."""
    path, _ = checkpoint
    config = load_config({"deployments": [{
        "name": "layer",
        "groups": [{
            "name": "mlp",
            "worker": "single_controller.models.mlp_worker:MLPLayerWorker",
            "init_kwargs": {"checkpoint_dirs": [str(path.parent)]},
            "pool": {"process_on_nodes": [2], "name_prefix": "rebuild_mlp"},
            "megatron": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1},
            "init_calls": [{"method": "init_model", "kwargs": {"config": {"checkpoint": str(path), "layer_index": 0}}}],
            "read_only": ["get_weights", "run_layer"],
        }],
    }]})
    deployment = config.deployments[0]
    plan = plan_deployment(deployment, config, GpuBudget(0))
    pools = PoolSet(plan)
    controller = GroupController(deployment, plan, units(deployment, plan, pools), request_timeout_s=60,
                                 health_timeout_s=2.0)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(controller.start(), loop).result(timeout=300)
    yield controller, loop
    controller.shutdown()
    pools.remove()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


def call(served, method: str, *args, **kwargs):
    controller, loop = served
    return asyncio.run_coroutine_threadsafe(
        controller.call(CallRequest("mlp", method, list(args), kwargs)), loop
    ).result(timeout=120)


def reference(x: torch.Tensor, tensors: dict[str, torch.Tensor], layer: int) -> torch.Tensor:
    weight = {name: tensors[f"model.layers.{layer}.mlp.{name}.weight"].double() for name in ("gate_proj", "up_proj", "down_proj")}
    h = x.double()
    return (torch.nn.functional.silu(h @ weight["gate_proj"].T) * (h @ weight["up_proj"].T)) @ weight["down_proj"].T


def rel_err(y: torch.Tensor, expected: torch.Tensor) -> float:
    return ((y.double() - expected).norm() / expected.norm()).item()


def test_a_rebuilt_layer_reads_the_same_checkpoint_slices(served, checkpoint):
    _, tensors = checkpoint
    x = torch.rand(4, 2, HIDDEN, generator=torch.Generator().manual_seed(3))

    first = call(served, "run_layer", [x])
    assert first.ok, first.error
    assert rel_err(first.output[0], reference(x, tensors, 0)) <= 1e-5  # the config's layer 0
    assert call(served, "init_model", {"checkpoint": str(checkpoint[0]), "layer_index": 1}).ok
    before = call(served, "run_layer", [x]).output[0]
    assert rel_err(before, reference(x, tensors, 1)) <= 1e-5  # the call's layer 1
    weights_before = call(served, "get_weights").output

    controller, _ = served
    state = controller.groups["mlp"]
    rebuilds = state.unit.rebuilds
    ray.kill(state.group._workers[1], no_restart=True)

    answer = call(served, "run_layer", [x])  # the dead rank fails the call, which starts the rebuild
    assert not answer.ok and answer.error.kind is ErrorKind.UNAVAILABLE, answer.error
    deadline = time.monotonic() + 120
    while not controller.ready()["mlp"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert controller.ready()["mlp"], state.unit.last_error
    assert state.unit.rebuilds == rebuilds + 1 and state.unit.replayed >= 1

    after = call(served, "run_layer", [x])
    assert after.ok, after.error
    assert torch.equal(after.output[0], before)  # layer 1 again, bit for bit
    weights_after = call(served, "get_weights").output
    for old, new in zip(weights_before, weights_after, strict=True):
        assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)

"""The controller on the session's Ray cluster, in this process (no Serve): calls that reach
some ranks only (undone in place), replay of calls whose dispatch changes its arguments, health checks while
a call runs, library keywords out of a caller's reach, and an MLP layer loaded from a
checkpoint that a rebuild reads again."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.control.builder import PoolSet, units
from hybridflow.control.contract import CallRequest, ErrorKind
from hybridflow.control.controller import GroupController
from hybridflow.control.placement import GpuBudget, plan_deployment
from hybridflow.state.codec import decode_call
from tests.mlp_reference import assert_close, checkpoint_mlp, write_llama_mlp_checkpoint
from tests.ray.conftest import kill_rank

WORKERS = "single_controller.models.tutorial_workers"
HIDDEN, FFN = 64, 128


def deployment_args(checkpoint: str) -> dict:
    return {"deployments": [{
        "name": "checks",
        "groups": [
            # on Ray tasks: a call whose argument Ray cannot serialise for one rank reaches
            # the ranks before it only (a socket channel pickles every rank's frame first;
            # test_transports runs the same calls on every transport)
            {"name": "acc", "worker": f"{WORKERS}:GPUAccumulator", "pool": {"process_on_nodes": [4], "name_prefix": "acc"},
             "read_only": ["get_value"], "transport": "tasks"},
            # foo_custom is mutating here: its journal entries must survive the dispatch
            {"name": "actor", "worker": "examples.transport_check:TransportCheckActor", "init_kwargs": {"x": 2},
             "pool": {"process_on_nodes": [4], "name_prefix": "actor"}, "read_only": ["foo", "history"]},
            # a tp=2 layer whose config names layer 0 of a checkpoint
            {"name": "mlp", "worker": "single_controller.models.mlp_worker:MLPLayerWorker",
             "init_kwargs": {"checkpoint_dirs": [os.path.dirname(checkpoint)]},
             "pool": {"process_on_nodes": [2], "name_prefix": "mlp"},
             "megatron": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1},
             "init_calls": [{"method": "init_model", "kwargs": {"config": {"checkpoint": checkpoint, "layer_index": 0}}}],
             "read_only": ["get_weights", "run_layer"]},
        ],
    }]}


HEALTH_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    path, tensors = write_llama_mlp_checkpoint(tmp_path_factory.mktemp("llama"), HIDDEN, FFN, layers=2, seed=7)
    return str(path), tensors


@pytest.fixture(scope="module")
def controller(ray_cluster, loop, checkpoint):
    config = load_config(deployment_args(checkpoint[0]))
    deployment = config.deployments[0]
    plan = plan_deployment(deployment, config, GpuBudget(0))
    pools = PoolSet(plan)
    # A ping timeout short enough that the long call below outlasts three of them, and long
    # enough that an idle rank on a loaded machine (Ray runs workers at nice 15) answers.
    made = GroupController(deployment, plan, units(deployment, plan, pools), request_timeout_s=60,
                           health_timeout_s=HEALTH_TIMEOUT_S)
    asyncio.run_coroutine_threadsafe(made.start(), loop).result(timeout=300)
    yield made
    made.shutdown()
    pools.remove()


class Unsendable:
    """Copies as itself; Ray cannot serialise it to send it to a worker."""

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        raise TypeError("this argument cannot be sent")


def run(loop, coro, timeout: float = 120):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=timeout)


def call(loop, controller, group, method, *args, **kwargs):
    return run(loop, controller.call(CallRequest(group, method, list(args), kwargs)))


def values(loop, controller) -> list[float]:
    result = call(loop, controller, "acc", "get_value")
    assert result.ok, result.error
    return [t.item() for t in result.output]


def wait_ready(controller, group: str, timeout_s: float = 90) -> None:
    unit = controller.groups[group].unit
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if unit.status == "ready" and not unit.recovering:
            return
        time.sleep(0.2)
    raise AssertionError(f"{group} not ready: {controller.groups[group].unit.last_error}")


def test_a_call_that_reaches_some_ranks_only_is_undone_in_place(loop, controller, monkeypatch):
    assert call(loop, controller, "acc", "add", x=[1, 1, 1, 1]).ok
    before = values(loop, controller)
    rebuilds = controller.groups["acc"].unit.rebuilds
    workers = list(controller.groups["acc"].group.workers)
    # The state store refuses what it cannot encode before anything is sent; here it takes
    # the call as it is, so that Ray's own serialisation fails part way through the ranks.
    durability = controller.groups["acc"].durability

    async def encoded_as_is(method, args, kwargs):
        return b"unencoded"

    monkeypatch.setattr(durability, "encode", encoded_as_is)
    # rank 2's argument cannot be serialised: ranks 0 and 1 got the call, 2 and 3 did not
    result = call(loop, controller, "acc", "add", x=[1, 1, Unsendable(), 1])
    monkeypatch.undo()
    assert result.error.kind is ErrorKind.UNAVAILABLE and result.error.retry_after_s
    wait_ready(controller, "acc")
    # restored on its own processes (GPUAccumulator has state_dict and load_state_dict)
    assert controller.groups["acc"].unit.rebuilds == rebuilds
    assert controller.groups["acc"].group.workers == workers
    assert controller.ready()["acc"]  # readiness never dropped for it
    assert values(loop, controller) == before


def test_replay_gives_a_custom_dispatch_the_call_as_sent(loop, controller):
    answer = call(loop, controller, "actor", "foo_custom", x=[1, 2], y=[5, 6])
    assert answer.ok and answer.output == [8, 10, 8, 10]
    state = controller.groups["actor"]
    stored = state.durability.store.load(state.durability.scope)
    # the store holds the call as sent: the dispatch appended to the caller's lists afterwards
    assert decode_call(stored.entries[-1][1]) == ("foo_custom", (), {"x": [1, 2], "y": [5, 6]})
    before = call(loop, controller, "actor", "history").output
    run(loop, _recover(controller, "actor"))
    wait_ready(controller, "actor")
    assert state.unit.status == "ready" and state.unit.last_error is None
    # the rebuilt ranks replayed it (and the rest of the journal) without a failure
    assert call(loop, controller, "actor", "history").output == before


async def _recover(controller, group):
    controller.supervisor.recover(controller.groups[group].unit, "test")


def test_health_checks_during_a_long_call_do_not_rebuild(loop, controller):
    unit = controller.groups["actor"].unit
    rebuilds = unit.rebuilds

    async def scenario():
        seconds = 3 * HEALTH_TIMEOUT_S + 1
        slow = asyncio.ensure_future(controller.call(CallRequest("actor", "sleep", [], {"seconds": seconds})))
        statuses = []
        while not slow.done():  # each check waits the health timeout: the pings wait behind the call
            statuses.append(await controller.check_health())
        return await slow, statuses, seconds

    result, statuses, seconds = run(loop, scenario())
    assert result.ok and result.output == [float(seconds)] * 4
    assert len(statuses) >= 3 and all(s["actor"] == "ready" for s in statuses)
    assert unit.rebuilds == rebuilds


def test_library_keywords_are_not_reachable_from_arguments(loop, controller):
    # Ray checks the worker method's signature as the call is submitted: nothing runs
    for group, method in (("acc", "get_value"), ("actor", "history")):
        result = call(loop, controller, group, method, blocking=False)
        assert result.error.kind is ErrorKind.BAD_ARGUMENTS and "'blocking'" in result.error.message


def test_a_custom_dispatch_that_fails_is_the_callers_error(loop, controller):
    for kwargs in ({"x": [1, 2, 3], "y": [5, 6]}, {"x": "ab", "y": [5, 6]}):
        result = call(loop, controller, "actor", "foo_custom", **kwargs)
        assert result.error.kind is ErrorKind.BAD_ARGUMENTS, result.error
        assert "two_to_all_dispatch_fn raised" in result.error.message


def test_a_dataproto_through_the_controller(loop, controller):
    """The library's answer of the served PROTO method that
    tests/e2e/test_http_service.py calls over HTTP: the same numbers."""
    import numpy as np
    import torch

    from single_controller.protocol import DataProto

    data = DataProto.from_dict({"x": torch.arange(16.0).reshape(8, 2)}, {"uid": np.arange(8)}, {"t": 0.7})
    result = call(loop, controller, "actor", "score", data=data)
    assert result.ok, result.error
    out = result.output
    assert torch.equal(out.batch["y"], data.batch["x"] * 2)
    assert out.non_tensor_batch["rank"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert out.meta_info == {"t": 0.7, "world_size": 4}


def test_a_rebuilt_layer_reads_the_same_checkpoint_slices(loop, controller, checkpoint):
    """The config's init_calls load layer 0, a call loads layer 1; after a worker's death the
    rebuilt ranks replay both and answer bit for bit as before."""
    path, tensors = checkpoint
    x = torch.rand(4, 2, HIDDEN, generator=torch.Generator().manual_seed(3))
    first = call(loop, controller, "mlp", "run_layer", [x])
    assert first.ok, first.error
    assert_close(first.output[0], checkpoint_mlp(tensors, 0, x))  # the config's layer 0
    assert call(loop, controller, "mlp", "init_model", {"checkpoint": path, "layer_index": 1}).ok
    before = call(loop, controller, "mlp", "run_layer", [x]).output[0]
    assert_close(before, checkpoint_mlp(tensors, 1, x))  # the call's layer 1
    weights_before = call(loop, controller, "mlp", "get_weights").output

    state = controller.groups["mlp"]
    rebuilds = state.unit.rebuilds
    kill_rank(state.group._workers[1])
    answer = call(loop, controller, "mlp", "run_layer", [x])  # the dead rank fails it: the rebuild starts
    assert not answer.ok and answer.error.kind is ErrorKind.UNAVAILABLE, answer.error
    wait_ready(controller, "mlp", timeout_s=120)
    assert state.unit.rebuilds == rebuilds + 1 and state.unit.replayed >= 1

    after = call(loop, controller, "mlp", "run_layer", [x])
    assert after.ok, after.error
    assert torch.equal(after.output[0], before)  # layer 1 again, bit for bit
    weights_after = call(loop, controller, "mlp", "get_weights").output
    for old, new in zip(weights_before, weights_after, strict=True):
        assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)


def test_a_megatron_group_shows_its_mesh_and_a_plain_group_none(loop, controller):
    # MegatronWorker declares its dp layout under the mesh "megatron": tp=2 is one dp rank,
    # collected on tp rank 0
    assert run(loop, controller.describe_group("mlp")).meshes == {"megatron": {"dp_size": 1, "collect_ranks": [0]}}
    assert run(loop, controller.describe_group("acc")).meshes is None

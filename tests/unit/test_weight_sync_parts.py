"""The parts of a served weight sync that need no Ray: ``weights_from`` and
``state.weights_dir`` in the config, which syncs a restore replays (and so which files it
needs), the fence that holds a group's calls back, and the weights version from a group
call through batching to the answer's parameters."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hybridflow.config import ConfigError, StateConfig, load_config
from hybridflow.control.batching import Batcher, Ran, run_alone
from hybridflow.control.contract import InferResult
from hybridflow.control.fence import Fence
from hybridflow.control.weights import replayed_syncs

MLP = "single_controller.models.mlp_worker:MLPLayerWorker"


def mlp(name: str, tp: int = 1, **extra) -> dict:
    return {"name": name, "worker": MLP, "pool": {"process_on_nodes": [tp]},
            "megatron": {"tensor_model_parallel_size": tp}, **extra}


def problems(deployments: list[dict]) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config({"deployments": deployments})
    return str(caught.value)


def test_weights_from_names_a_group_of_the_same_deployment_that_declares_weights():
    config = load_config({"deployments": [{"name": "d", "groups": [mlp("a", 2), mlp("b", weights_from="a")]}]})
    assert config.deployments[0].groups[1].weights_from == "a"
    assert "weights_from: a group cannot take its weights from itself" in problems(
        [{"name": "d", "groups": [mlp("a", weights_from="a")]}])
    other = problems([{"name": "d", "groups": [mlp("b", weights_from="a")]}, {"name": "e", "groups": [mlp("a")]}])
    assert "groups[b].weights_from: unknown group 'a' in deployment 'd'" in other
    assert "groups of one deployment" in other
    counter = {"name": "c", "worker": "single_controller.models.tutorial_workers:GPUAccumulator",
               "pool": {"process_on_nodes": [2]}}
    no_weights = problems([{"name": "d", "groups": [counter, mlp("b", weights_from="c")]}])
    assert "group 'c''s worker GPUAccumulator declares no weights" in no_weights
    plain = {"name": "p", "worker": "single_controller.models.tutorial_workers:Accumulator", "plain_actor": True}
    assert "weight syncs need groups on processes of their own" in problems(
        [{"name": "d", "groups": [plain, mlp("b", weights_from="p")]}])
    assert "weights_from needs a group of its own processes" in problems(
        [{"name": "d", "groups": [{**plain, "weights_from": "b"}, mlp("b")]}])


def test_the_weights_directory_defaults_beside_the_state_file(tmp_path):
    beside = StateConfig(path="state/s.db").resolved(env={}, cwd=tmp_path)
    assert beside.weights_dir is None and beside.weights_directory() == str(tmp_path / "state" / "weights")
    chosen = StateConfig(path="s.db", weights_dir="shared/w").resolved(env={}, cwd=tmp_path)
    assert chosen.weights_directory() == str(tmp_path / "shared" / "w")
    redis = StateConfig(redis_url="redis://h:6379/0").resolved(env={}, cwd=tmp_path)
    assert redis.weights_directory() == str(tmp_path / ".hybridflow" / "weights")
    assert StateConfig(path=None).weights_directory() is None  # a temporary directory of the controller's
    overridden = StateConfig(path="s.db").resolved(env={"SC_STATE_PATH": str(tmp_path / "o" / "x.db")}, cwd=tmp_path)
    assert overridden.weights_directory() == str(tmp_path / "o" / "weights")
    with pytest.raises(ValueError):
        StateConfig(weights_dir=" ")


def test_a_restore_replays_only_the_last_of_consecutive_syncs():
    syncs = {1: "v1-a", 2: "v2-b", 4: "v3-c", 6: "v4-d"}
    # 1, 2: consecutive (1 replaced); 3: a call after 2; 4; 5 aborted (never acknowledged); 6 follows 4
    assert replayed_syncs([1, 2, 3, 4, 6], syncs) == {2: "v2-b", 6: "v4-d"}
    assert replayed_syncs([1, 2, 3, 4, 5, 6], syncs) == {2: "v2-b", 4: "v3-c", 6: "v4-d"}
    assert replayed_syncs([4, 3, 1], syncs) == {1: "v1-a", 4: "v3-c"}  # in sequence order
    assert replayed_syncs([3, 4, 6], syncs) == {6: "v4-d"}  # a snapshot holds 1 and 2
    assert replayed_syncs([], syncs) == {} and replayed_syncs([1, 2], {}) == {}


def test_the_fence_holds_calls_back_until_the_operation_ends():
    async def scenario() -> list[str]:
        fence, order = Fence(), []

        async def a_call(name: str) -> None:
            await fence.passed()
            order.append(name)

        await a_call("before")  # an open fence lets a call through at once
        async with fence.held():
            waiting = [asyncio.ensure_future(a_call(f"held {i}")) for i in range(3)]
            await asyncio.sleep(0.01)
            order.append("operation")
            assert fence.closed
        await asyncio.gather(*waiting)
        assert not fence.closed
        return order

    assert asyncio.run(scenario()) == ["before", "operation", "held 0", "held 1", "held 2"]


def test_a_fence_opens_when_its_operation_raises():
    async def scenario() -> None:
        fence = Fence()
        with pytest.raises(RuntimeError):
            async with fence.held():
                raise RuntimeError("commit failed")
        await asyncio.wait_for(fence.passed(), 1)

    asyncio.run(scenario())


def test_the_weights_version_goes_from_the_group_call_to_the_answer():
    async def scenario() -> tuple:
        async def run(x: torch.Tensor) -> Ran:
            return Ran(x * 2, weights_version=7)

        batcher = Batcher(run, max_batch_size=4, max_delay_s=0.01)
        batched = await asyncio.gather(*(batcher.submit(torch.ones(1, 2)) for _ in range(3)))
        alone = await run_alone(run, torch.ones(1, 2))
        return batched, alone

    batched, alone = asyncio.run(scenario())
    assert {b.weights_version for b in batched} == {7} and alone.weights_version == 7
    assert torch.equal(batched[0].output, torch.full((1, 2), 2.0))
    assert InferResult(batch_size=3, weights_version=7).answer_parameters() == {"batch_size": 3, "weights_version": 7}
    assert InferResult(weights_version=0).answer_parameters() == {"weights_version": 0}
    assert InferResult().answer_parameters() == {}

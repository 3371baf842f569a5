"""The parts of a served weight sync that need no Ray cluster: ``weights_from``,
``state.weights_dir``, ``state.weights_kept`` and ``limits.weight_syncs_queued`` in the
config, which syncs a restore replays (and so which files it needs), the queue of syncs
into a group (bounded, waiting syncs from one source run once, a waiting sync nobody
waits for never runs, a running one always ends), the one line an error message keeps
of an exception, the fence that holds a group's calls back, and the weights version from
a group call through batching to the answer's parameters."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hybridflow.config import ConfigError, StateConfig, load_config
from hybridflow.control.batching import Batcher, Ran, run_alone
from hybridflow.control.contract import InferResult
from hybridflow.control.fence import Fence
from hybridflow.control.kept_weights import replayed_syncs
from hybridflow.control.sync_queue import SyncQueue
from single_controller.weights.reasons import reason_of, scrub

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
    overridden = StateConfig(path="s.db").resolved(env={"HYBRIDFLOW_STATE_PATH": str(tmp_path / "o" / "x.db")}, cwd=tmp_path)
    assert overridden.weights_directory() == str(tmp_path / "o" / "weights")
    with pytest.raises(ValueError):
        StateConfig(weights_dir=" ")


def test_the_kept_syncs_and_the_sync_queue_are_bounded_in_the_config():
    groups = [{"name": "d", "groups": [mlp("a")]}]
    config = load_config({"deployments": groups})
    assert config.state.weights_kept == 2 and config.limits.weight_syncs_queued == 4
    config = load_config({"deployments": groups, "state": {"weights_kept": 1}, "limits": {"weight_syncs_queued": 0}})
    assert config.state.weights_kept == 1 and config.limits.weight_syncs_queued == 0
    for override, where in (({"state": {"weights_kept": 0}}, "state.weights_kept"),
                            ({"limits": {"weight_syncs_queued": -1}}, "limits.weight_syncs_queued")):
        with pytest.raises(ConfigError, match=where):
            load_config({"deployments": groups, **override})


def test_syncs_wait_in_a_bounded_queue_and_those_from_one_source_run_once():
    async def scenario() -> tuple:
        queue: SyncQueue[str] = SyncQueue(bound=3)
        release = asyncio.Event()
        started: list[str] = []

        def sync(name: str):
            async def run() -> str:
                started.append(name)
                await release.wait()
                return f"{name}: version {len(started)}"
            return run

        answers = [queue.submit("mlp", sync("first"))]  # nothing runs: it starts at once
        await asyncio.sleep(0)
        answers += [queue.submit("mlp", sync(f"mlp {i}")) for i in range(2)]  # wait, together
        answers.append(queue.submit(None, sync("keyed")))  # a request of its own: never shared
        assert queue.waiting == 3 and queue.busy
        refused = queue.submit("mlp", sync("one too many"))
        tasks = [asyncio.ensure_future(a) for a in answers]
        release.set()
        return refused, await asyncio.gather(*tasks), started, queue

    refused, answers, started, queue = asyncio.run(scenario())
    assert refused is None
    assert started == ["first", "mlp 0", "keyed"]  # three runs for four requests, in order
    assert answers == ["first: version 1", "mlp 0: version 2", "mlp 0: version 2", "keyed: version 3"]
    assert queue.waiting == 0 and not queue.busy


def test_a_waiting_sync_nobody_waits_for_never_runs_and_a_running_one_ends():
    async def scenario() -> tuple:
        queue: SyncQueue[str] = SyncQueue(bound=0)
        release, started, ended = asyncio.Event(), [], []

        def sync(name: str):
            async def run() -> str:
                started.append(name)
                await release.wait()
                ended.append(name)
                return name
            return run

        running = asyncio.ensure_future(queue.submit("mlp", sync("running")))
        await asyncio.sleep(0)
        assert queue.submit("mlp", sync("refused")) is None  # bound 0: nothing may wait
        queue.bound = 2
        gone = asyncio.ensure_future(queue.submit("mlp", sync("gone")))
        await asyncio.sleep(0)
        running.cancel()  # its client went away: the run goes on
        gone.cancel()  # nobody waits for it any more: it is dropped
        await asyncio.sleep(0)
        assert queue.waiting == 0
        later = queue.submit("mlp", sync("later"))
        release.set()
        return await later, started, ended

    later, started, ended = asyncio.run(scenario())
    assert later == "later" and started == ["running", "later"] and ended == ["running", "later"]


def test_an_error_message_keeps_one_line_of_an_exception():
    from ray.exceptions import ActorDiedError, RayTaskError

    traceback = ('Traceback (most recent call last):\n  File "/home/svc/single_controller/weights/worker.py", '
                 'line 268, in _commit_weights\n    raise RuntimeError(\nRuntimeError: no weights staged')
    cause = RuntimeError("no weights staged for sync 3fa9 on rank 1 (another sync staged after it)")
    remote = RayTaskError("MLPLayerWorker._commit_weights", traceback, cause, pid=4242, ip="10.20.30.40",
                          actor_id="ffa1b2", actor_repr="<MLPLayerWorker>").as_instanceof_cause()
    raw = str(remote)
    assert "\x1b[" in raw and "pid=4242" in raw and "10.20.30.40" in raw and "/home/svc" in raw  # what Ray says
    assert reason_of(remote) == ("RuntimeError: no weights staged for sync 3fa9 on rank 1 "
                                 "(another sync staged after it)")
    assert scrub(raw) == "RuntimeError: no weights staged"  # a traceback's last line, cleaned
    assert reason_of(ActorDiedError()) == "ActorDiedError"  # its text names the process and node
    assert reason_of(OSError(28, "No space left on device", "/srv/w/v3-ab/rank0.safetensors")) == (
        "OSError: No space left on device")
    assert scrub("\x1b[31m/srv/weights/v3-ab/rank0.safetensors is missing (pid=7, ip=10.0.0.2) at "
                 "[fe80::1] or 192.168.1.9:6379\x1b[0m") == "rank0.safetensors is missing at [<address>] or <address>"
    assert scrub("tp=4 -> tp=2: 3 / 4 shards, weights/rollout v3-ab/rank0") == (
        "tp=4 -> tp=2: 3 / 4 shards, weights/rollout v3-ab/rank0")  # no absolute path, nothing cut
    assert len(scrub("x" * 1000)) == 400


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

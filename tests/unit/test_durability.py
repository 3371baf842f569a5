"""hybridflow.control.durability and the state config, without Ray: a group's scope in a real
SQLite store (opening, mismatch, fresh starts, recorded answers), the journal's waits,
and where the state path is resolved."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest
import torch
import yaml

from hybridflow.config import DEFAULT_STATE_PATH, GroupConfig, StateConfig, load_config
from hybridflow.control.catalogue import catalogue
from hybridflow.control.contract import CallRequest, CallResult, ControllerError, ErrorKind
from hybridflow.control.durability import GroupDurability, decode_result, encode_result, supports_snapshots
from hybridflow.control.placement import GpuBudget, plan_deployment
from hybridflow.control.supervisor import GroupState, RestoreRefused
from hybridflow.state.codec import StateCodecError, encode_call
from hybridflow.state.idempotency import IdempotencyConflict
from hybridflow.state.journal import Journal
from hybridflow.state.store import StateMismatchError
from single_controller.models.mlp_worker import MLPLayerWorker
from single_controller.models.tutorial_workers import GPUAccumulator

ROOT = Path(__file__).resolve().parents[2]
GROUP = GroupConfig(name="gpu_accumulator", worker="single_controller.models.tutorial_workers:GPUAccumulator",
                    pool={"process_on_nodes": [4]}, read_only=["get_value"])


def run(coro):
    return asyncio.run(coro)


def scope(state: StateConfig, config: GroupConfig = GROUP, world_size: int = 4) -> GroupDurability:
    return GroupDurability(state.open(), "accumulators", config, world_size, GPUAccumulator,
                           state.snapshot_every, request_timeout_s=10)


def record(durability: GroupDurability, journal: Journal, x: int, key: str | None = None) -> CallResult:
    entry = journal.begin("add")
    request = CallRequest("gpu_accumulator", "add", kwargs={"x": [x] * 4}, idempotency_key=key,
                          fingerprint=f"body-{x}")
    result = CallResult(output=[torch.tensor([float(x + rank)]) for rank in range(4)], dispatch_mode="EXECUTE_ALL",
                        execute_mode="ALL", world_size=4)
    run(durability.record(durability.pending(entry, encode_call(entry.method, request.args, request.kwargs), request),
                          result))
    journal.acknowledge(entry)
    return result


# -- configuration ----------------------------------------------------------------------


def test_the_state_path_is_resolved_where_serve_run_starts(tmp_path):
    config = StateConfig()
    assert (config.path, config.snapshot_every, config.fresh, config.on_mismatch) == (
        DEFAULT_STATE_PATH, 1000, False, "error")
    assert config.resolved(env={}, cwd=tmp_path).path == str(tmp_path / ".hybridflow" / "state.db")
    assert config.resolved(env={"HYBRIDFLOW_STATE_PATH": "other.db"}, cwd=tmp_path).path == str(tmp_path / "other.db")
    assert config.resolved(env={"HYBRIDFLOW_STATE_PATH": "null"}).location is None
    assert StateConfig(path=None).resolved(env={}).location is None
    # a fresh start from the environment (make serve-fresh), or from the config
    assert config.resolved(env={"HYBRIDFLOW_STATE_FRESH": "1"}, cwd=tmp_path).fresh
    assert not config.resolved(env={"HYBRIDFLOW_STATE_FRESH": "0"}, cwd=tmp_path).fresh
    # a Redis server instead of the file; HYBRIDFLOW_STATE_PATH still wins
    redis = StateConfig(redis_url="redis://cache:6379/0")
    assert redis.resolved(env={}, cwd=tmp_path).location == "redis://cache:6379/0"
    assert redis.resolved(env={"HYBRIDFLOW_STATE_PATH": "x.db"}, cwd=tmp_path).location == str(tmp_path / "x.db")
    with pytest.raises(ValueError, match="redis_url"):
        StateConfig(redis_url="http://cache")


def test_the_serve_config_declares_a_durable_state():
    args = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
    config = load_config(args, check_workers=False)
    assert (config.state.path, config.state.snapshot_every) == (".hybridflow/state.db", 1000)
    sizes = {}
    for deployment in config.deployments:
        plan = plan_deployment(deployment, config, GpuBudget(8))
        sizes |= {group.name: plan.world_size(group.name) for group in deployment.groups}
    assert sizes == {"accumulator": 1, "gpu_accumulator": 4, "gpu_accumulator_a": 4, "gpu_accumulator_merge": 8,
                     "gpu_accumulator_decorator": 8, "test_actor": 4, "mlp": 4, "mlp_rollout": 2}


def test_only_workers_with_both_methods_are_snapshotted():
    assert supports_snapshots(GPUAccumulator)
    assert not supports_snapshots(MLPLayerWorker)


# -- opening a scope ------------------------------------------------------------------------


def test_stored_state_of_another_shape_is_refused_naming_the_group_the_change_and_the_fix(tmp_path):
    state = StateConfig(path=str(tmp_path / "state.db"))
    first = scope(state)
    run(first.open(state, None))
    record(first, Journal(1), 1)
    with pytest.raises(StateMismatchError) as refused:
        run(scope(state, world_size=2).open(state, None))
    message = str(refused.value)
    assert "group 'gpu_accumulator' of deployment 'accumulators'" in message
    assert "world size: stored 4, configured 2" in message
    assert "make serve-fresh" in message and "on_mismatch: reset" in message
    changed = GROUP.model_copy(update={"init_kwargs": {"start": 3}})
    with pytest.raises(StateMismatchError, match=r"init_kwargs: stored \{\}, configured \{'start': 3\}"):
        run(scope(state, changed).open(state, None))
    # the refused openings changed nothing
    assert len(state.open().load("accumulators/gpu_accumulator").entries) == 1
    # on_mismatch: reset discards that group's state and starts it clean
    resetting = state.model_copy(update={"on_mismatch": "reset"})
    run(scope(resetting, world_size=2).open(resetting, None))
    store = state.open()
    assert store.load("accumulators/gpu_accumulator").entries == []
    assert store.meta("accumulators/gpu_accumulator").world_size == 2


def test_a_fresh_start_discards_the_state_once_per_session(tmp_path):
    state = StateConfig(path=str(tmp_path / "state.db"), fresh=True)
    journal = Journal(1)
    old = scope(state)
    run(old.open(state.model_copy(update={"fresh": False}), None))
    record(old, journal, 1)
    new = scope(state)
    run(new.open(state, "session-1"))  # serve-fresh: a new Ray session
    assert state.open().load("accumulators/gpu_accumulator").entries == []
    record(new, journal, 2)
    restarted = scope(state)
    run(restarted.open(state, "session-1"))  # a replica Serve restarted in the same run
    assert [seq for seq, _ in state.open().load("accumulators/gpu_accumulator").entries] == [2]
    run(scope(state).open(state, "session-2"))  # the next serve-fresh
    assert state.open().load("accumulators/gpu_accumulator").entries == []


# -- answers ------------------------------------------------------------------------------


def test_an_acknowledged_answer_is_found_by_a_restarted_controller(tmp_path):
    state = StateConfig(path=str(tmp_path / "state.db"))
    first = scope(state)
    run(first.open(state, None))
    answered = record(first, Journal(1), 5, key="k-5")
    restarted = scope(state)
    run(restarted.open(state, None))
    repeat = CallRequest("gpu_accumulator", "add", kwargs={"x": [5] * 4}, idempotency_key="k-5", fingerprint="body-5")
    fingerprint, result = run(restarted.stored_answer(repeat))
    assert fingerprint == "body-5"
    assert [t.item() for t in result.output] == [t.item() for t in answered.output] == [5.0, 6.0, 7.0, 8.0]
    assert (result.dispatch_mode, result.world_size, result.error) == ("EXECUTE_ALL", 4, None)
    other_body = CallRequest("gpu_accumulator", "add", idempotency_key="k-5", fingerprint="body-6")
    with pytest.raises(IdempotencyConflict, match="k-5"):
        run(restarted.stored_answer(other_body))
    assert run(restarted.stored_answer(CallRequest("gpu_accumulator", "add", idempotency_key="k-6"))) is None


def test_answers_round_trip_and_an_unkeepable_one_is_marked_applied():
    error = CallResult(error=ControllerError(ErrorKind.METHOD_RAISED, "collecting failed"), world_size=4)
    assert decode_result(encode_result(error)) == CallResult(error=ControllerError(ErrorKind.METHOD_RAISED,
                                                                                   "collecting failed"), world_size=4)
    assert encode_result(CallResult(output={1, 2})) is None  # a set: the codec cannot keep it


def test_arguments_the_store_cannot_keep_are_refused_before_submission(tmp_path):
    state = StateConfig(path=str(tmp_path / "state.db"))
    durability = scope(state)
    entry = Journal(1).begin("add")
    with pytest.raises(StateCodecError, match=r"kwargs\['x'\]"):
        run(durability.encode(entry.method, [], {"x": {1, 2}}))


# -- the journal's waits --------------------------------------------------------------------


def test_settled_through_waits_only_for_calls_up_to_a_number():
    async def scenario():
        journal = Journal(1)
        first, second, third = (journal.begin("add") for _ in range(3))
        waiting = asyncio.ensure_future(journal.settled_through(second.seq, 5))
        await asyncio.sleep(0.01)
        journal.acknowledge(second)
        await asyncio.sleep(0.01)
        assert not waiting.done()  # call 1 is still in flight
        journal.abort(first)
        assert await waiting  # call 3 still runs: it is later than the snapshot point
        assert not await journal.settled_through(third.seq, 0.05)
        return journal.lowest_inflight() == third.seq

    assert run(scenario())


def test_reload_replaces_entries_and_never_numbers_backwards():
    journal = Journal()
    for _ in range(5):
        journal.acknowledge(journal.begin("add"))
    journal.reload([], 3)
    assert len(journal) == 0 and journal.next_seq == 5
    journal.reload([], 40)
    assert journal.begin("add").seq == 40


# -- the store off the loop, replay's catalogue, an operator's reset --------------------------


def test_a_held_write_lock_does_not_stall_the_event_loop(tmp_path):
    """Another process holds the state file's write lock: the write of an applied call
    waits in the store's thread while the loop keeps serving; it lands once the lock goes."""
    state = StateConfig(path=str(tmp_path / "state.db"), busy_timeout_s=30)
    durability = scope(state)

    async def scenario():
        await durability.open(state, None)
        holder = sqlite3.connect(state.path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        request = CallRequest("gpu_accumulator", "add", kwargs={"x": [1] * 4})
        entry = Journal(1).begin("add")
        record = durability.pending(entry, encode_call(entry.method, request.args, request.kwargs), request)
        writing = asyncio.ensure_future(durability.record(record, CallResult(output=[1] * 4)))
        turns = 0
        while turns < 200:  # the loop runs other work (other groups' calls, health checks)
            await asyncio.sleep(0)
            turns += 1
        waited = not writing.done()
        holder.execute("COMMIT")
        holder.close()
        await writing
        return turns, waited

    assert run(scenario()) == (200, True)
    assert [seq for seq, _ in state.open().load("accumulators/gpu_accumulator").entries] == [1]


def test_replay_runs_only_the_groups_own_methods(tmp_path):
    state = StateConfig(path=str(tmp_path / "state.db"))
    written = state.open()  # what the store holds when a replica starts
    written.record_call("accumulators/gpu_accumulator", 1, encode_call("add", [], {"x": [1] * 4}))
    written.record_call("accumulators/gpu_accumulator", 2, encode_call("__ray_terminate__", [], {}))
    durability = scope(state)
    run(durability.open(state, None))
    member = GroupState(config=GROUP, methods=catalogue(GPUAccumulator, GROUP.read_only), worker_class="GPUAccumulator",
                        resource_pool="", durability=durability)
    # the workers are never reached: the refusal comes before anything is sent
    with pytest.raises(RestoreRefused, match="'__ray_terminate__'.*refusing to replay it"):
        run(durability.restore(member))


def test_a_reset_discards_one_groups_state_and_claims_it_anew(tmp_path):
    state = StateConfig(path=str(tmp_path / "state.db"))
    durability = scope(state)
    run(durability.open(state, None))
    record(durability, Journal(1), 1, key="k-1")
    other = scope(state, GROUP.model_copy(update={"name": "gpu_accumulator_a"}))
    run(other.open(state, None))
    record(other, Journal(1), 2)
    run(durability.reset())
    store = state.open()
    assert store.load(durability.scope).entries == [] and store.get_answer(durability.scope, "add/k-1") is None
    assert store.meta(durability.scope) == durability.meta  # claimed again: the group restarts on it
    assert len(store.load(other.scope).entries) == 1

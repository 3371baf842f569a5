"""The controller's fault handling on the session's Ray cluster, in this process (no
Serve), with its state in a SQLite file: a mutating call that changed the ranks and then
raised is undone; a collect failure after a journaled call says the call counts; a
snapshot that fails is reported and retried, and a value nested as deep as the wire takes
is snapshotted; a replay that raises or runs past its deadline leaves its group failed
(no rebuild loop) until an operator resets that one group; a held write lock on the state
file stalls neither other groups' calls nor the health check."""

from __future__ import annotations

import asyncio
import sqlite3
import time

import pytest
import ray

from hybridflow.config import load_config
from hybridflow.control.builder import PoolSet, units
from hybridflow.control.contract import CallRequest, ErrorKind
from hybridflow.control.controller import GroupController
from hybridflow.control.placement import GpuBudget, plan_deployment
from hybridflow_client.wire.limits import MAX_DEPTH
from tests.ray.conftest import kill_rank

COUNTER = "tests.ray.fault_workers:Counter"
EVERY = 5


def group(name: str) -> dict:
    return {"name": name, "worker": COUNTER, "pool": {"process_on_nodes": [2], "name_prefix": name},
            "read_only": ["get"]}


@pytest.fixture(scope="module")
def state_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("state") / "state.db")


@pytest.fixture(scope="module")
def controller(ray_cluster, loop, state_path):
    config = load_config({
        "deployments": [{"name": "faults", "groups": [
            group("counter"), group("replayed"), group("other"),
            {**group("pair"), "colocate_with": ["pair_view"]},  # one process per bundle holds both
            {"name": "pair_view", "worker": COUNTER, "pool": {"same_as": "pair"}, "read_only": ["get"]},
        ]}],
        "state": {"path": state_path, "snapshot_every": EVERY, "replay_timeout_s": 2},
    })
    deployment = config.deployments[0]
    plan = plan_deployment(deployment, config, GpuBudget(0))
    pools = PoolSet(plan)
    made = GroupController(deployment, plan, units(deployment, plan, pools), request_timeout_s=60,
                           health_timeout_s=10.0, state=config.state)
    run(loop, made.start(), timeout=300)
    yield made
    made.shutdown()
    pools.remove()


def run(loop, coro, timeout: float = 120):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=timeout)


def call(loop, controller, group_name, method, *args, key=None, timeout=120):
    fingerprint = None if key is None else f"{method}:{args}"
    request = CallRequest(group_name, method, list(args), {}, key, fingerprint)
    return run(loop, controller.call(request), timeout)


def value(loop, controller, group_name="counter", timeout: float = 120) -> list[int]:
    result = call(loop, controller, group_name, "get", timeout=timeout)
    assert result.ok, result.error
    return result.output


def wait_status(controller, group_name: str, status: str, timeout_s: float = 120) -> None:
    unit = controller.groups[group_name].unit
    deadline = time.monotonic() + timeout_s
    while unit.status != status or (unit.task is not None and not unit.task.done()):
        assert time.monotonic() < deadline, f"{group_name}: {unit.status} ({unit.last_error}), wanted {status}"
        time.sleep(0.1)


def kill_a_worker(controller, group_name: str) -> None:
    worker = controller.groups[group_name].group._workers[1]
    kill_rank(worker)
    # ray.kill only asks the GCS; until the kill reaches the process, calls still reach the
    # actor and succeed. Poll until Ray reports it dead too.
    deadline = time.monotonic() + 60
    while True:
        try:
            ray.get(worker.__ray_ready__.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < deadline, "the killed worker still answers after 60 s"
        time.sleep(0.2)


def test_a_mutating_call_that_changed_every_rank_and_raised_is_undone_in_place(loop, controller):
    assert call(loop, controller, "counter", "add", 5).ok
    before, rebuilds = value(loop, controller), controller.groups["counter"].unit.rebuilds
    workers = list(controller.groups["counter"].group.workers)
    result = call(loop, controller, "counter", "add_then_raise", 3)
    assert result.error.kind is ErrorKind.METHOD_RAISED
    wait_status(controller, "counter", "ready")
    assert value(loop, controller) == before  # the +3 that no one acknowledged is gone
    # on the same processes (Counter has state_dict and load_state_dict): no rebuild, no restart
    assert controller.groups["counter"].group.workers == workers
    assert controller.groups["counter"].unit.rebuilds == rebuilds
    assert controller.groups["counter"].unit.restarts == 0
    assert "added 3, then failed" in result.error.message and "restored" in result.error.message


def test_a_collect_failure_after_a_journaled_call_says_it_counts(loop, controller):
    state = controller.groups["counter"]
    before, journaled = value(loop, controller), state.journal.next_seq
    first = call(loop, controller, "counter", "add_uncollectable", 2, key="uncollectable-1")
    assert first.error.kind is ErrorKind.COLLECT_FAILED
    assert "applied on every rank and journaled" in first.error.message and "it counts" in first.error.message
    assert value(loop, controller) == [v + 2 for v in before]
    stored = state.durability.store.load(state.durability.scope)
    assert any(seq >= journaled for seq, _ in stored.entries)  # in the journal: a rebuild replays it
    again = call(loop, controller, "counter", "add_uncollectable", 2, key="uncollectable-1")
    assert again.error == first.error  # the same answer, not applied again
    assert value(loop, controller) == [v + 2 for v in before]


def nested(depth: int) -> list:
    item: list = []
    for _ in range(depth - 1):
        item = [item]
    return item


def test_a_value_as_deep_as_the_wire_takes_is_snapshotted(loop, controller):
    state = controller.groups["counter"]
    assert call(loop, controller, "counter", "keep", nested(MAX_DEPTH - 1)).ok
    for _ in range(2 * EVERY):
        assert call(loop, controller, "counter", "add", 1).ok
        run(loop, state.durability.snapshots.settled())
    assert state.durability.snapshots.error is None
    assert len(state.journal) <= EVERY
    assert len(state.durability.store.load(state.durability.scope).entries) <= EVERY


def test_a_failing_snapshot_is_reported_and_retried(loop, controller):
    state = controller.groups["counter"]
    snapshots = state.durability.snapshots
    failures = snapshots.failures
    assert call(loop, controller, "counter", "fail_snapshots", True).ok
    for _ in range(2 * EVERY):
        assert call(loop, controller, "counter", "add", 1).ok
        run(loop, state.durability.snapshots.settled())
    assert snapshots.failures >= failures + 1
    assert "state_dict raised RuntimeError: state_dict refuses for now" in snapshots.error
    reported = [e for e in controller.events._ring if e.kind == "snapshot_failed" and e.group == "counter"]
    assert reported and reported[-1].fields == {"reason": snapshots.error}  # an event of its own too
    assert controller._summary(state).snapshot_error == snapshots.error
    assert len(state.journal) > EVERY  # the journal keeps every call meanwhile
    assert call(loop, controller, "counter", "fail_snapshots", False).ok
    for _ in range(2 * EVERY):  # still snapshotted: the next try stores one
        assert call(loop, controller, "counter", "add", 1).ok
        run(loop, state.durability.snapshots.settled())
    assert snapshots.error is None and len(state.journal) <= EVERY


def test_a_replay_that_raises_leaves_the_group_failed_until_it_is_reset(loop, controller, tmp_path):
    other = value(loop, controller, "other")
    checkpoint = tmp_path / "checkpoint.txt"
    checkpoint.write_text("weights")
    assert call(loop, controller, "replayed", "add", 7).ok
    assert call(loop, controller, "replayed", "load", str(checkpoint)).ok
    checkpoint.unlink()  # deleted after it was loaded: replaying the load raises
    unit = controller.groups["replayed"].unit
    kill_a_worker(controller, "replayed")
    assert call(loop, controller, "replayed", "get").error.kind is ErrorKind.UNAVAILABLE
    wait_status(controller, "replayed", "failed")
    assert unit.halted and "FileNotFoundError" in unit.last_error
    assert "POST /v1/admin/groups/replayed/reset" in unit.last_error
    task, rebuilds = unit.task, unit.rebuilds
    for _ in range(3):  # health checks leave it: no respawn loop
        assert run(loop, controller.check_health())["replayed"] == "failed"
    assert unit.task is task and unit.rebuilds == rebuilds and controller.groups["replayed"].group is None
    refused = call(loop, controller, "replayed", "get")
    assert refused.error.kind is ErrorKind.UNAVAILABLE and refused.error.retry_after_s is None
    assert "FileNotFoundError" in refused.error.message

    summary = run(loop, _reset(controller, "replayed"))
    assert summary.status == "rebuilding"
    wait_status(controller, "replayed", "ready")
    assert value(loop, controller, "replayed") == [0, 0]  # fresh: the stored state was discarded
    durability = controller.groups["replayed"].durability
    assert durability.store.load(durability.scope).entries == []
    assert value(loop, controller, "other") == other  # the other groups kept theirs


async def _reset(controller, group_name):
    return controller.reset_group(group_name)


async def _reset_both(controller):
    return [controller.reset_group(name) for name in ("pair", "pair_view")]


def test_resets_of_colocated_groups_share_one_rebuild_and_discard_both(loop, controller):
    assert call(loop, controller, "pair", "add", 3).ok
    assert call(loop, controller, "pair_view", "add", 4).ok
    unit = controller.groups["pair"].unit
    assert controller.groups["pair_view"].unit is unit
    rebuilds = unit.rebuilds
    assert [s.status for s in run(loop, _reset_both(controller))] == ["rebuilding", "rebuilding"]
    wait_status(controller, "pair", "ready")
    assert unit.rebuilds == rebuilds + 1  # the processes both roles share were started once
    assert value(loop, controller, "pair") == [0, 0] and value(loop, controller, "pair_view") == [0, 0]
    for name in ("pair", "pair_view"):
        durability = controller.groups[name].durability
        assert durability.store.load(durability.scope).entries == []
    # a reset that comes once a rebuild has discarded is a rebuild of its own, after it
    assert call(loop, controller, "pair", "add", 5).ok and call(loop, controller, "pair_view", "add", 6).ok
    pair, view = (controller.groups[name].durability for name in ("pair", "pair_view"))
    run(loop, _reset(controller, "pair"))
    deadline = time.monotonic() + 120
    while pair.store.load(pair.scope).entries:
        assert time.monotonic() < deadline, "the reset did not discard pair's journal"
        time.sleep(0.01)
    assert unit.status == "rebuilding" and view.store.load(view.scope).entries
    run(loop, _reset(controller, "pair_view"))
    wait_status(controller, "pair", "ready")
    assert unit.rebuilds == rebuilds + 3
    assert value(loop, controller, "pair") == [0, 0] and value(loop, controller, "pair_view") == [0, 0]
    assert view.store.load(view.scope).entries == []


def test_a_replay_past_its_deadline_leaves_the_group_failed(loop, controller):
    assert call(loop, controller, "replayed", "nap", 3).ok  # replay_timeout_s is 2
    kill_a_worker(controller, "replayed")
    call(loop, controller, "replayed", "get")
    wait_status(controller, "replayed", "failed")
    unit = controller.groups["replayed"].unit
    assert unit.halted and "ran past the replay deadline" in unit.last_error
    run(loop, _reset(controller, "replayed"))
    wait_status(controller, "replayed", "ready")
    assert value(loop, controller, "replayed") == [0, 0]


def test_a_held_write_lock_stalls_neither_other_groups_nor_the_health_check(loop, controller, state_path):
    before = value(loop, controller, "other")
    holder = sqlite3.connect(state_path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process's write transaction, as long as it likes
    try:
        adding = asyncio.run_coroutine_threadsafe(
            controller.call(CallRequest("counter", "add", [1], {})), loop)
        time.sleep(1)  # every rank applies it in milliseconds; its store write then waits for the lock
        # Meanwhile the loop serves the rest (well within the store's 10 s busy timeout):
        assert value(loop, controller, "other", timeout=5) == before
        assert call(loop, controller, "counter", "get", timeout=5).ok
        assert run(loop, controller.check_health(), timeout=5)["other"] == "ready"
        assert not adding.done()
    finally:
        holder.execute("COMMIT")
        holder.close()
    assert adding.result(timeout=30).ok

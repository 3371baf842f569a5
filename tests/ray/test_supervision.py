"""A group's supervision on the session's Ray cluster, with the controller in this process
(no Serve) and its state in a SQLite file, over independent workers
(``examples.independent_workers:Tally``): a lost rank replaced alone under concurrent
mutating calls and while idle (the new rank ends exactly as the others, every rank holds
every acknowledged call once, the other ranks keep their processes), ``halt`` naming the
rank and its node until an operator's restart brings the state back, the restart bound
halting a group whose workers die in ``__init__`` with the backoff between tries, and a
compiled graph built again over a replaced rank. Each step is an event."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from hybridflow.config import load_config
from hybridflow.control.builder import PoolSet, units
from hybridflow.control.contract import CallRequest, ErrorKind
from hybridflow.control.controller import GroupController
from hybridflow.control.placement import GpuBudget, plan_deployment
from tests.ray.conftest import kill_rank

TALLY = "examples.independent_workers:Tally"
READ_ONLY = ["contents", "identity"]
EVERY = 7
BACKOFF_S = 0.3


def tally(name: str, ranks: int, supervision: dict, **extra) -> dict:
    return {"name": name, "worker": TALLY, "pool": {"process_on_nodes": [ranks], "name_prefix": name},
            "read_only": READ_ONLY, "transport": "tasks", "supervision": supervision, **extra}


def run(loop, coro, timeout: float = 120):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=timeout)


def start(loop, args: dict):
    config = load_config(args)
    deployment = config.deployments[0]
    plan = plan_deployment(deployment, config, GpuBudget(0))
    pools = PoolSet(plan)
    controller = GroupController(deployment, plan, units(deployment, plan, pools), request_timeout_s=60,
                                 health_timeout_s=10.0, state=config.state)
    run(loop, controller.start(), timeout=300)
    return controller, pools


@pytest.fixture(scope="module")
def refusing(tmp_path_factory):
    return str(tmp_path_factory.mktemp("marks"))


@pytest.fixture(scope="module")
def controller(ray_cluster, loop, tmp_path_factory, refusing):
    made, pools = start(loop, {
        "deployments": [{"name": "supervised", "groups": [
            tally("replaced", 4, {"on_rank_lost": "replace_rank"}),
            tally("halted", 2, {"on_rank_lost": "halt"}),
            tally("bounded", 2, {"max_restarts": 2, "restart_window_s": 60,
                                 "backoff_s": {"initial": BACKOFF_S, "max": 5}},
                  init_kwargs={"refuse_restart_in": refusing}),
        ]}],
        "state": {"path": str(tmp_path_factory.mktemp("state") / "state.db"), "snapshot_every": EVERY},
    })
    yield made
    made.shutdown()
    pools.remove()


def call(loop, controller, group, method, *args, **kwargs):
    return run(loop, controller.call(CallRequest(group, method, list(args), kwargs)))


def read(loop, controller, group, method) -> list:
    result = call(loop, controller, group, method)
    assert result.ok, result.error
    return result.output


def wait_status(controller, group: str, status: str, timeout_s: float = 120) -> None:
    unit = controller.groups[group].unit
    deadline = time.monotonic() + timeout_s
    while unit.status != status or unit.recovering or (status == "failed" and not unit.halted):
        assert time.monotonic() < deadline, f"{group}: {unit.status} ({unit.last_error}), wanted {status}"
        time.sleep(0.05)


def events_after(controller, since: int, group: str) -> list:
    return [e for e in list(controller.events._ring) if e.id > since and e.group == group]


def kill(worker) -> None:
    kill_rank(worker)
    deadline = time.monotonic() + 60
    while True:  # until Ray reports it dead (the kill reaches the process a moment later)
        try:
            ray.get(worker.__ray_ready__.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < deadline, "the killed worker still answers"
        time.sleep(0.1)


def assert_exact(contents: list[dict], acknowledged_records: list, adds: int, notes: list) -> None:
    """Every rank holds every acknowledged call once, in one order, and its own share."""
    records = contents[0]["records"]
    assert sorted(records) == sorted(acknowledged_records) and len(set(records)) == len(records)
    for rank, held in enumerate(contents):
        assert held["records"] == records, f"rank {rank} holds another history"
        assert held["total"] == (rank + 1) * adds
        assert held["notes"] == (notes if rank == 0 else [])


def test_a_rank_lost_under_concurrent_calls_is_replaced_alone(loop, controller):
    state = controller.groups["replaced"]
    before = read(loop, controller, "replaced", "identity")
    nodes = [rank["node_ip"] for rank in run(loop, controller.describe_group("replaced")).ranks]
    since = controller.events.last_id
    victim = state.group.workers[1]

    async def load():
        calls = []
        for index in range(36):
            calls.append(asyncio.ensure_future(controller.call(CallRequest("replaced", "record", [f"r{index}"]))))
            if index % 3 == 0:
                calls.append(asyncio.ensure_future(controller.call(CallRequest("replaced", "add", [[1, 2, 3, 4]]))))
            if index % 9 == 0:
                calls.append(asyncio.ensure_future(controller.call(CallRequest("replaced", "note", [f"n{index}"]))))
            if index == 12:
                await asyncio.to_thread(kill_rank, victim)  # the calls go on meanwhile
            await asyncio.sleep(0.02)
        return await asyncio.gather(*calls)

    results = run(loop, load())
    wait_status(controller, "replaced", "ready")
    refused = [r for r in results if not r.ok]
    assert refused and all(r.error.kind is ErrorKind.UNAVAILABLE for r in refused)  # none half-applied
    after = read(loop, controller, "replaced", "identity")
    assert [a["pid"] == b["pid"] for a, b in zip(before, after, strict=True)] == [True, False, True, True]
    assert state.group.workers[1] is not victim and state.unit.replaced_ranks == 1 and state.unit.rebuilds == 0
    assert any(r.ok for r in results)
    acknowledged = _acknowledged(controller, "replaced")
    assert_exact(read(loop, controller, "replaced", "contents"), acknowledged["record"],
                 len(acknowledged["add"]), acknowledged["note"])
    kinds = [(e.kind, e.fields.get("rank"), e.fields.get("status")) for e in events_after(controller, since, "replaced")]
    assert ("rank_lost", 1, None) in kinds and ("rank_replaced", 1, None) in kinds
    assert kinds.index(("rank_lost", 1, None)) < kinds.index(("group_status", None, "replacing")) < kinds.index(
        ("rank_replaced", 1, None)) < kinds.index(("group_status", None, "ready"))
    lost = next(e for e in events_after(controller, since, "replaced") if e.kind == "rank_lost")
    assert lost.fields["node"] == nodes[1] and lost.fields["reason"]


def _acknowledged(controller, group: str) -> dict[str, list]:
    """The acknowledged calls, read back from the store (the truth a rank must match)."""
    from hybridflow.state.codec import decode_call, decode_snapshot

    durability = controller.groups[group].durability
    stored = durability.store.load(durability.scope)
    found: dict[str, list] = {"record": [], "add": [], "note": []}
    if stored.snapshot is not None:  # rank 0's part holds every record and note, and one per add
        rank0 = decode_snapshot(stored.snapshot)[0]
        found = {"record": list(rank0["records"]), "add": [None] * rank0["total"], "note": list(rank0["notes"])}
    for _, data in stored.entries:
        method, args, _ = decode_call(data)
        found[method].append(args[0])
    return found


def test_a_rank_lost_while_idle_is_brought_to_the_others_alone(loop, controller):
    for index in range(3):
        assert call(loop, controller, "replaced", "record", f"idle{index}").ok
        assert call(loop, controller, "replaced", "add", [1, 2, 3, 4]).ok
        assert call(loop, controller, "replaced", "note", f"idle-note{index}").ok
    state = controller.groups["replaced"]
    before = read(loop, controller, "replaced", "identity")
    since = controller.events.last_id
    kill(state.group.workers[0])  # rank 0: the only one that runs `note`
    run(loop, controller.check_health())  # the health check finds it
    wait_status(controller, "replaced", "ready")
    after = read(loop, controller, "replaced", "identity")
    assert after[0]["pid"] != before[0]["pid"] and after[0]["loads"] == 1  # its part of the snapshot
    # the other ranks were not touched: no call was in flight to change them
    assert [a["loads"] for a in after[1:]] == [b["loads"] for b in before[1:]]
    acknowledged = _acknowledged(controller, "replaced")
    assert_exact(read(loop, controller, "replaced", "contents"), acknowledged["record"],
                 len(acknowledged["add"]), acknowledged["note"])
    assert [e.kind for e in events_after(controller, since, "replaced")] == [
        "rank_lost", "group_status", "rank_replaced", "group_status"]


def test_halt_names_the_rank_and_its_node_until_an_operator_restarts_it(loop, controller):
    for item in ("a", "b"):
        assert call(loop, controller, "halted", "record", item).ok
    ranks = run(loop, controller.describe_group("halted")).ranks
    state = controller.groups["halted"]
    since = controller.events.last_id
    kill(state.group.workers[1])
    run(loop, controller.check_health())
    wait_status(controller, "halted", "failed")
    unit = state.unit
    assert unit.halted and state.group is None
    assert unit.last_error.startswith(f"rank 1 on node {ranks[1]['node_ip']} was lost (")
    assert "POST /v1/admin/groups/halted/restart" in unit.last_error
    refused = call(loop, controller, "halted", "contents")
    assert refused.error.kind is ErrorKind.UNAVAILABLE and refused.error.retry_after_s is None
    for _ in range(2):  # health checks leave it as it is
        assert run(loop, controller.check_health())["halted"] == "failed"
    assert controller.ready()["halted"]  # its own status says so; readiness is the service's
    kinds = [e.kind for e in events_after(controller, since, "halted")]
    assert kinds == ["rank_lost", "group_status", "group_halted"]
    summary = run(loop, _restart(controller, "halted"))
    assert summary.status == "rebuilding"
    wait_status(controller, "halted", "ready")
    assert [c["records"] for c in read(loop, controller, "halted", "contents")] == [["a", "b"], ["a", "b"]]
    assert unit.restarts == 0 and unit.last_error is None


async def _restart(controller, group):
    return controller.restart_group(group)


def test_workers_that_die_in_init_halt_their_group_past_max_restarts(loop, controller):
    state = controller.groups["bounded"]
    since = controller.events.last_id
    kill(state.group.workers[0])
    run(loop, controller.check_health())
    wait_status(controller, "bounded", "failed", timeout_s=180)
    unit = state.unit
    assert unit.last_error.startswith("restarted 2 times in 60 s")
    assert unit.restarts == 2 and unit.halted and state.group is None
    # this thread saw the halt begin; a turn of the controller's loop lets it end (its
    # event is published after the status)
    run(loop, asyncio.sleep(0))
    events = events_after(controller, since, "bounded")
    statuses = [(e.fields["status"], e.at) for e in events if e.kind == "group_status"]
    assert [s for s, _ in statuses] == ["rebuilding", "failed", "rebuilding", "failed"]
    # each try after a failed start waited its backoff: initial, then doubled
    assert statuses[2][1] - statuses[1][1] >= BACKOFF_S - 0.002
    assert events[-1].kind == "group_halted" and events[-1].fields["reason"].startswith("restarted 2 times in 60 s")
    assert events[-1].at - statuses[3][1] >= 2 * BACKOFF_S - 0.002
    assert "rebuild failed: " in unit.last_error and "refuses to start a second time" in unit.last_error


def test_a_compiled_graph_is_built_again_over_a_replaced_rank(ray_cluster, loop):
    controller, pools = start(loop, {"deployments": [{"name": "graphed", "groups": [
        {**tally("graph", 2, {"on_rank_lost": "replace_rank"}), "transport": "compiled"}]}],
        "state": {"path": None}})
    try:
        state = controller.groups["graph"]
        for item in ("g0", "g1"):
            assert call(loop, controller, "graph", "record", item).ok
        assert state.channel is not None and state.channel.compiled
        old_channel = state.channel
        kill(state.group.workers[1])
        run(loop, controller.check_health())
        wait_status(controller, "graph", "ready")
        assert state.channel is not None and state.channel is not old_channel and state.channel.compiled
        assert call(loop, controller, "graph", "record", "g2").ok  # over the new graph
        contents = read(loop, controller, "graph", "contents")
        assert [c["records"] for c in contents] == [["g0", "g1", "g2"]] * 2
        # no snapshot yet: the new rank loaded the state its first process came up with
        assert [i["loads"] for i in read(loop, controller, "graph", "identity")] == [0, 1]
    finally:
        controller.shutdown()
        pools.remove()

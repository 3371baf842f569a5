"""The three transports to the ranks (``transport: tasks``, ``socket`` and ``compiled``)
under the same assertions, on the session's Ray cluster, with the controller in this process
and its state in a SQLite file: the dispatch modes answer alike, a method that raises is
undone, calls keep one order on every rank under concurrent load, snapshots see exactly
the acknowledged calls, and a rank killed under load loses nothing acknowledged."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from hybridflow.config import ConfigError, load_config
from hybridflow.control.builder import PoolSet, units
from hybridflow.control.contract import CallRequest, ErrorKind
from hybridflow.control.controller import GroupController
from hybridflow.control.placement import GpuBudget, plan_deployment
from hybridflow.control.transport import resolve_transports
from single_controller.ray.graph_channel import GraphChannel
from single_controller.ray.socket_channel import SocketChannel
from tests.ray.conftest import process_running

COUNTER = "tests.ray.fault_workers:Counter"
ACTOR = "examples.transport_check:TransportCheckActor"
EVERY = 4


def args(transport: str, state_path: str) -> dict:
    return {
        "deployments": [{"name": f"over_{transport}", "groups": [
            {"name": f"counter_{transport}", "worker": COUNTER, "transport": transport,
             "pool": {"process_on_nodes": [2], "name_prefix": f"c{transport}"}, "read_only": ["get"]},
            {"name": f"actor_{transport}", "worker": ACTOR, "init_kwargs": {"x": 2}, "transport": transport,
             "pool": {"process_on_nodes": [2], "name_prefix": f"a{transport}"}, "read_only": ["foo", "history"]},
        ]}],
        "state": {"path": state_path, "snapshot_every": EVERY},
    }


def run(loop, coro, timeout: float = 120):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=timeout)


@pytest.fixture(scope="module", params=["tasks", "socket", "compiled"])
def served(request, ray_cluster, loop, tmp_path_factory):
    transport = request.param
    config = load_config(args(transport, str(tmp_path_factory.mktemp(transport) / "state.db")))
    deployment = config.deployments[0]
    plan = plan_deployment(deployment, config, GpuBudget(0))
    pools = PoolSet(plan)
    controller = GroupController(deployment, plan, units(deployment, plan, pools), request_timeout_s=60,
                                 health_timeout_s=10.0, state=config.state)
    run(loop, controller.start(), timeout=300)
    yield transport, controller
    controller.shutdown()
    pools.remove()


def call(loop, controller, group, method, *args, **kwargs):
    return run(loop, controller.call(CallRequest(group, method, list(args), kwargs)))


def value(loop, controller, group) -> list[int]:
    result = call(loop, controller, group, "get")
    assert result.ok, result.error
    return result.output


def wait_ready(controller, group: str, timeout_s: float = 180) -> None:
    unit = controller.groups[group].unit
    deadline = time.monotonic() + timeout_s
    while unit.status != "ready" or (unit.task is not None and not unit.task.done()):
        assert time.monotonic() < deadline, f"{group}: {unit.status} ({unit.last_error})"
        time.sleep(0.1)


def test_the_group_takes_the_transport_it_declares(served):
    transport, controller = served
    for name, state in controller.groups.items():
        assert state.transport == transport
        assert isinstance(state.channel, GraphChannel) == (transport == "compiled"), name
        assert isinstance(state.channel, SocketChannel) == (transport == "socket"), name
        assert controller._summary(state).transport == transport


def test_dispatch_modes_answer_alike(served, loop):
    transport, controller = served
    actor = f"actor_{transport}"
    assert call(loop, controller, actor, "foo", y=3).output == [5, 5]                  # ALL_TO_ALL, 2 ranks
    assert call(loop, controller, actor, "foo_rank_zero", x=1, y=2).output == 5       # RANK_ZERO: one value
    assert call(loop, controller, actor, "foo_custom", x=[1, 2], y=[5, 6]).output == [8, 10]  # custom dispatch
    raised = call(loop, controller, actor, "foo_rank_zero", x="a", y=1)
    assert raised.error.kind is ErrorKind.METHOD_RAISED


def test_a_mutating_call_that_raised_is_undone(served, loop):
    transport, controller = served
    group = f"counter_{transport}"
    assert call(loop, controller, group, "add", 5).ok
    before = value(loop, controller, group)
    result = call(loop, controller, group, "add_then_raise", 3)
    assert result.error.kind is ErrorKind.METHOD_RAISED and "added 3, then failed" in result.error.message
    wait_ready(controller, group)
    assert value(loop, controller, group) == before
    assert controller.groups[group].transport == transport  # rebuilt on the same transport
    assert (controller.groups[group].channel is not None) == (transport != "tasks")


async def _concurrent_adds(controller, group: str, count: int) -> list:
    return await asyncio.gather(*(controller.call(CallRequest(group, "add", [i + 1])) for i in range(count)))


def test_concurrent_calls_keep_one_order_and_snapshots_see_exactly_what_was_acknowledged(served, loop):
    transport, controller = served
    group = f"counter_{transport}"
    state = controller.groups[group]
    before = value(loop, controller, group)
    answers = run(loop, _concurrent_adds(controller, group, 40))
    assert all(answer.ok for answer in answers)
    added = sum(range(1, 41))
    assert value(loop, controller, group) == [v + added for v in before]
    # every rank answered each add with the same running total: one order on every rank
    totals = [answer.output[0] for answer in answers]
    assert all(answer.output[1] - before[1] == answer.output[0] - before[0] for answer in answers)
    assert len(set(totals)) == len(totals) and max(totals) == before[0] + added
    # the snapshots taken meanwhile (every 4 calls) went through the same transport: a
    # rebuild from them and the journal after them gives back exactly the acknowledged state
    assert state.durability.snapshots.error is None

    async def rebuild() -> None:
        controller.supervisor.recover(state.unit, "a rebuild the test asks for")
        await state.unit.task

    run(loop, rebuild(), timeout=300)
    wait_ready(controller, group)
    assert value(loop, controller, group) == [v + added for v in before]


def test_a_rank_killed_under_load_loses_nothing_acknowledged(served, loop):
    transport, controller = served
    group = f"counter_{transport}"
    state = controller.groups[group]
    before = value(loop, controller, group)

    victim = state.group.workers[1]
    pid = ray.get(victim._get_rank_info.remote())["pid"]

    async def load_and_kill() -> list:
        calls = [asyncio.ensure_future(controller.call(CallRequest(group, "add", [1]))) for _ in range(30)]
        await asyncio.sleep(0.05)
        ray.kill(victim, no_restart=True)
        more = [asyncio.ensure_future(controller.call(CallRequest(group, "add", [1]))) for _ in range(10)]
        return await asyncio.gather(*calls, *more)

    answers = run(loop, load_and_kill(), timeout=300)
    acknowledged = sum(1 for answer in answers if answer.ok)
    failed = [answer.error.kind for answer in answers if not answer.ok]
    assert set(failed) <= {ErrorKind.UNAVAILABLE}, failed
    # The rank answers until its process exits (a socket channel still reaches it after Ray
    # calls it dead): read the total as a client would, retrying while the group recovers.
    deadline = time.monotonic() + 180
    while True:
        wait_ready(controller, group)
        read = call(loop, controller, group, "get")
        if read.ok and not process_running(pid):
            break
        assert read.ok or read.error.kind is ErrorKind.UNAVAILABLE, read.error
        assert time.monotonic() < deadline, f"no total read after the kill: {read.error}"
        time.sleep(0.2)
    # exactly the acknowledged calls, on every rank: none lost, none half-applied
    assert read.output == [v + acknowledged for v in before]
    assert state.unit.rebuilds >= 1


@pytest.mark.parametrize("transport", ["compiled", "socket"])
def test_a_channel_is_refused_where_it_cannot_carry_every_call(transport):
    base = {"name": "d", "groups": [
        {"name": "plain", "worker": "single_controller.models.tutorial_workers:Accumulator", "plain_actor": True,
         "transport": transport},
        {"name": "a", "worker": COUNTER, "pool": {"process_on_nodes": [2]}, "transport": transport,
         "colocate_with": ["b"]},
        {"name": "b", "worker": COUNTER, "pool": {"same_as": "a"}},
    ]}
    with pytest.raises(ConfigError) as refused:
        load_config({"deployments": [base]}, check_workers=False)
    text = str(refused.value)
    assert f"groups[plain].transport: {transport} is refused: a plain actor" in text
    assert f"groups[a].transport: {transport} is refused: its processes are shared with colocated groups" in text


def test_auto_takes_the_socket_channel_where_a_group_can_and_never_the_polling_graph():
    config = load_config({"deployments": [{"name": "d", "groups": [
        {"name": "one", "worker": COUNTER, "pool": {"process_on_nodes": [4]}},
        {"name": "two", "worker": COUNTER, "pool": {"process_on_nodes": [4]}, "colocate_with": ["three"]},
        {"name": "three", "worker": COUNTER, "pool": {"same_as": "two"}},
        {"name": "plain", "worker": "single_controller.models.tutorial_workers:Accumulator", "plain_actor": True},
        {"name": "fixed", "worker": COUNTER, "pool": {"process_on_nodes": [2]}, "transport": "tasks"},
        {"name": "graph", "worker": COUNTER, "pool": {"process_on_nodes": [2]}, "transport": "compiled"},
    ]}]}, check_workers=False)
    assert resolve_transports(config.deployments) == {
        "one": "socket", "two": "tasks", "three": "tasks", "plain": "tasks", "fixed": "tasks", "graph": "compiled"}

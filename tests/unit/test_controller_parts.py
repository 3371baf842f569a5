"""The controller's parts that need no Ray: the journal, the idempotency cache, the
method catalogue and the supervisor's start of its units."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch

from hybridflow.config import GroupConfig
from hybridflow.control.builder import Unit
from hybridflow.control.catalogue import EXECUTE_ALL, catalogue, per_rank_problem
from hybridflow.control.supervisor import READY, GroupState, Supervisor, UnitState
from hybridflow.state.codec import decode_call, encode_call
from hybridflow.state.idempotency import IdempotencyCache, IdempotencyConflict, estimate_bytes
from hybridflow.state.journal import Journal
from single_controller.models.mlp_worker import MLPLayerWorker
from single_controller.models.tutorial_workers import (
    Accumulator,
    GPUAccumulatorDecorator,
    TestActor,
    two_to_all_dispatch_fn,
)


def run(coro):
    return asyncio.run(coro)


# -- journal ------------------------------------------------------------------------------


def test_journal_acknowledges_calls_in_submission_order():
    async def scenario():
        journal = Journal()
        first = journal.begin("add")
        second = journal.begin("add")
        third = journal.begin("add")
        assert journal.lowest_inflight() == first.seq
        journal.acknowledge(third)  # answers come back in any order
        journal.abort(second)
        journal.acknowledge(first)
        assert journal.lowest_inflight() is None and await journal.settled(0.1)
        return journal.acknowledged()

    assert run(scenario()) == [0, 2]


def test_a_call_is_replayed_as_sent_whatever_a_dispatch_function_does_to_it():
    # What a rebuild replays is the call the state store encoded before submission.
    kwargs = {"x": [1, 2], "y": [5, 6]}
    data = encode_call("foo_custom", [], kwargs)
    kwargs["x"].append(99)  # the caller's dispatch ran on its own lists after the encoding

    class Group:
        world_size = 4

    for _ in range(3):  # every rebuild decodes objects of its own
        method, args, replayed = decode_call(data)
        two_to_all_dispatch_fn(Group(), *args, **replayed)  # appends to the lists it gets
        assert method == "foo_custom" and replayed["x"] == [1, 2, 1, 2]
    assert decode_call(data)[2] == {"x": [1, 2], "y": [5, 6]}


def test_settled_waits_for_calls_in_flight():
    async def scenario():
        journal = Journal()
        entry = journal.begin("add")
        assert not await journal.settled(0.05)
        asyncio.get_running_loop().call_later(0.05, journal.acknowledge, entry)
        return await journal.settled(2)

    assert run(scenario())


def test_truncate_and_reload():
    journal = Journal()
    entries = [journal.begin("add") for _ in range(5)]
    for entry in entries:
        journal.acknowledge(entry)
    assert journal.truncate(2) == 3
    assert journal.acknowledged() == [3, 4]
    again = Journal()
    again.reload(journal.acknowledged(), 0)  # a restarted controller, from its store
    assert again.next_seq == 5 and len(again) == 2


# -- idempotency -------------------------------------------------------------------------


def test_a_repeat_gets_the_first_answer_and_runs_once():
    async def scenario():
        cache: IdempotencyCache[int] = IdempotencyCache()
        runs = []

        async def compute():
            runs.append(1)
            await asyncio.sleep(0.05)
            return len(runs)

        together = await asyncio.gather(*(cache.run("k", "body", compute) for _ in range(5)))
        later = await cache.run("k", "body", compute)
        return together, later, len(runs), cache.running

    together, later, runs, running = run(scenario())
    assert together == [1] * 5 and later == 1 and runs == 1 and running == 0


def test_the_same_key_with_another_body_is_refused():
    async def scenario():
        cache: IdempotencyCache[str] = IdempotencyCache()

        async def compute():
            await asyncio.sleep(0.05)
            return "answer"

        first = asyncio.ensure_future(cache.run("k", "body-1", compute))
        await asyncio.sleep(0)
        with pytest.raises(IdempotencyConflict):  # while the first runs
            await cache.run("k", "body-2", compute)
        assert await first == "answer"
        with pytest.raises(IdempotencyConflict):  # and after
            await cache.run("k", "body-2", compute)

    run(scenario())


def test_transient_answers_are_not_kept_and_nothing_leaks():
    async def scenario():
        cache: IdempotencyCache[str] = IdempotencyCache()

        async def unavailable():
            return "503"

        async def broken():
            raise RuntimeError("boom")

        for i in range(100):
            await cache.run(f"a{i}", None, unavailable, keep=lambda answer: answer != "503")
            with pytest.raises(RuntimeError):
                await cache.run(f"b{i}", None, broken)
        return len(cache), cache.running

    assert run(scenario()) == (0, 0)


def test_a_caller_that_goes_away_does_not_cancel_the_call():
    async def scenario():
        cache: IdempotencyCache[str] = IdempotencyCache()
        finished = []

        async def compute():
            await asyncio.sleep(0.05)
            finished.append(True)
            return "done"

        caller = asyncio.ensure_future(cache.run("k", None, compute))
        await asyncio.sleep(0.01)
        caller.cancel()
        await asyncio.sleep(0.1)
        return finished, await cache.run("k", None, compute)

    assert run(scenario()) == ([True], "done")


def test_kept_answers_are_bounded_by_count_and_bytes():
    cache: IdempotencyCache[torch.Tensor] = IdempotencyCache(max_entries=3, max_bytes=10_000)
    for i in range(10):
        cache.store(f"k{i}", None, torch.zeros(100))  # 400 bytes each
    assert len(cache) == 3 and cache.lookup("k9", None) is not None and cache.lookup("k0", None) is None
    for i in range(10):
        cache.store(f"big{i}", None, torch.zeros(1000))  # 4000 bytes each: two fit
    assert len(cache) == 2 and cache.kept_bytes <= 10_000
    cache.store("huge", None, torch.zeros(10_000))  # over the byte bound alone: not kept
    assert cache.lookup("huge", None) is None
    assert estimate_bytes([torch.zeros(10), "abc"]) > 40 + 3


# -- catalogue ---------------------------------------------------------------------------


def test_catalogue_lists_the_workers_own_methods_with_their_modes():
    methods = catalogue(TestActor, read_only=["foo"])
    assert sorted(methods) == ["foo", "foo_custom", "foo_rank_zero"]
    assert methods["foo"].dispatch_mode == EXECUTE_ALL and not methods["foo"].mutating
    assert methods["foo_rank_zero"].execute_mode == "RANK_ZERO" and methods["foo_rank_zero"].mutating
    assert methods["foo_custom"].dispatch_mode == "custom:two_to_all_dispatch_fn"
    assert sorted(catalogue(GPUAccumulatorDecorator)) == ["add", "get_value"]
    # the library's plumbing (Worker, MegatronWorker) is not a worker's API
    assert sorted(catalogue(MLPLayerWorker)) == ["get_weights", "init_model", "run_layer", "train_step"]
    assert sorted(catalogue(Accumulator)) == ["add", "get_value"]


def test_catalogue_names_the_mesh_of_a_mesh_dispatched_method_and_hides_the_mesh_queries():
    from tests.ray.mesh_workers import MeshDoubler

    methods = catalogue(MeshDoubler, read_only=["double"])
    assert sorted(methods) == ["double", "elsewhere"]  # no _query_* method a group asks its ranks
    assert methods["double"].dispatch_mode == "ND_COMPUTE_PROTO(actor)" and methods["double"].mesh == "actor"
    assert methods["elsewhere"].mesh == "undeclared" and catalogue(TestActor)["foo"].mesh is None


def test_per_rank_lists_must_have_one_item_per_rank():
    assert per_rank_problem("add", 4, [], {"x": [1, 1, 1, 1]}) is None
    assert "expected 4 (one per rank), got 3" in per_rank_problem("add", 4, [], {"x": [1, 1, 1]})
    assert "positional argument 0" in per_rank_problem("add", 4, [[1]], {})


# -- supervisor -------------------------------------------------------------------------


class _NothingStored:
    async def restore(self, member) -> int:
        return 0


def test_every_unit_starts_at_once_however_many_the_loops_default_executor_has():
    """Each start blocks until all have begun (as processes coming up take seconds): more
    units than the default executor's cpu_count + 4 threads must still all be running."""
    count = min(32, (os.cpu_count() or 1) + 4) + 2
    all_begun = threading.Barrier(count, timeout=30)

    def unit(name: str) -> UnitState:
        def start() -> dict[str, object]:
            all_begun.wait()
            return {name: object()}

        member = GroupState(config=GroupConfig(name=name, worker="examples.transport_check:TransportCheckActor",
                                                  plain_actor=True),
                            methods={}, worker_class="TransportCheckActor", resource_pool="pool",
                            durability=_NothingStored())
        state = UnitState(Unit(name, [name], start), [member])
        member.unit = state
        return state

    units = [unit(f"g{i}") for i in range(count)]
    supervisor = Supervisor(units, request_timeout_s=30, health_timeout_s=30)
    run(supervisor.start_all())
    assert [u.status for u in units] == [READY] * count
    supervisor.shutdown()  # the controller's shutdown ends the start threads
    for thread in threading.enumerate():
        if thread.name.startswith("unit-start"):
            thread.join(timeout=10)
    assert not [t for t in threading.enumerate() if t.name.startswith("unit-start")]


class _SilentWorker:
    """A rank whose pings stay unanswered (its future is never set)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.__ray_ready__ = self
        self.loop = loop

    def remote(self) -> asyncio.Future:
        return self.loop.create_future()


def test_a_ready_group_reads_checking_while_its_ranks_are_pinged_after_a_lost_worker():
    async def scenario():
        loop = asyncio.get_running_loop()
        group = type("Group", (), {"workers": [_SilentWorker(loop), _SilentWorker(loop)]})()
        member = GroupState(config=GroupConfig(name="g", worker="examples.transport_check:TransportCheckActor",
                                               plain_actor=True),
                            methods={}, worker_class="TransportCheckActor", resource_pool="pool",
                            durability=_NothingStored())
        unit = UnitState(Unit("g", ["g"], lambda: {"g": group}), [member])
        member.unit = unit
        supervisor = Supervisor([unit], request_timeout_s=30, health_timeout_s=30)
        await supervisor.start_all()
        assert (member.reported_status, member.serving) == ("ready", True)

        supervisor.worker_lost(unit, "a call found a worker gone")
        await asyncio.sleep(0)  # the examination sends its pings
        assert (member.status, member.reported_status, member.serving) == ("ready", "checking", False)

        unit.task.cancel()  # no answer comes: end the examination here
        with pytest.raises(asyncio.CancelledError):
            await unit.task
        assert (member.reported_status, member.serving) == ("ready", True)
        supervisor.shutdown()

    run(scenario())

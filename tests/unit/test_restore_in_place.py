"""``GroupDurability``'s restores on a group's own processes, without Ray: a real SQLite
scope and the library's own ``WorkerGroup`` call flow over ranks that are objects in this
process. A start keeps the state the ranks came up with; a restore in place brings ranks
that a failed call changed back to the acknowledged state (from that state, or from a
stored snapshot); a new rank alone gets its part and its share of the journal; and a
group with neither a snapshot nor its starting state cannot be restored in place."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from hybridflow.config import GroupConfig, StateConfig
from hybridflow.control.catalogue import catalogue
from hybridflow.control.contract import CallRequest, CallResult
from hybridflow.control.durability import GroupDurability, NothingToStartFrom
from hybridflow.control.supervisor import GroupState
from hybridflow.state.codec import encode_snapshot
from hybridflow.state.journal import Journal
from single_controller.base.worker_group import WorkerGroup
from single_controller.models.tutorial_workers import GPUAccumulator

GROUP = GroupConfig(name="gpu_accumulator", worker="single_controller.models.tutorial_workers:GPUAccumulator",
                    pool={"process_on_nodes": [4]}, read_only=["get_value"])
SCOPE = "accumulators/gpu_accumulator"


class Rank:
    """GPUAccumulator's state on one rank, as a plain number; counts its loads."""

    def __init__(self, rank: int) -> None:
        self.value = rank
        self.loads = 0

    def add(self, x):
        self.value += x
        return self.value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]
        self.loads += 1


class LocalGroup(WorkerGroup):
    """Ranks as objects in this process; each call answers an asyncio future at once (an
    argument that is one is read as Ray reads an object ref)."""

    def __init__(self, world_size: int) -> None:
        super().__init__(resource_pool=None)
        self._workers = [Rank(rank) for rank in range(world_size)]

    def _submit(self, rank: int, method: str, args: tuple, kwargs: dict) -> Any:
        args = tuple(a.result() if isinstance(a, asyncio.Future) else a for a in args)
        future = asyncio.get_running_loop().create_future()
        future.set_result(getattr(self._workers[rank], method)(*args, **kwargs))
        return future

    def values(self) -> list[int]:
        return [rank.value for rank in self._workers]


@pytest.fixture()
def scope(tmp_path):
    state = StateConfig(path=str(tmp_path / "state.db"))
    durability = GroupDurability(state.open(), "accumulators", GROUP, 4, GPUAccumulator, 1000, request_timeout_s=10)
    asyncio.run(durability.open(state, None))
    member = GroupState(config=GROUP, methods=catalogue(GPUAccumulator, GROUP.read_only),
                        worker_class="GPUAccumulator", resource_pool="", durability=durability, journal=Journal(1))
    return durability, member


async def acknowledge(durability: GroupDurability, member: GroupState, x: list[int]) -> None:
    """A call applied on every rank and recorded, as the controller does it."""
    entry = member.journal.begin("add")
    request = CallRequest("gpu_accumulator", "add", args=[x])
    pending = member.group.submit("add", [x], {})
    await asyncio.gather(*pending.futures)
    call = await durability.encode("add", request.args, request.kwargs)
    await durability.record(durability.pending(entry, call, request), CallResult(output=None))
    member.journal.acknowledge(entry)


def test_a_failed_calls_changes_are_undone_on_the_same_ranks(scope):
    durability, member = scope

    async def scenario():
        member.group = LocalGroup(4)
        assert await durability.restore(member) == 0 and durability.in_place
        await acknowledge(durability, member, [1, 2, 3, 4])
        await acknowledge(durability, member, [10, 10, 10, 10])
        ranks = list(member.group.workers)
        assert member.group.values() == [11, 13, 15, 17]
        member.group.submit("add", [[100, 0, 100, 0]], {})  # applied on some ranks, never acknowledged
        assert await durability.restore_in_place(member) == 2
        assert member.group.values() == [11, 13, 15, 17] and member.group.workers == ranks
        # a new rank 2 alone: its part of the state the ranks came up with, then its share of each call
        member.group._workers[2] = Rank(2)
        assert await durability.restore_ranks(member, [2]) == 2
        assert member.group.values() == [11, 13, 15, 17]
        assert [rank.loads for rank in member.group.workers] == [1, 1, 1, 1]  # rank 2's: the new one's own

    asyncio.run(scenario())


def test_a_stored_snapshot_is_where_a_restore_in_place_starts(scope):
    durability, member = scope

    async def scenario():
        member.group = LocalGroup(4)
        await durability.restore(member)
        await acknowledge(durability, member, [1, 1, 1, 1])
        await durability.io.call("store_snapshot", durability.scope, 1, encode_snapshot(
            [{"value": v} for v in member.group.values()]))
        durability.snapshots.on_stored()  # as the snapshots do once one is stored
        assert durability.base is None
        await acknowledge(durability, member, [5, 5, 5, 5])
        member.group._workers[0].value = -1  # a failed call's change
        assert await durability.restore_in_place(member) == 1  # the snapshot, then the call after it
        assert member.group.values() == [6, 7, 8, 9]
        member.group._workers[3] = Rank(3)
        assert await durability.restore_ranks(member, [3]) == 1
        assert member.group.values() == [6, 7, 8, 9]

    asyncio.run(scenario())


def test_without_a_snapshot_or_the_starting_state_it_is_rebuilt_instead(scope):
    durability, member = scope

    async def scenario():
        member.group = LocalGroup(4)
        await durability.restore(member)
        durability.base = None  # as a start that kept no starting state
        with pytest.raises(NothingToStartFrom, match="no snapshot, and no state from the ranks' start"):
            await durability.restore_in_place(member)

    asyncio.run(scenario())

"""How the supervisor brings a unit back (``hybridflow.control.supervisor`` decides when):

- :meth:`Recovery.rebuild`: the unit's workers shut down, fresh ones started, every
  member's stored state restored on them (``GroupDurability.restore``);
- :meth:`Recovery.restore_in_place`: the same processes get every member's last snapshot
  (or the state they started with, before any snapshot) and the journal after it
  (``GroupDurability.restore_in_place``);
- :meth:`Recovery.replace_ranks`: a new worker for each lost rank alone, in its bundle
  (``RayWorkerGroup.replace_worker``), its init calls' share run on it, then its part of
  the snapshot and its share of the journal (``GroupDurability.restore_ranks``); if a
  mutating call may have changed the other ranks meanwhile, every rank is restored in
  place instead.

Each runs as the unit's task, with calls refused (503 with Retry-After) until it is
ready again; a compiled graph is torn down with the workers it spans and built again
once the state is restored (over Ray tasks). A failure goes to the supervisor's
``failed`` (tried again after the backoff, or halted).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from hybridflow.control import metrics
from hybridflow.control.builder import restart_rank
from hybridflow.control.group_state import READY, REBUILDING, UNKNOWN_NODE, GroupState, UnitState, hopeless
from hybridflow.control.transport import COMPILED, SOCKET

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from hybridflow.control.events import EventBus

logger = logging.getLogger(__name__)


class Recovery:
    """The procedures of :class:`hybridflow.control.supervisor.Supervisor` (a mixin)."""

    _starts: ThreadPoolExecutor
    request_timeout_s: float
    replay_timeout_s: float
    events: EventBus
    on_rebuilt: Callable[[UnitState, int], None] | None

    def set_status(self, unit: UnitState, status: str) -> None: ...

    def failed(self, unit: UnitState, what: str, exc: BaseException) -> None: ...

    # -- bringing workers up ------------------------------------------------------------
    async def _bring_up(self, unit: UnitState) -> dict[str, int]:
        """Start the unit's processes and restore every member's stored state; returns
        the calls replayed per member. On a failure the new processes are shut down."""
        loop = asyncio.get_running_loop()
        groups = await loop.run_in_executor(self._starts, unit.unit.start)
        for member in unit.members:
            member.group = groups[member.name]
        try:
            replayed = {member.name: await self.replay(member) for member in unit.members}
            await self._learn_nodes(unit)
            await self._build_channels(unit)
            return replayed
        except BaseException:
            for member in unit.members:
                member.group = member.channel = None
            # colocated members share processes: one shutdown ends all (a replay may still run there)
            await asyncio.shield(asyncio.to_thread(groups[unit.members[0].name].shutdown))
            raise

    async def replay(self, member: GroupState) -> int:
        """Give the member's fresh workers its stored state: the snapshot, then every
        acknowledged call after it in order, within the replay deadline (TimeoutError
        past it); returns how many calls were replayed."""
        restored = await asyncio.wait_for(member.durability.restore(member), self.replay_timeout_s)
        return metrics.calls_replayed(member.name, restored)

    async def _build_channels(self, unit: UnitState) -> None:
        loop = asyncio.get_running_loop()
        for member in unit.members:  # restored over tasks; served over the channel from now on
            if member.channel is not None:
                continue
            if member.transport == COMPILED:
                member.channel = await loop.run_in_executor(self._starts, member.group.graph_channel)
            elif member.transport == SOCKET:
                channel = await loop.run_in_executor(self._starts, member.group.socket_channel)
                channel.attach(loop)
                member.channel = channel

    async def _learn_nodes(self, unit: UnitState) -> None:
        """Each rank's node, as ``GET /v1/groups/{group}`` shows it, kept for naming the
        node of a rank that is lost later (a dead rank cannot be asked)."""
        group = unit.members[0].group
        try:
            infos = await asyncio.wait_for(asyncio.to_thread(group.rank_info), self.request_timeout_s)
            unit.nodes = [str(info.get("node_ip") or info.get("node_id") or UNKNOWN_NODE) for info in infos]
        except Exception:  # a plain actor tells no node; a rank lost now is noticed by the next check
            unit.nodes = []

    def _up(self, unit: UnitState) -> None:
        unit.generation += 1
        unit.supervision.backoff.succeeded()
        unit.replacing = []
        for member in unit.members:
            member.diverged = False
        unit.last_error = None
        self.set_status(unit, READY)

    async def _settle_calls(self, unit: UnitState) -> None:
        for member in unit.members:  # calls in flight on the old workers fail and settle first
            await member.journal.settled(self.request_timeout_s + 10)

    # -- rebuild --------------------------------------------------------------------------
    async def rebuild(
        self,
        unit: UnitState,
        discard: Callable[[], Awaitable[None]] | None = None,
        after: asyncio.Task | None = None,
    ) -> None:
        """The unit on fresh workers with its stored state; ``discard`` (an operator's
        reset) drops that state first; ``after``: a start or rebuild to let finish first."""
        if after is not None and not after.done():
            await asyncio.wait([after])  # its outcome is the unit's state, read below
            self.set_status(unit, REBUILDING)
        started = time.monotonic()
        try:
            old = [member.group for member in unit.members if member.group is not None]
            for member in unit.members:
                member.group = member.channel = None
            for group in old[:1]:  # colocated members share processes: one shutdown ends all
                await asyncio.to_thread(group.shutdown)
            await self._settle_calls(unit)
            if discard is not None:
                await discard()
            replayed = await self._bring_up(unit)
        except Exception as exc:  # keep the controller up: tried again, or halted
            self.failed(unit, "rebuild", exc)
            return
        seconds = time.monotonic() - started
        unit.rebuilds += 1
        unit.replayed += sum(replayed.values())
        logger.warning("%s rebuilt in %.1f s, %d calls replayed", unit.unit.name, seconds, sum(replayed.values()))
        for member in unit.members:
            self.events.publish("group_rebuilt", member.name, seconds=round(seconds, 3),
                                replayed_calls=replayed[member.name])
        self._up(unit)
        if self.on_rebuilt is not None:
            self.on_rebuilt(unit, sum(replayed.values()))

    # -- in place -------------------------------------------------------------------------
    async def restore_in_place(self, unit: UnitState) -> None:
        """Every member's acknowledged state on its own processes; a rebuild instead when
        that cannot be done (no state to start from, a worker lost meanwhile)."""
        started = time.monotonic()
        try:
            await self._settle_calls(unit)
            replayed = 0
            for member in unit.members:
                count = await asyncio.wait_for(member.durability.restore_in_place(member), self.replay_timeout_s)
                replayed += metrics.calls_replayed(member.name, count)
        except Exception as exc:
            if hopeless(exc):
                self.failed(unit, "restore", exc)
                return
            logger.warning("%s could not be restored in place (%s): rebuilding it", unit.unit.name, exc)
            self.set_status(unit, REBUILDING)
            await self.rebuild(unit)
            return
        unit.replayed += replayed
        self._up(unit)
        logger.warning("%s restored in place in %.1f s, %d calls replayed", unit.unit.name,
                       time.monotonic() - started, replayed)

    # -- replacing ranks ----------------------------------------------------------------------
    async def replace_ranks(self, unit: UnitState, ranks: list[int]) -> None:
        """New workers for ``ranks`` of the unit's one group, brought to the others' state."""
        started = time.monotonic()
        member = unit.members[0]
        group, config = member.group, member.config
        try:
            member.channel = None  # its graph spans the lost workers (replace_worker tears it down)
            await self._settle_calls(unit)
            loop = asyncio.get_running_loop()
            for rank in ranks:
                await loop.run_in_executor(self._starts, restart_rank, group, config, rank)
            if member.diverged:  # a call in flight may have changed the other ranks: all restored
                restore = member.durability.restore_in_place(member)
            else:
                restore = member.durability.restore_ranks(member, ranks)
            replayed = metrics.calls_replayed(member.name, await asyncio.wait_for(restore, self.replay_timeout_s))
            await self._learn_nodes(unit)
            await self._build_channels(unit)
        except Exception as exc:
            unit.replacing = list(ranks)
            self.failed(unit, f"replacing rank {', '.join(map(str, ranks))}", exc)
            return
        seconds = round(time.monotonic() - started, 3)
        unit.replaced_ranks += len(ranks)
        unit.replayed += replayed
        logger.warning("%s: rank %s replaced in %.1f s, %d calls replayed", unit.unit.name,
                       ", ".join(map(str, ranks)), seconds, replayed)
        for rank in ranks:
            metrics.rank_replaced(member.name)
            self.events.publish("rank_replaced", member.name, rank=rank, seconds=seconds)
        self._up(unit)

"""Supervision of a controller's units: start them, tell a busy worker from a lost one,
and rebuild a unit that lost a worker (or whose workers no longer match the journal).
Both a start and a rebuild give the fresh workers the group's stored state (snapshot,
then the journal after it: ``hybridflow.control.durability``).

Everything here runs on the controller replica's event loop; only a unit's ``start()``
(which blocks while worker processes come up) runs in a thread. The health check never
waits behind calls: a ping that a running call holds up is not a failure. A worker is
lost when Ray says so (a call or ping to it fails with an actor error), or when it does
not answer a ping while no call of ours is running on it (hung).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import RayActorError, RayError, RayTaskError

from hybridflow.config import GroupConfig
from hybridflow.control import metrics
from hybridflow.control.builder import Unit
from hybridflow.control.catalogue import MethodInfo
from hybridflow.state.journal import Journal

logger = logging.getLogger(__name__)

STARTING, READY, REBUILDING, FAILED = "starting", "ready", "rebuilding", "failed"


def as_asyncio(refs: list[Any]) -> list[asyncio.Future]:
    """Ray futures as asyncio futures of the running loop."""
    return [asyncio.wrap_future(ref.future()) for ref in refs]


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


def failure_of(exc: BaseException) -> tuple[bool, str]:
    """``(worker_lost, message)`` for an exception a Ray future raised: a method that
    raised is the caller's matter (its message's last line, never a traceback); any
    other Ray error means a worker or its objects are gone."""
    if isinstance(exc, RayTaskError) and not isinstance(exc, RayActorError):
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        return False, f"{type(cause).__name__}: {first_line(cause)}"
    if isinstance(exc, RayError):
        return True, type(exc).__name__
    return False, f"{type(exc).__name__}: {first_line(exc)}"


@dataclass
class GroupState:
    """One served group: its declaration, methods, journal and the running group."""

    config: GroupConfig
    methods: dict[str, MethodInfo]
    worker_class: str
    resource_pool: str
    journal: Journal = field(default_factory=Journal)
    #: The group's scope in the state store (hybridflow.control.durability.GroupDurability).
    durability: Any = None
    group: Any = None
    unit: UnitState | None = None
    #: Calls of ours running on the workers (read-only ones too): a busy group.
    running: int = 0
    #: Acknowledged mutating calls since start: what an io spec cache is keyed by.
    state_version: int = 0

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def status(self) -> str:
        return self.unit.status if self.unit else STARTING


@dataclass
class UnitState:
    unit: Unit
    members: list[GroupState]
    status: str = STARTING
    last_error: str | None = None
    rebuilds: int = 0
    replayed: int = 0
    #: Bumped on every (re)start: calls and caches of an older generation are stale.
    generation: int = 0
    pings: list[asyncio.Future] | None = None
    task: asyncio.Task | None = None

    @property
    def busy(self) -> bool:
        return any(member.running for member in self.members)

    def workers(self) -> list[Any]:
        group = self.members[0].group
        return list(group.workers) if group is not None else []


class Supervisor:
    def __init__(
        self,
        units: list[UnitState],
        request_timeout_s: float,
        health_timeout_s: float,
        on_rebuilt: Callable[[UnitState, int], None] | None = None,
    ) -> None:
        self.units = units
        self.request_timeout_s = request_timeout_s
        self.health_timeout_s = health_timeout_s
        self.on_rebuilt = on_rebuilt

    # -- start ------------------------------------------------------------------------
    async def start_all(self) -> None:
        """Start every unit at once (each waits seconds for its processes) and restore
        its stored state. A unit that fails is left FAILED (the health check retries it)
        and the first failure is raised."""
        loop = asyncio.get_running_loop()
        for unit in self.units:
            unit.task = loop.create_task(self._start(unit))
        await asyncio.gather(*(unit.task for unit in self.units))

    async def _start(self, unit: UnitState) -> None:
        try:
            groups = await asyncio.to_thread(unit.unit.start)
            for member in unit.members:
                member.group = groups[member.name]
            for member in unit.members:
                unit.replayed += await self.replay(member)
        except Exception as exc:
            unit.status, unit.last_error = FAILED, f"start failed: {type(exc).__name__}: {first_line(exc)}"
            logger.exception("starting %s failed", unit.unit.name)
            raise
        unit.generation += 1
        unit.status = READY

    # -- health -----------------------------------------------------------------------
    async def check(self) -> dict[str, str]:
        """Serve's health check: look at every unit at once, never longer than the
        health timeout; start rebuilding any unit that lost a worker."""
        await asyncio.gather(*(self._check(unit) for unit in self.units))
        return {member.name: unit.status for unit in self.units for member in unit.members}

    async def _check(self, unit: UnitState) -> None:
        if unit.status == FAILED:
            self.recover(unit, "retrying after a failed rebuild")
            return
        if unit.status != READY:
            return
        if unit.pings is None:
            unit.pings = as_asyncio([worker.__ray_ready__.remote() for worker in unit.workers()])
        generation = unit.generation
        busy_at_start = unit.busy
        done, pending = await asyncio.wait(unit.pings, timeout=self.health_timeout_s)
        if generation != unit.generation:
            return  # rebuilt meanwhile: these pings were for the old workers
        lost = [future for future in done if future.exception() is not None]
        if lost:
            unit.pings = None
            self.recover(unit, f"a worker is lost ({failure_of(lost[0].exception())[1]})")
        elif not pending:
            unit.pings = None
        elif not (busy_at_start or unit.busy):
            # idle the whole wait: a call that ended during it may still hold the pings
            unit.pings = None
            self.recover(unit, f"a worker did not answer a ping within {self.health_timeout_s:g} s while idle")
        # else: the pings wait behind a running call; they are kept for the next check

    # -- rebuild ------------------------------------------------------------------------
    def recover(self, unit: UnitState, reason: str) -> None:
        """Rebuild the unit in the background, once at a time."""
        if unit.status in (REBUILDING, STARTING) and unit.task is not None and not unit.task.done():
            return
        logger.warning("rebuilding %s: %s", unit.unit.name, reason)
        unit.status = REBUILDING
        unit.last_error = reason
        unit.pings = None
        unit.task = asyncio.get_running_loop().create_task(self._rebuild(unit))

    async def _rebuild(self, unit: UnitState) -> None:
        started = time.monotonic()
        try:
            old = [member.group for member in unit.members if member.group is not None]
            for member in unit.members:
                member.group = None
            for group in old[:1]:  # colocated members share processes: one shutdown ends all
                await asyncio.to_thread(group.shutdown)
            for member in unit.members:  # calls in flight on the old workers fail and settle first
                await member.journal.settled(self.request_timeout_s + 10)
            groups = await asyncio.to_thread(unit.unit.start)
            for member in unit.members:
                member.group = groups[member.name]
            replayed = 0
            for member in unit.members:
                replayed += await self.replay(member)
            unit.generation += 1
            unit.rebuilds += 1
            unit.replayed += replayed
            unit.status, unit.last_error = READY, None
            logger.warning("%s rebuilt in %.1f s, %d calls replayed", unit.unit.name, time.monotonic() - started, replayed)
            if self.on_rebuilt is not None:
                self.on_rebuilt(unit, replayed)
        except Exception as exc:  # keep the controller up; the next health check retries
            unit.status, unit.last_error = FAILED, f"rebuild failed: {type(exc).__name__}: {first_line(exc)}"
            logger.exception("rebuilding %s failed", unit.unit.name)

    async def replay(self, member: GroupState) -> int:
        """Give the member's fresh workers its stored state: the snapshot, then every
        acknowledged call after it in order; returns how many calls were replayed."""
        return metrics.calls_replayed(member.name, await member.durability.restore(member))

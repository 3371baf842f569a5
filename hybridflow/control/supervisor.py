"""Supervision of a controller's units: start them, tell a busy worker from a lost one,
and rebuild a unit that lost a worker (or whose workers no longer match the journal).
Both a start and a rebuild give the fresh workers the group's stored state (snapshot,
then the journal after it: ``hybridflow.control.durability``), within the replay
deadline.

A start or rebuild that fails is retried by the next health check, unless retrying
cannot help: the stored state cannot be restored (a replayed call raised, the replay ran
past its deadline, the stored bytes do not decode or name a method the group does not
have) or an init call raised. Such a unit stays ``failed`` (halted), its workers shut
down, with the reason in ``last_error``, until an operator resets a group of it
(:meth:`Supervisor.reset`: its stored state is discarded and the unit rebuilt).

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
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import RayActorError, RayError, RayTaskError

from hybridflow.config import GroupConfig, StateConfig
from hybridflow.control import metrics
from hybridflow.control.builder import Unit
from hybridflow.control.catalogue import MethodInfo
from hybridflow.control.contract import first_line
from hybridflow.control.fence import Fence
from hybridflow.control.submissions import Submissions
from hybridflow.control.transport import COMPILED, TASKS
from hybridflow.state.codec import StateCodecError
from hybridflow.state.journal import Journal
from hybridflow.state.store import StateMismatchError
from single_controller.weights.reasons import scrub

logger = logging.getLogger(__name__)

STARTING, READY, REBUILDING, FAILED = "starting", "ready", "rebuilding", "failed"


class RestoreRefused(ValueError):
    """Stored state that must not be applied (e.g. a journal entry naming a method that
    is not in the group's catalogue)."""


def hopeless(exc: BaseException) -> bool:
    """Whether a start or restore that raised ``exc`` would fail the same way again: a
    method raised (a replayed call, an init call), the replay deadline passed, or the
    stored state cannot be applied. A lost worker, a store that cannot be reached or
    resources not there yet may pass."""
    if isinstance(exc, (TimeoutError, StateCodecError, StateMismatchError, RestoreRefused)):
        return True
    return isinstance(exc, RayTaskError) and not isinstance(exc, RayActorError)


def as_asyncio(refs: list[Any]) -> list[asyncio.Future]:
    """Ray futures as asyncio futures of the running loop (a compiled graph's channel
    answers asyncio futures already)."""
    return [ref if isinstance(ref, asyncio.Future) else asyncio.wrap_future(ref.future()) for ref in refs]


def failure_of(exc: BaseException) -> tuple[bool, str]:
    """``(worker_lost, message)`` for an exception a Ray future raised: a method that
    raised is the caller's matter (its message's last line, never a traceback); any
    other Ray error, also one a task reports as its cause (a compiled graph's rank whose
    peer died, its channel closed), means a worker or its objects are gone."""
    if isinstance(exc, RayTaskError) and not isinstance(exc, RayActorError):
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        if isinstance(cause, RayError) and cause is not exc:
            return True, type(cause).__name__
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
    #: Holds new calls back while an operation must see none (a weight sync's commit).
    fence: Fence = field(default_factory=Fence)
    #: How calls reach the ranks (hybridflow.control.transport): tasks, or compiled.
    transport: str = TASKS
    #: The running group's compiled graph, for a compiled transport.
    channel: Any = None
    #: Hands the group's calls to its ranks in journal order (hybridflow.control.submissions).
    submissions: Submissions = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.submissions is None:
            self.submissions = Submissions(self.config.name)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def caller(self) -> Any:
        """What takes the running group's calls that read or change its ranks' state: its
        compiled graph's channel, or the group itself (a Ray task per rank)."""
        return self.channel if self.channel is not None else self.group

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
    #: Failed so that retrying cannot help: health checks leave it until a reset.
    halted: bool = False
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
        replay_timeout_s: float = StateConfig().replay_timeout_s,
    ) -> None:
        self.units = units
        # A thread per unit for its start: the loop's default executor has cpu_count + 4
        # threads, shared with the store's I/O and every other controller of the process,
        # so on a small machine some units would wait for others' processes to come up.
        self._starts = ThreadPoolExecutor(max_workers=max(1, len(units)), thread_name_prefix="unit-start")
        self.request_timeout_s = request_timeout_s
        self.health_timeout_s = health_timeout_s
        self.on_rebuilt = on_rebuilt
        self.replay_timeout_s = replay_timeout_s

    # -- start ------------------------------------------------------------------------
    def shutdown(self) -> None:
        """End the start threads (a start still running finishes; none queued begins)."""
        self._starts.shutdown(wait=False, cancel_futures=True)

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
            unit.replayed += await self._bring_up(unit)
        except Exception as exc:
            self._failed(unit, "start", exc)
            raise
        unit.generation += 1
        unit.status = READY

    async def _bring_up(self, unit: UnitState) -> int:
        """Start the unit's processes and restore every member's stored state; returns
        the calls replayed. On a failure the new processes are shut down."""
        loop = asyncio.get_running_loop()
        groups = await loop.run_in_executor(self._starts, unit.unit.start)
        for member in unit.members:
            member.group = groups[member.name]
        try:
            replayed = 0
            for member in unit.members:
                replayed += await self.replay(member)
            for member in unit.members:  # restored over tasks; served over the graph from now on
                if member.transport == COMPILED:
                    member.channel = await loop.run_in_executor(self._starts, member.group.graph_channel)
            return replayed
        except BaseException:
            for member in unit.members:
                member.group = member.channel = None
            # colocated members share processes: one shutdown ends all (a replay may still run there)
            await asyncio.shield(asyncio.to_thread(groups[unit.members[0].name].shutdown))
            raise

    def _failed(self, unit: UnitState, what: str, exc: BaseException) -> None:
        reason = "ran past the replay deadline" if isinstance(exc, TimeoutError) else (
            f"{type(exc).__name__}: {scrub(first_line(exc))}")  # a status line: no paths or addresses
        unit.status, unit.halted = FAILED, hopeless(exc)
        unit.last_error = f"{what} failed: {reason}"
        if unit.halted:
            names = [member.name for member in unit.members]
            route = " or ".join(f"POST /v1/admin/groups/{name}/reset" for name in names)
            unit.last_error += f"; not retried: fix the cause, or discard the stored state with {route}"
        logger.error("%s of %s failed%s", what, unit.unit.name, " (not retried)" if unit.halted else "",
                     exc_info=exc)

    # -- health -----------------------------------------------------------------------
    async def check(self) -> dict[str, str]:
        """Serve's health check: look at every unit at once, never longer than the
        health timeout; start rebuilding any unit that lost a worker."""
        await asyncio.gather(*(self._check(unit) for unit in self.units))
        return {member.name: unit.status for unit in self.units for member in unit.members}

    async def _check(self, unit: UnitState) -> None:
        if unit.status == FAILED:
            if not unit.halted:
                self.recover(unit, "retrying after a failed start or rebuild")
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
        self._begin(unit, reason, self._rebuild(unit))

    def reset(self, unit: UnitState, discard: Callable[[], Awaitable[None]], reason: str) -> None:
        """Rebuild the unit, calling ``discard`` (which drops stored state) once its old
        workers are gone and the calls on them settled; after a start or rebuild that is
        running now, halted or not."""
        logger.warning("resetting %s: %s", unit.unit.name, reason)
        self._begin(unit, reason, self._rebuild(unit, discard, after=unit.task))

    def _begin(self, unit: UnitState, reason: str, rebuild: Coroutine[Any, Any, None]) -> None:
        unit.status, unit.halted = REBUILDING, False
        unit.last_error = reason
        unit.pings = None
        unit.task = asyncio.get_running_loop().create_task(rebuild)

    async def _rebuild(
        self,
        unit: UnitState,
        discard: Callable[[], Awaitable[None]] | None = None,
        after: asyncio.Task | None = None,
    ) -> None:
        if after is not None and not after.done():
            await asyncio.wait([after])  # its outcome is the unit's state, read below
            unit.status = REBUILDING
        started = time.monotonic()
        try:
            old = [member.group for member in unit.members if member.group is not None]
            for member in unit.members:
                member.group = member.channel = None
            for group in old[:1]:  # colocated members share processes: one shutdown ends all
                await asyncio.to_thread(group.shutdown)
            for member in unit.members:  # calls in flight on the old workers fail and settle first
                await member.journal.settled(self.request_timeout_s + 10)
            if discard is not None:
                await discard()
            replayed = await self._bring_up(unit)
            unit.generation += 1
            unit.rebuilds += 1
            unit.replayed += replayed
            unit.status, unit.last_error = READY, None
            logger.warning("%s rebuilt in %.1f s, %d calls replayed", unit.unit.name, time.monotonic() - started, replayed)
            if self.on_rebuilt is not None:
                self.on_rebuilt(unit, replayed)
        except Exception as exc:  # keep the controller up; the next health check retries unless halted
            self._failed(unit, "rebuild", exc)

    async def replay(self, member: GroupState) -> int:
        """Give the member's fresh workers its stored state: the snapshot, then every
        acknowledged call after it in order, within the replay deadline (TimeoutError
        past it); returns how many calls were replayed."""
        restored = await asyncio.wait_for(member.durability.restore(member), self.replay_timeout_s)
        return metrics.calls_replayed(member.name, restored)

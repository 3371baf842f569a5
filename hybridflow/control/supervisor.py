"""Supervision of a controller's units: start them, tell a busy worker from a lost one,
and bring a unit back under its group's ``supervision`` (``hybridflow.control.restarts``).

What happens, by cause:

- **A rank is lost** (Ray says its actor died, or it did not answer a ping while idle):
  the group's ``on_rank_lost`` decides. ``rebuild_group``: the unit is rebuilt on fresh
  workers and its stored state restored (snapshot, then the journal after it:
  ``hybridflow.control.durability``). ``replace_rank``: a new worker for each lost rank,
  in its bundle, brought to the others' state, which keep their processes (restored in
  place if a mutating call may have changed them meanwhile). ``halt``: the unit is failed
  with the rank, its node and the cause in ``last_error``, until an operator restarts or
  resets it. A call that ran past its deadline rebuilds the unit (its workers are stuck).
- **A client's mutating call left the ranks off the journal** (it raised on some or all
  of them, the store did not take it, it reached some ranks only): the unit is restored
  in place, on its own processes, when its workers have ``state_dict`` and
  ``load_state_dict``; else rebuilt. This is no restart: the workers did nothing wrong.
- **A start fails** (a rebuild's or replacement's too): tried again after the backoff,
  unless retrying cannot help (a replayed or init call raised, the replay ran past its
  deadline, the stored state cannot be applied): then the unit halts until an operator
  resets it.

Every rebuild or replacement after a lost rank, and every try after a failed start, is a
restart: past ``max_restarts`` within ``restart_window_s`` the unit halts instead
("restarted 5 times in 300 s"). Each change of status, lost rank, replacement, rebuild
and halt is an event (``hybridflow.control.events``).

Everything here runs on the controller replica's event loop; only a unit's ``start()``
(which blocks while worker processes come up) and rank replacements run in threads. The
health check never waits behind calls: a ping that a running call holds up is not a
failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray.exceptions import RayActorError

from hybridflow.config import StateConfig
from hybridflow.control import metrics
from hybridflow.control.contract import first_line
from hybridflow.control.events import EventBus
from hybridflow.control.group_state import (
    FAILED,
    READY,
    REBUILDING,
    REPLACING,
    RESTORING,
    STARTING,
    GroupState,
    RestoreRefused,
    UnitState,
    as_asyncio,
    failure_of,
    hopeless,
)
from hybridflow.control.recovery import Recovery
from hybridflow.control.restarts import Decision, may_restart, on_rank_lost
from single_controller.weights.reasons import scrub

__all__ = [
    "FAILED", "READY", "REBUILDING", "REPLACING", "RESTORING", "STARTING", "GroupState", "RestoreRefused",
    "Supervisor", "UnitState", "as_asyncio", "failure_of", "first_line", "hopeless",
]

logger = logging.getLogger(__name__)


class Supervisor(Recovery):
    def __init__(
        self,
        units: list[UnitState],
        request_timeout_s: float,
        health_timeout_s: float,
        on_rebuilt: Callable[[UnitState, int], None] | None = None,
        replay_timeout_s: float = StateConfig().replay_timeout_s,
        events: EventBus | None = None,
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
        self.events = events if events is not None else EventBus()
        self.closed = False

    # -- status ---------------------------------------------------------------------------
    def set_status(self, unit: UnitState, status: str) -> None:
        """Change the unit's status: an event per member, and its not-ready time counted."""
        previous, unit.status = unit.status, status
        self.count_unready(unit)
        if status == READY:
            unit.unready_since, unit.came_up = None, True
        elif unit.unready_since is None:
            unit.unready_since = time.monotonic()
        if previous != status:
            for member in unit.members:
                self.events.publish("group_status", member.name, status=status, previous=previous)

    def count_unready(self, unit: UnitState) -> None:
        """Add the unit's not-ready time up to now to its metric (status changes and
        every health check call it)."""
        if unit.unready_since is not None:
            now = time.monotonic()
            for member in unit.members:
                metrics.group_unready(member.name, now - unit.unready_since)
            unit.unready_since = now

    # -- start ------------------------------------------------------------------------
    def shutdown(self) -> None:
        """End the start threads (a start still running finishes; none queued begins)
        and the tries due after failed starts; nothing is started again from now on."""
        self.closed = True
        for unit in self.units:
            if unit.retry is not None:
                unit.retry.cancel()
        self._starts.shutdown(wait=False, cancel_futures=True)

    async def start_all(self) -> None:
        """Start every unit at once (each waits seconds for its processes) and restore
        its stored state. A unit that fails is left FAILED (tried again after its
        backoff) and the first failure is raised."""
        loop = asyncio.get_running_loop()
        for unit in self.units:
            unit.task = loop.create_task(self._start(unit))
        await asyncio.gather(*(unit.task for unit in self.units))

    async def _start(self, unit: UnitState) -> None:
        try:
            unit.replayed += sum((await self._bring_up(unit)).values())
        except Exception as exc:
            self.failed(unit, "start", exc)
            raise
        self._up(unit)

    def failed(self, unit: UnitState, what: str, exc: BaseException) -> None:
        """A start, rebuild, restore or replacement raised ``exc``: halted when retrying
        cannot help, else tried again after the unit's backoff."""
        reason = "ran past the replay deadline" if isinstance(exc, TimeoutError) else (
            f"{type(exc).__name__}: {scrub(first_line(exc))}")  # a status line: no paths or addresses
        logger.error("%s of %s failed", what, unit.unit.name, exc_info=exc)
        if hopeless(exc):
            names = [member.name for member in unit.members]
            route = " or ".join(f"POST /v1/admin/groups/{name}/reset" for name in names)
            self.halt(unit, f"{what} failed: {reason}; not retried: fix the cause, or discard the stored state "
                            f"with {route}", hint=False)
            return
        if self.closed:
            return
        delay = unit.supervision.backoff.failed()
        unit.last_failure = f"{what} failed: {reason}"
        unit.last_error = f"{unit.last_failure}; tried again in {delay:g} s"
        self.set_status(unit, FAILED)
        unit.retry = asyncio.get_running_loop().call_later(delay, self._try_again, unit)

    def _try_again(self, unit: UnitState) -> None:
        unit.retry = None
        if unit.status != FAILED or unit.halted or unit.recovering:
            return
        if not may_restart(unit.supervision.window, time.monotonic()):
            self.halt(unit, f"{unit.supervision.window.reason(time.monotonic())}; the last try: {unit.last_failure}")
            return
        self._restarted(unit)
        member = unit.members[0]
        if unit.replacing and member.group is not None:
            self._begin(unit, REPLACING, "trying the replacement again",
                        self.replace_ranks(unit, list(unit.replacing)))
        else:
            self._begin(unit, REBUILDING, "trying again after a failed start", self.rebuild(unit))

    def halt(self, unit: UnitState, reason: str, hint: bool = True) -> None:
        """Stop the unit: ``failed`` until an operator restarts or resets it, calls 503
        without Retry-After, its workers shut down. ``hint``: ``last_error`` names the
        routes that bring it back."""
        if unit.retry is not None:
            unit.retry.cancel()
            unit.retry = None
        unit.halted, unit.last_error = True, reason
        if hint:
            routes = " or ".join(f"POST /v1/admin/groups/{m.name}/restart (/reset discards its state)"
                                 for m in unit.members)
            unit.last_error = f"{reason}; halted until {routes}"
        if unit.members[0].group is not None:
            old = unit.members[0].group
            for member in unit.members:
                member.group = member.channel = None
            # colocated members share processes: one shutdown ends all
            asyncio.get_running_loop().run_in_executor(self._starts, _shut_down, old)
        self.set_status(unit, FAILED)
        logger.error("%s halted: %s", unit.unit.name, reason)
        for member in unit.members:
            metrics.group_halted(member.name)
            self.events.publish("group_halted", member.name, reason=reason)

    # -- health -----------------------------------------------------------------------
    async def check(self) -> dict[str, str]:
        """Serve's health check: look at every unit at once, never longer than the
        health timeout; act on any unit that lost a worker."""
        await asyncio.gather(*(self._check(unit) for unit in self.units))
        for unit in self.units:
            self.count_unready(unit)
        return {member.name: unit.status for unit in self.units for member in unit.members}

    async def _check(self, unit: UnitState) -> None:
        if unit.status != READY or unit.recovering:
            return
        if unit.pings is None:
            unit.pings = as_asyncio([worker.__ray_ready__.remote() for worker in unit.workers()])
        generation, pings = unit.generation, unit.pings
        busy_at_start = unit.busy
        done, pending = await asyncio.wait(pings, timeout=self.health_timeout_s)
        if generation != unit.generation or unit.status != READY or unit.recovering:
            return  # something else acted meanwhile: these pings were for the old state
        lost = {rank: failure_of(f.exception())[1] for rank, f in enumerate(pings) if f in done and f.exception()}
        if lost:
            unit.pings = None
            self.rank_lost(unit, lost)
        elif not pending:
            unit.pings = None
        elif not (busy_at_start or unit.busy):
            # idle the whole wait: a call that ended during it may still hold the pings
            unit.pings = None
            why = f"did not answer a ping within {self.health_timeout_s:g} s while idle"
            self.rank_lost(unit, {rank: why for rank, f in enumerate(pings) if f in pending})
        # else: the pings wait behind a running call; they are kept for the next check

    # -- what a failure leads to -----------------------------------------------------------
    def worker_lost(self, unit: UnitState, cause: str) -> None:
        """A call or snapshot found a worker gone: find which ranks are, then act on them
        (calls are refused meanwhile)."""
        if unit.status != READY or unit.recovering:
            return
        unit.examining = True
        unit.task = asyncio.get_running_loop().create_task(self._examine(unit, cause))

    async def _examine(self, unit: UnitState, cause: str) -> None:
        try:
            pings = as_asyncio([worker.__ray_ready__.remote() for worker in unit.workers()])
            await asyncio.wait(pings, timeout=self.health_timeout_s)
            lost = {rank: failure_of(f.exception())[1] for rank, f in enumerate(pings)
                    if f.done() and isinstance(f.exception(), RayActorError)}
        finally:
            unit.examining = False
        if unit.status != READY:
            return  # an operator's reset or restart took over meanwhile
        unit.pings, unit.task = None, None  # this task is done looking: what follows is another's
        if lost:
            self.rank_lost(unit, lost)
        else:  # every worker answers: its objects were lost, or it died and came back
            self.restart(unit, f"{cause}, but every worker answers")

    def rank_lost(self, unit: UnitState, lost: dict[int, str]) -> None:
        """``lost``: rank -> why. The unit's ``on_rank_lost`` decides (see the module
        docstring); the restart window may halt it instead."""
        ranks = sorted(lost)
        for rank in ranks:
            for member in unit.members:
                self.events.publish("rank_lost", member.name, rank=rank, node=unit.node(rank), reason=lost[rank])
        first = ranks[0]
        what = f"rank {first} on node {unit.node(first)} was lost ({lost[first]})"
        if len(ranks) > 1:
            what += f", and ranks {', '.join(map(str, ranks[1:]))}"
        decision = on_rank_lost(unit.supervision.config, unit.supervision.window, time.monotonic())
        logger.warning("%s: %s: %s", unit.unit.name, what, decision.value)
        if decision is Decision.HALT:
            self.halt(unit, what)
        elif decision is Decision.HALT_INTENSITY:
            self.halt(unit, f"{unit.supervision.window.reason(time.monotonic())} ({what})")
        elif decision is Decision.REPLACE:
            self._restarted(unit)
            self._begin(unit, REPLACING, f"replacing: {what}", self.replace_ranks(unit, ranks))
        else:
            self._restarted(unit)
            self._begin(unit, REBUILDING, f"rebuilding: {what}", self.rebuild(unit))

    def restart(self, unit: UnitState, reason: str) -> None:
        """Rebuild the unit on fresh workers as a restart (its workers are stuck or lost
        in a way no rank shows), unless the restart window is spent."""
        if unit.recovering:
            return
        if not may_restart(unit.supervision.window, time.monotonic()):
            self.halt(unit, f"{unit.supervision.window.reason(time.monotonic())} ({reason})")
            return
        self._restarted(unit)
        logger.warning("rebuilding %s: %s", unit.unit.name, reason)
        self._begin(unit, REBUILDING, reason, self.rebuild(unit))

    def recover(self, unit: UnitState, reason: str) -> None:
        """Rebuild the unit on fresh workers with its stored state, in the background,
        once at a time (no restart: whoever asks knows why)."""
        if unit.recovering:
            return
        logger.warning("rebuilding %s: %s", unit.unit.name, reason)
        self._begin(unit, REBUILDING, reason, self.rebuild(unit))

    def restore(self, unit: UnitState, reason: str) -> None:
        """A client's call left the ranks off the journal: restore them (in place where
        the workers can be), in the background, once at a time. Not a restart."""
        if unit.recovering or unit.status == FAILED:
            return
        logger.warning("restoring %s: %s", unit.unit.name, reason)
        if all(member.durability.in_place for member in unit.members):
            self._begin(unit, RESTORING, reason, self.restore_in_place(unit))
        else:
            self._begin(unit, REBUILDING, reason, self.rebuild(unit))

    def reset(self, unit: UnitState, discard: Callable[[], Awaitable[None]], reason: str) -> None:
        """Rebuild the unit, calling ``discard`` (which drops stored state) once its old
        workers are gone and the calls on them settled; after a start or rebuild that is
        running now, halted or not. An operator's act: its restart count starts again.
        Resets of a unit's members that come before its rebuild discards share that one
        rebuild (colocated members are reset in one go)."""
        logger.warning("resetting %s: %s", unit.unit.name, reason)
        self._operator(unit)
        if unit.discards is not None:
            unit.discards.append(discard)
            return
        discards = unit.discards = [discard]
        self._begin(unit, REBUILDING, reason, self._reset(unit, discards, after=unit.task))

    async def _reset(self, unit: UnitState, discards: list[Callable[[], Awaitable[None]]],
                     after: asyncio.Task | None) -> None:
        """The rebuild of resets: ``discards`` (the list that resets join until it runs)."""
        def closed() -> None:  # a reset from now on waits for this rebuild, then makes its own
            if unit.discards is discards:
                unit.discards = None

        async def discard_all() -> None:
            closed()
            for discard in discards:
                await discard()

        try:
            await self.rebuild(unit, discard_all, after=after)
        finally:
            closed()

    def restart_by_operator(self, unit: UnitState, reason: str) -> None:
        """Rebuild the unit with its stored state (``POST /v1/admin/groups/{group}/restart``):
        the way back for a halted group; its restart count starts again."""
        logger.warning("restarting %s: %s", unit.unit.name, reason)
        self._operator(unit)
        self._begin(unit, REBUILDING, reason, self.rebuild(unit, after=unit.task))

    def _operator(self, unit: UnitState) -> None:
        if unit.retry is not None:
            unit.retry.cancel()
            unit.retry = None
        unit.supervision.reset()
        unit.replacing = []

    def _restarted(self, unit: UnitState) -> None:
        unit.restarts += 1
        for member in unit.members:
            metrics.group_restarted(member.name)

    def _begin(self, unit: UnitState, status: str, reason: str, work: Coroutine[Any, Any, None]) -> None:
        if self.closed:
            work.close()
            return
        unit.halted = False
        unit.last_error = reason
        unit.pings = None
        self.set_status(unit, status)
        unit.task = asyncio.get_running_loop().create_task(work)


def _shut_down(group: Any) -> None:
    try:
        group.shutdown()
    except Exception:  # gone with its node already
        pass

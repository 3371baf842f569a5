"""A call's answers from its ranks, awaited with one wake-up of the event loop.

Awaiting each rank's ObjectRef as an asyncio future (``asyncio.wrap_future(ref.future())``)
costs, per rank, a concurrent future, an asyncio future chained to it, and a thread-safe
wake-up of the loop from Ray's thread: eight of each for an 8-rank call. Here each ref
reports to one tally from Ray's thread, and only the last answer wakes the loop.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayError, RayTaskError


@dataclass(frozen=True, slots=True)
class Outcome:
    """One rank's answer: its value, or the exception its future raised."""

    value: Any = None
    error: BaseException | None = None


def outcome_of(result: Any) -> Outcome:
    """A result as Ray hands it to a completion callback, as its future would raise or
    return it: a method that raised is an instance of its own exception class (and of
    ``RayTaskError``), any other Ray error as it is."""
    if isinstance(result, RayTaskError):
        return Outcome(error=result.as_instanceof_cause())
    if isinstance(result, RayError):
        return Outcome(error=result)
    return Outcome(value=result)


class _Tally:
    """Outcomes as they arrive, from Ray's thread or the loop's; the last one to arrive
    settles ``done`` on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, futures: list[Any]) -> None:
        self.loop = loop
        self.done: asyncio.Future[list[Outcome]] = loop.create_future()
        self.outcomes: list[Outcome | None] = [None] * len(futures)
        self.left = len(futures)
        self.lock = threading.Lock()
        # Ray counts a ref's holders: the tally holds them until every rank answered.
        self.futures = futures

    def arrived(self, rank: int, outcome: Outcome, on_loop: bool) -> None:
        self.outcomes[rank] = outcome
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if not last:
            return
        if on_loop:
            self._settle()
            return
        try:
            self.loop.call_soon_threadsafe(self._settle)
        except RuntimeError:  # the loop closed while the ranks ran: nobody waits
            pass

    def _settle(self) -> None:
        self.futures = []
        if not self.done.done():  # a waiter that gave up cancelled it
            self.done.set_result(self.outcomes)  # type: ignore[arg-type]

    def watch(self, rank: int, future: Any) -> None:
        if isinstance(future, asyncio.Future):  # a channel's answer (socket or compiled graph), on the loop
            future.add_done_callback(lambda f: self.arrived(rank, _outcome_of_future(f), True))
        else:
            future._on_completed(lambda result: self.arrived(rank, outcome_of(result), False))


def _outcome_of_future(future: asyncio.Future) -> Outcome:
    if future.cancelled():
        return Outcome(error=asyncio.CancelledError())
    error = future.exception()
    return Outcome(error=error) if error is not None else Outcome(value=future.result())


async def rank_outcomes(futures: list[Any], timeout_s: float | None) -> list[Outcome] | None:
    """Each rank's outcome in rank order once every rank answered, or None when some had
    not answered within ``timeout_s`` seconds (they are left running). ``futures``: Ray
    ObjectRefs, or asyncio futures of the running loop (a channel's: socket or compiled graph)."""
    if not futures:
        return []
    tally = _Tally(asyncio.get_running_loop(), list(futures))
    for rank, future in enumerate(futures):
        tally.watch(rank, future)
    if tally.done.done():
        return tally.done.result()
    finished, _ = await asyncio.wait([tally.done], timeout=timeout_s)
    return tally.done.result() if finished else None

"""The weight syncs into one group: one runs at a time, at most ``bound`` requests wait
for it, and waiting requests that would run the same sync (the same source, no
Idempotency-Key of their own) share one run and its answer.

A run, once started, goes on whoever stops waiting for it (a sync must not stop half
way: ``hybridflow.control.weights`` records it or drops it whole). A waiting run whose
every requester has gone (a client that disconnected) is dropped before it starts.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(eq=False)
class _Run(Generic[T]):
    key: Hashable | None
    start: Callable[[], Awaitable[T]]
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    #: Requests waiting for its answer.
    requesters: int = 0
    started: bool = False
    task: asyncio.Task | None = None


class SyncQueue(Generic[T]):
    """Used from the controller's event loop."""

    def __init__(self, bound: int) -> None:
        if bound < 0:
            raise ValueError(f"a sync queue's bound must be 0 or more, got {bound}")
        self.bound = bound
        self._running: _Run[T] | None = None
        self._waiting: deque[_Run[T]] = deque()

    @property
    def waiting(self) -> int:
        """Requests waiting for a run that has not started."""
        return sum(run.requesters for run in self._waiting)

    @property
    def busy(self) -> bool:
        return self._running is not None

    def submit(self, key: Hashable | None, start: Callable[[], Awaitable[T]]) -> Awaitable[T] | None:
        """What to await for the answer of a run of ``start()``: at once when nothing runs,
        else after the runs before it. A request with a ``key`` joins a waiting run of the
        same key (None: never shared). None when ``bound`` requests wait already."""
        if self._running is None and not self._waiting:
            run: _Run[T] = _Run(key, start)
            self._start(run)
        else:
            if self.waiting >= self.bound:
                return None
            run = next((r for r in self._waiting if key is not None and r.key == key), None)
            if run is None:
                run = _Run(key, start)
                self._waiting.append(run)
        run.requesters += 1
        return self._answer(run)

    async def _answer(self, run: _Run[T]) -> T:
        try:
            return await asyncio.shield(run.future)
        except asyncio.CancelledError:
            run.requesters -= 1
            if not run.started and run.requesters == 0 and not run.future.done():
                self._waiting.remove(run)  # nobody waits for it: it never starts
                run.future.cancel()
            raise

    def _start(self, run: _Run[T]) -> None:
        run.started = True
        self._running = run
        run.task = asyncio.ensure_future(run.start())
        run.task.add_done_callback(lambda task: self._finished(run, task))

    def _finished(self, run: _Run[T], task: asyncio.Task) -> None:
        self._running = None
        if task.cancelled():
            run.future.cancel()
        elif task.exception() is not None:
            if run.requesters:
                run.future.set_exception(task.exception())
            else:  # nobody would read it
                logger.error("a weight sync nobody waited for failed", exc_info=task.exception())
                run.future.cancel()
        else:
            run.future.set_result(task.result())
        if self._waiting:
            self._start(self._waiting.popleft())

    def __repr__(self) -> str:
        return f"SyncQueue(bound={self.bound}, busy={self.busy}, waiting={self.waiting})"

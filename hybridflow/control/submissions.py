"""Handing a group's calls to its ranks in journal order, off the event loop when large.

Dispatching a call (splitting its batches) and submitting it (Ray pickles the arguments
of every rank's task) cost time in proportion to the arguments' bytes: a Python object's
are walked, a tensor's or an array's only copied (as the HTTP front counts a body's work,
``hybridflow.wire.loop_work``). A small call is submitted at once on the controller's event
loop; a large one in the group's own thread, so the loop keeps answering (health checks,
other groups, small calls) meanwhile. Order is kept: while a call waits in the thread,
every later call of the group goes there too, behind it, first in first out, so every
rank still receives the calls in the order the journal numbered them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from hybridflow.state.idempotency import estimate_bytes
from hybridflow.wire.loop_work import OFF_LOOP_BYTES, RAW_BYTES_PER_PARSED_BYTE

T = TypeVar("T")


def large(value: Any) -> bool:
    """Whether ``value`` is work of ``OFF_LOOP_BYTES`` or more, to submit, collect or
    journal: its Python objects by their bytes, its tensors and numeric arrays at
    ``1 / RAW_BYTES_PER_PARSED_BYTE`` of theirs (copied, not walked: below that the
    thread's hand-off costs more than the copy). Counting stops at the bound."""
    return estimate_bytes(value, stop_above=OFF_LOOP_BYTES, raw_divisor=RAW_BYTES_PER_PARSED_BYTE) >= OFF_LOOP_BYTES


class Submissions:
    """One group's submissions, used from the controller's event loop."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._thread: ThreadPoolExecutor | None = None
        #: Submissions handed to the thread and not yet done.
        self._queued = 0

    def submit(self, submit: Callable[[], T], off_loop: bool) -> T | asyncio.Future:
        """``submit()``'s answer, called at once when it is small (``off_loop`` False) and
        nothing waits in the thread; else a future of it, handed to the thread now, behind
        every submission handed there before (await it where the caller cannot be
        cancelled: the submission happens whoever waits)."""
        if not off_loop and self._queued == 0:
            return submit()
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"submit-{self._name}")
        self._queued += 1
        future = asyncio.get_running_loop().run_in_executor(self._thread, submit)
        future.add_done_callback(self._done)
        return future

    def _done(self, _future: asyncio.Future) -> None:
        self._queued -= 1

    async def submitted(self, submit: Callable[[], T], off_loop: bool = False) -> T:
        """:meth:`submit`, waited for."""
        answer = self.submit(submit, off_loop)
        return await answer if isinstance(answer, asyncio.Future) else answer

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False)

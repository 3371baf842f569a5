"""A group's fence: while an operation holds it, the controller submits no new call to
the group; calls that arrive wait and then go in order. Calls submitted before it closed
run first on every rank (each rank runs calls in submission order), so the operation
sees none of the calls after it and none of those sees it half done. A weight sync's
commit holds it (``hybridflow.control.weights``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class Fence:
    """Used from the controller's event loop."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._holder = asyncio.Lock()

    @property
    def closed(self) -> bool:
        return not self._open.is_set()

    async def passed(self) -> None:
        """Return once the fence is open; at once (without giving up the loop) when it is."""
        while not self._open.is_set():
            await self._open.wait()

    @asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """Close the fence for the block (one holder at a time); it opens however the block ends."""
        async with self._holder:
            self._open.clear()
            try:
                yield
            finally:
                self._open.set()

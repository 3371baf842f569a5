"""A state store for an event loop: every call of the (blocking) store runs in threads of
its own, so the loop never waits on a disk, a lock or a network.

A SQLite write may wait up to its busy timeout for another process's transaction (the
controllers of an application share one file), and a Redis call for its socket timeout;
on the loop, that wait would hold up every call, health check and HTTP request the loop
serves (in the embedded layout, every controller shares the ingress's loop). The threads
are the store's own, not the loop's default executor, so a store that stalls cannot take
the threads that request decoding and other work use.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from hybridflow.state.store import StateStore

T = TypeVar("T")

#: Threads per store: the SQLite backend runs one statement at a time on its connection
#: anyway; a few let reads of a large snapshot and Redis calls overlap.
STORE_THREADS = 4


class AsyncStore:
    """A :class:`StateStore`, opened and called off the event loop. Built from a store, or
    from a function that opens one (then :meth:`open` must be awaited before use)."""

    def __init__(self, store: StateStore | Callable[[], StateStore], threads: int = STORE_THREADS) -> None:
        self._opener = None if isinstance(store, StateStore) else store
        self._store = store if isinstance(store, StateStore) else None
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="state-store")

    async def open(self) -> StateStore:
        """Open the store (in a thread) unless it is open."""
        if self._store is None:
            assert self._opener is not None
            self._store = await self.run(self._opener)
        return self._store

    @property
    def store(self) -> StateStore:
        if self._store is None:
            raise RuntimeError("the state store is not open yet: await AsyncStore.open() first")
        return self._store

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in one of the store's threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The store's ``method`` with these arguments, in one of its threads."""
        return await self.run(getattr(self.store, method), *args, **kwargs)

    def close(self) -> None:
        """Close the store (a call still running finishes first: the backends lock their connection)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._store is not None:
            self._store.close()

"""Idempotency-Key: a repeated request gets the first request's answer, once.

A key's first request runs; a repeat that arrives while it runs waits for it and gets
the same answer; a repeat after it gets the kept answer. The same key with a different
body (another fingerprint) is refused, as payment APIs do. Answers that say "try again"
(the group was unavailable, the call timed out) are not kept, so a retry runs anew.
Kept answers are bounded by count and by bytes, oldest dropped first; nothing is kept
per key once its request finished and its answer was not.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

T = TypeVar("T")

#: Bytes counted for any object that is not a tensor, array, string or container.
OBJECT_BYTES = 64


def estimate_bytes(value: Any, _depth: int = 0) -> int:
    """Roughly how much memory a value holds: tensors and arrays by their bytes,
    strings by length, containers by their items (walked to a bounded depth)."""
    if _depth > 64:
        return OBJECT_BYTES
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int) and not isinstance(value, np.generic):
        return nbytes + OBJECT_BYTES
    if isinstance(value, (str, bytes, bytearray)):
        return len(value) + OBJECT_BYTES
    if isinstance(value, Mapping):
        return OBJECT_BYTES + sum(estimate_bytes(k, _depth + 1) + estimate_bytes(v, _depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return OBJECT_BYTES + sum(estimate_bytes(v, _depth + 1) for v in value)
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return OBJECT_BYTES + estimate_bytes(vars(value), _depth + 1)
    return OBJECT_BYTES


class IdempotencyConflict(Exception):
    """The key was used before with a different request body."""


@dataclass
class _Kept(Generic[T]):
    fingerprint: str | None
    answer: T
    size: int


class IdempotencyCache(Generic[T]):
    def __init__(self, max_entries: int = 10_000, max_bytes: int = 256 << 20) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._kept: OrderedDict[Hashable, _Kept[T]] = OrderedDict()
        self._kept_bytes = 0
        self._running: dict[Hashable, tuple[str | None, asyncio.Future[T]]] = {}

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def kept_bytes(self) -> int:
        return self._kept_bytes

    @property
    def running(self) -> int:
        return len(self._running)

    def lookup(self, key: Hashable, fingerprint: str | None) -> T | None:
        """The kept answer for ``key`` (IdempotencyConflict when the body differs)."""
        kept = self._kept.get(key)
        if kept is None:
            return None
        _check(key, kept.fingerprint, fingerprint)
        self._kept.move_to_end(key)
        return kept.answer

    async def run(
        self,
        key: Hashable,
        fingerprint: str | None,
        compute: Callable[[], Awaitable[T]],
        keep: Callable[[T], bool] = lambda _answer: True,
    ) -> T:
        """The answer for ``key``: kept, shared with a request still running, or computed
        now by ``compute`` (and kept when ``keep(answer)``). The computation runs as a
        task of its own, so a caller that goes away does not cancel it for the others."""
        kept = self.lookup(key, fingerprint)
        if kept is not None:
            return kept
        running = self._running.get(key)
        if running is not None:
            _check(key, running[0], fingerprint)
            return await asyncio.shield(running[1])
        task = asyncio.ensure_future(compute())
        self._running[key] = (fingerprint, task)

        def finished(done: asyncio.Future[T]) -> None:
            self._running.pop(key, None)
            if not done.cancelled() and done.exception() is None and keep(done.result()):
                self.store(key, fingerprint, done.result())

        task.add_done_callback(finished)
        return await asyncio.shield(task)

    def forget(self, which: Callable[[Hashable], bool]) -> int:
        """Drop the kept answers whose key ``which`` picks (e.g. a group's, when its state is
        discarded); returns how many went."""
        dropped = [key for key in self._kept if which(key)]
        for key in dropped:
            self._kept_bytes -= self._kept.pop(key).size
        return len(dropped)

    def store(self, key: Hashable, fingerprint: str | None, answer: T, size: int | None = None) -> None:
        """Keep an answer, dropping the oldest ones past the bounds (an answer larger
        than the byte bound is not kept at all)."""
        size = estimate_bytes(answer) if size is None else size
        old = self._kept.pop(key, None)
        if old is not None:
            self._kept_bytes -= old.size
        if self.max_entries <= 0 or size > self.max_bytes:
            return
        self._kept[key] = _Kept(fingerprint, answer, size)
        self._kept_bytes += size
        while len(self._kept) > self.max_entries or self._kept_bytes > self.max_bytes:
            _, dropped = self._kept.popitem(last=False)
            self._kept_bytes -= dropped.size


def _check(key: Hashable, first: str | None, now: str | None) -> None:
    if first is not None and now is not None and first != now:
        raise IdempotencyConflict(
            f"Idempotency-Key {key[-1] if isinstance(key, tuple) else key!r} was used with a different request body"
        )

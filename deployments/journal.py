"""The journal of a group's acknowledged mutating calls, replayed on fresh workers.

A mutating call is entered when it is submitted (its sequence number is its place in
the order every rank runs calls) and then either acknowledged, when every rank applied
it, or aborted. Only acknowledged entries are replayed, in sequence order, and each
replay gets copies of the arguments, so a dispatch function that changes its arguments
(the tutorial's custom dispatch appends to its lists) never changes the journal.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Entry:
    seq: int
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def call(self) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        """The call to replay, with arguments of its own."""
        return self.method, copy.deepcopy(self.args), copy.deepcopy(self.kwargs)


class Journal:
    """In submission order: entries in flight, and the acknowledged ones to replay.
    Used from one event loop (the controller's); it does no I/O itself."""

    def __init__(self, first_seq: int = 0) -> None:
        self._next_seq = first_seq
        self._acknowledged: dict[int, Entry] = {}
        self._inflight: set[int] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        #: (seq, future) of callers waiting until no call numbered <= seq is in flight.
        self._waiters: list[tuple[int, asyncio.Future]] = []

    def begin(self, method: str, args: tuple | list, kwargs: dict[str, Any]) -> Entry:
        """Enter a call about to be submitted (a copy of its arguments, taken before any
        dispatch function sees them)."""
        entry = Entry(self._next_seq, method, copy.deepcopy(tuple(args)), copy.deepcopy(dict(kwargs)))
        self._next_seq += 1
        self._inflight.add(entry.seq)
        self._idle.clear()
        return entry

    def acknowledge(self, entry: Entry) -> None:
        """Every rank applied the call: it is replayed on every rebuild from now on."""
        self._acknowledged[entry.seq] = entry
        self._settle(entry)

    def abort(self, entry: Entry) -> None:
        """The call was not applied everywhere: it is never replayed."""
        self._settle(entry)

    def _settle(self, entry: Entry) -> None:
        self._inflight.discard(entry.seq)
        if not self._inflight:
            self._idle.set()
        if self._waiters:
            lowest = self.lowest_inflight()
            waiting = []
            for seq, future in self._waiters:
                if lowest is not None and lowest <= seq:
                    waiting.append((seq, future))
                elif not future.done():
                    future.set_result(None)
            self._waiters = waiting

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def lowest_inflight(self) -> int | None:
        return min(self._inflight) if self._inflight else None

    async def settled(self, timeout_s: float | None = None) -> bool:
        """Wait until no call is in flight; False when ``timeout_s`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def settled_through(self, seq: int, timeout_s: float | None = None) -> bool:
        """Wait until no call numbered ``<= seq`` is in flight (later ones may be); False
        when ``timeout_s`` passed first."""
        lowest = self.lowest_inflight()
        if lowest is None or lowest > seq:
            return True
        future = asyncio.get_running_loop().create_future()
        self._waiters.append((seq, future))
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout_s)
            return True
        except TimeoutError:
            return False

    def reload(self, entries: list[Entry], next_seq: int) -> None:
        """Replace the acknowledged entries with ``entries`` (what a store holds after its
        snapshot) and number later calls from ``next_seq`` on, or further on: numbers
        never go back, so a call is never given the number of one already stored."""
        self._acknowledged.clear()
        self.restore(entries)
        self._next_seq = max(self._next_seq, next_seq)

    def restore(self, entries: list[Entry]) -> None:
        """Acknowledged entries loaded from a store (a restarted controller)."""
        for entry in entries:
            self._acknowledged[entry.seq] = entry
            self._next_seq = max(self._next_seq, entry.seq + 1)

    def truncate(self, through_seq: int) -> int:
        """Forget acknowledged entries up to ``through_seq`` (a snapshot holds their
        effect); returns how many were dropped."""
        old = [seq for seq in self._acknowledged if seq <= through_seq]
        for seq in old:
            del self._acknowledged[seq]
        return len(old)

    def entries(self) -> list[Entry]:
        """Acknowledged entries in submission order."""
        return [self._acknowledged[seq] for seq in sorted(self._acknowledged)]

    def replay(self) -> Iterator[tuple[str, tuple[Any, ...], dict[str, Any]]]:
        """The calls to replay, in order, each with arguments of its own."""
        for entry in self.entries():
            yield entry.call()

    def __len__(self) -> int:
        return len(self._acknowledged)

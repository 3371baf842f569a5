"""The order of a group's mutating calls: sequence numbers, the calls in flight, and how
many acknowledged calls a rebuild would replay.

A mutating call is entered when it is submitted (its sequence number is its place in
the order every rank runs calls) and then either acknowledged, when every rank applied
it, or aborted. The journal keeps no arguments: the state store encodes each call before
it is submitted (so a dispatch function that changes its arguments never changes what is
replayed), and a rebuild replays the calls it reads back from the store
(``hybridflow.control.durability``), each decoded into objects of its own.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    """A call's place in the order."""

    seq: int
    method: str


class Journal:
    """In submission order: the calls in flight and the numbers of the acknowledged ones
    since the last snapshot. Used from one event loop (the controller's); no I/O."""

    def __init__(self, first_seq: int = 0) -> None:
        self._next_seq = first_seq
        self._acknowledged: set[int] = set()
        self._inflight: set[int] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        #: (seq, future) of callers waiting until no call numbered <= seq is in flight.
        self._waiters: list[tuple[int, asyncio.Future]] = []

    def begin(self, method: str) -> Entry:
        """Enter a call about to be submitted."""
        entry = Entry(self._next_seq, method)
        self._next_seq += 1
        self._inflight.add(entry.seq)
        self._idle.clear()
        return entry

    def acknowledge(self, entry: Entry) -> None:
        """Every rank applied the call: it counts as replayed by every rebuild from now on."""
        self._acknowledged.add(entry.seq)
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

    def reload(self, acknowledged: list[int], next_seq: int) -> None:
        """Take the acknowledged calls a store holds after its snapshot (their numbers) and
        number later calls from ``next_seq`` on, or further on: numbers never go back, so a
        call is never given the number of one already stored."""
        self._acknowledged = set(acknowledged)
        self._next_seq = max(self._next_seq, next_seq, *(seq + 1 for seq in acknowledged))

    def truncate(self, through_seq: int) -> int:
        """Forget acknowledged calls up to ``through_seq`` (a snapshot holds their effect);
        returns how many were dropped."""
        old = {seq for seq in self._acknowledged if seq <= through_seq}
        self._acknowledged -= old
        return len(old)

    def acknowledged(self) -> list[int]:
        """The numbers of the acknowledged calls a rebuild would replay, in order."""
        return sorted(self._acknowledged)

    def __len__(self) -> int:
        return len(self._acknowledged)

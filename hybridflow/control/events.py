"""What happened to the groups, as events a driver can follow (``GET /v1/events``).

One :class:`EventBus` per controllers' process (the ingress replica in the default layout,
each controller replica otherwise) numbers its events from 1 and keeps the last
``limits.events_kept`` of them in a ring, so that a client that lost its connection
resumes after the last id it saw. The supervisor, the snapshots, the weight syncs and
the jobs deployment publish; every event is in the service's memory only, and a restart
of the process that holds the bus starts it again from 1.

A :class:`Subscription` is one reader: the kept events after the id it resumes from
(an ``events_lost`` event first when some of those are no longer kept), then every new
one. Its queue of events not yet read is bounded: a reader that falls that far behind is
dropped, never waited for, and its stream ends with an ``events_lost`` event, after which
it may resume from the last id it got.

Everything runs on the process's event loop (no locks).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

#: The kinds of events, and the fields each carries besides ``group`` and ``at``.
KINDS: dict[str, tuple[str, ...]] = {
    "group_status": ("status", "previous"),
    "rank_lost": ("rank", "node", "reason"),
    "rank_replaced": ("rank", "seconds"),
    "group_rebuilt": ("seconds", "replayed_calls"),
    "group_halted": ("reason",),
    "snapshot_failed": ("reason",),
    "weights_synced": ("source", "version"),
    "job": ("job_id", "status"),
}
#: Events a reader did not get: ``dropped`` of them (None when it cannot be told).
EVENTS_LOST = "events_lost"
#: Events one reader may have waiting before it is dropped.
SUBSCRIBER_QUEUE = 1000


@dataclass(frozen=True)
class Event:
    """One event: ``id`` increases from 1 in its bus (None for a reader's own
    ``events_lost`` when it was dropped: it takes no place in the sequence)."""

    id: int | str | None
    kind: str
    group: str | None
    at: float
    fields: dict[str, Any] = field(default_factory=dict)

    def data(self) -> dict[str, Any]:
        """The event's JSON ``data``: ``group``, ``at`` and its kind's fields."""
        return {"group": self.group, "at": self.at, **self.fields}


@dataclass
class EventStream:
    """What a backend answers for ``GET /v1/events``: the events, and the id they start
    after (a client that resumes from it misses none), sent to the client first."""

    after: int | str
    events: AsyncIterator[Event]


def parse_since(text: str | None) -> int | None:
    """A ``Last-Event-ID`` as this bus numbers events: None for none, else a number of 0
    or more (ValueError otherwise)."""
    if text is None or not text.strip():
        return None
    value = text.strip()
    if not value.isdigit() or len(value) > 18:
        raise ValueError(f"Last-Event-ID {text[:40]!r} is not an event id of this service (a number of 0 or more)")
    return int(value)


class EventBus:
    """The ring of the last ``kept`` events and the readers following them."""

    def __init__(self, kept: int = 10_000, queue_size: int = SUBSCRIBER_QUEUE,
                 clock: Callable[[], float] = time.time) -> None:
        if kept < 1 or queue_size < 1:
            raise ValueError(f"kept and queue_size must be at least 1, got {kept} and {queue_size}")
        self.queue_size = queue_size
        self.clock = clock
        self._ring: deque[Event] = deque(maxlen=kept)
        self._next = 1
        self._readers: set[Subscription] = set()

    @property
    def last_id(self) -> int:
        """The id of the latest event (0: none yet)."""
        return self._next - 1

    @property
    def readers(self) -> int:
        return len(self._readers)

    def publish(self, kind: str, group: str | None, **fields: Any) -> Event:
        """Number, keep and hand out one event (never waits for a reader)."""
        event = Event(self._next, kind, group, round(self.clock(), 3), fields)
        self._next += 1
        self._ring.append(event)
        for reader in list(self._readers):
            reader.offer(event)
        return event

    def subscribe(self, since: int | None = None, group: str | None = None) -> Subscription:
        """A reader of the events after id ``since`` (None: only new ones) of ``group``
        (None: every group's)."""
        backlog: list[Event] = []
        if since is not None:
            first = self._ring[0].id if self._ring else self._next
            if since > self.last_id:  # an id this bus never gave: it started again since
                backlog.append(Event(first - 1, EVENTS_LOST, None, round(self.clock(), 3), {"dropped": None}))
                since = first - 1
            elif since < first - 1:
                backlog.append(Event(first - 1, EVENTS_LOST, None, round(self.clock(), 3),
                                     {"dropped": first - 1 - since}))
            backlog += [e for e in self._ring if e.id > since and (group is None or e.group == group)]
        reader = Subscription(self, group, backlog)
        self._readers.add(reader)
        return reader

    def _leave(self, reader: Subscription) -> None:
        self._readers.discard(reader)


class Subscription:
    """One reader of a bus: ``async for event in subscription`` until it is closed or
    dropped (its last event then is an ``events_lost`` without an id)."""

    def __init__(self, bus: EventBus, group: str | None, backlog: list[Event]) -> None:
        self.bus = bus
        self.group = group
        self._events: deque[Event] = deque(backlog)
        self._backlog = len(backlog)
        self._wakeup: asyncio.Event | None = None
        self._last_given = 0
        #: The id of the last event it was given when it was dropped (None: not dropped).
        self.dropped_after: int | None = None
        self.closed = False

    def offer(self, event: Event) -> None:
        if self.group is not None and event.group != self.group:
            return
        if len(self._events) - self._backlog >= self.bus.queue_size:
            # too far behind: dropped, never waited for
            self.dropped_after = self._events[-1].id if self._events else self._last_given
            self.bus._leave(self)
        else:
            self._events.append(event)
        self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def close(self) -> None:
        self.closed = True
        self.bus._leave(self)
        self._wake()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        while True:
            if self._events:
                event = self._events.popleft()
                if self._backlog:
                    self._backlog -= 1
                if isinstance(event.id, int):
                    self._last_given = event.id
                return event
            if self.dropped_after is not None and not self.closed:
                self.closed = True
                dropped = self.bus.last_id - self.dropped_after
                return Event(None, EVENTS_LOST, None, round(self.bus.clock(), 3),
                             {"dropped": dropped, "reason": "the reader fell behind; resume with Last-Event-ID"})
            if self.closed:
                raise StopAsyncIteration
            self._wakeup = asyncio.Event()
            await self._wakeup.wait()
            self._wakeup = None

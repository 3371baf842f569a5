"""A backend with the controllers' own event code (``Controllers.events`` over a real
``EventBus``) and nothing else, for the event stream's route, client and CLI tests, served
by uvicorn in a thread (``tests.unit.served_app``). The bus lives on the server's loop:
the test thread publishes through :meth:`EventsBackend.publish`."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

from hybridflow.control.controllers import Controllers
from hybridflow.control.events import Event, EventBus, EventStream
from hybridflow.http.app import create_app
from hybridflow.http.settings import IngressSettings

TOKEN = "s3cret"
GROUPS = ("counter", "other")


class EventsBackend:
    events_call = Controllers.events
    stream_events = Controllers.stream_events

    def __init__(self, bus: EventBus) -> None:
        self.events_bus = bus
        self.group_owner = dict.fromkeys(GROUPS)
        self.loop: asyncio.AbstractEventLoop | None = None
        #: Last-Event-ID (or since) of each request, in order.
        self.asked: list[str | None] = []
        #: End each stream after this many events (the server cutting it), when set.
        self.cut_after: int | None = None
        self.connected = threading.Event()

    async def events(self, since: str | None, group: str | None) -> EventStream | Any:
        self.loop = asyncio.get_running_loop()
        self.asked.append(since)
        answer = await self.events_call(since, group)
        if isinstance(answer, EventStream) and self.cut_after is not None:
            answer = EventStream(answer.after, _first(answer.events, self.cut_after))
        self.connected.set()
        return answer

    def publish(self, *events: tuple[str, str | None, dict[str, Any]]) -> None:
        """Publish on the server's loop (directly while no request has come)."""
        def publish_all() -> None:
            for kind, group, fields in events:
                self.events_bus.publish(kind, group, **fields)

        if self.loop is None:
            publish_all()
            return
        done = threading.Event()
        self.loop.call_soon_threadsafe(lambda: (publish_all(), done.set()))
        assert done.wait(30), "the server's loop did not publish"

    def readers(self) -> int:
        return self.events_bus.readers


async def _first(events: AsyncIterator[Event], count: int) -> AsyncIterator[Event]:
    given = 0
    async for event in events:
        yield event
        given += 1
        if given >= count:
            return


def app_with(backend: EventsBackend) -> Any:
    return create_app(backend, IngressSettings(auth_token=TOKEN, groups=dict.fromkeys(GROUPS, "d")))

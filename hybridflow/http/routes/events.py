"""``GET /v1/events``: what happens to the groups, as Server-Sent Events
(``text/event-stream``), behind the token like every route.

Each event is ``id:`` (increasing), ``event:`` (its kind) and one ``data:`` line of JSON
(``group``, ``at``, and its kind's fields: ``hybridflow.control.events.KINDS``). A client
that reconnects sends the last id it got as ``Last-Event-ID`` and gets what it missed
from the kept events; ``?group=NAME`` keeps one group's. An idle stream carries a comment
line every :data:`HEARTBEAT_S` seconds, so proxies and clients see it is alive.

The stream never holds the service up: the events go through a short queue here and a
bounded one in the controllers, and a client that reads too slowly is dropped, its stream
ending with an ``events_lost`` event.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from hybridflow.control.contract import ControllerError, ErrorKind
from hybridflow.control.events import Event, EventStream
from hybridflow.http.auth import require_token
from hybridflow.http.errors import ApiError
from hybridflow.http.routes.common import backend, errors, settings

#: Seconds between keep-alive comments on an idle stream.
HEARTBEAT_S = 15.0
#: Events between the backend's stream and the client's connection.
WRITE_QUEUE = 16
MEDIA_TYPE = "text/event-stream"

router = APIRouter(tags=["events"], dependencies=[Depends(require_token)])


def event_text(event: Event) -> str:
    """One event as the stream carries it."""
    lines = [] if event.id is None else [f"id: {event.id}"]
    lines += [f"event: {event.kind}", "data: " + json.dumps(event.data(), separators=(",", ":"), default=str)]
    return "\n".join(lines) + "\n\n"


async def sse(stream: EventStream, heartbeat_s: float = HEARTBEAT_S) -> AsyncIterator[str]:
    """The stream's text: the id it starts after (an ``id:`` line without data, which sets
    a client's ``Last-Event-ID`` and is no event), then every event, with a comment
    whenever ``heartbeat_s`` pass without one."""
    events = stream.events
    queue: asyncio.Queue[Event | None] = asyncio.Queue(WRITE_QUEUE)
    failed: list[BaseException] = []

    async def pump() -> None:
        try:
            async for event in events:
                await queue.put(event)  # a slow client holds this; the controllers' bound drops it
        except Exception as exc:
            failed.append(exc)
        await queue.put(None)

    # Cancelled with the response (the client went away): the backend's stream closes
    # its subscription as the cancellation passes through it.
    task = asyncio.create_task(pump())
    try:
        yield f": events of hybridflow\nid: {stream.after}\n\n"
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), heartbeat_s)
            except TimeoutError:
                yield ": keep-alive\n\n"
                continue
            if event is None:
                if failed:
                    raise failed[0]
                return
            yield event_text(event)
    finally:
        task.cancel()


@router.get(
    "/v1/events",
    response_class=StreamingResponse,
    responses={200: {"content": {MEDIA_TYPE: {}}, "description": "the events, as they happen"},
               **errors(400, 401, 404)},
)
async def events(request: Request, group: str | None = None, since: str | None = None) -> Any:
    """Server-Sent Events of every group, or of ``group``: ``group_status``,
    ``rank_lost``, ``rank_replaced``, ``group_rebuilt``, ``group_halted``,
    ``snapshot_failed``, ``weights_synced``, ``job``, and ``events_lost`` when some were
    not delivered. ``Last-Event-ID`` resumes after that event; ``since`` does the same for
    a client that cannot send the header (a browser's first connection; ``0``: every
    event kept), and the header wins."""
    if group is not None and settings(request).deployment_of(group) is None:
        raise ApiError(404, f"unknown group {group!r}; groups: {', '.join(sorted(settings(request).groups))}")
    answer = await backend(request).events(request.headers.get("last-event-id") or since, group)
    if isinstance(answer, ControllerError):
        if answer.kind is ErrorKind.BAD_ARGUMENTS:
            raise ApiError(400, answer.message)
        raise ApiError.of(answer)
    return StreamingResponse(sse(answer), media_type=MEDIA_TYPE,
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

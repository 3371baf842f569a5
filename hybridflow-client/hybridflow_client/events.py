"""The service's event stream (``GET /v1/events``, Server-Sent Events), without I/O: the
request, the parser of its lines, and when to reconnect. The clients
(:mod:`hybridflow_client.python_client`) read the stream and resume it with
``Last-Event-ID`` after a cut, so a caller sees one stream of events however often the
connection drops (a proxy's timeout, a restart of the ingress replica)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx

from hybridflow_client.messages import Request, ServiceError

__all__ = ["RECONNECT_S", "Event", "EventParser", "events_request", "reconnects"]

#: Seconds before reconnecting a stream that was cut (the server's ``retry:`` overrides it).
RECONNECT_S = 1.0
#: Longest event the parser keeps (one ``data:`` JSON document); longer ones are dropped.
MAX_EVENT_CHARS = 1 << 20


@dataclass
class Event:
    """One event: ``id`` (what a resume starts after; None for one that has none, such
    as a dropped reader's ``events_lost``), ``kind`` (``group_status``, ``rank_lost``,
    ...), and ``data``, its JSON: ``group``, ``at`` and the kind's fields."""

    id: str | None
    kind: str
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def group(self) -> str | None:
        return self.data.get("group")

    @property
    def at(self) -> float | None:
        return self.data.get("at")

    def __getitem__(self, key: str) -> Any:
        return self.data[key]


def events_request(group: str | None, last_id: str | None) -> Request:
    """``GET /v1/events`` (``?group=``), resuming after ``last_id`` when given."""
    headers = {"Accept": "text/event-stream"}
    if last_id is not None:
        headers["Last-Event-ID"] = last_id
    return Request("GET", "/v1/events" + (f"?group={quote(group, safe='')}" if group else ""), headers=headers)


def reconnects(error: BaseException) -> float | None:
    """Seconds to wait before reconnecting after ``error`` ended a stream, or None when
    reconnecting cannot help (a refused token, an unknown group or id: raised)."""
    if isinstance(error, ServiceError):
        return (error.retry_after or RECONNECT_S) if error.status_code in (502, 503, 504) else None
    return RECONNECT_S if isinstance(error, httpx.TransportError) else None


class EventParser:
    """Lines of a ``text/event-stream`` in, events out (the WHATWG rules that matter here:
    ``id``, ``event``, ``data`` and ``retry`` fields, comment lines, a blank line ends
    an event). ``last_id`` is where a resume starts; ``retry_s`` the server's advice."""

    def __init__(self, last_id: str | None = None) -> None:
        self.last_id = last_id
        self.retry_s: float | None = None
        self._kind = ""
        self._data: list[str] = []
        self._size = 0
        self._id: str | None = None

    def feed(self, line: str) -> Iterator[Event]:
        """One line (without its line break); yields the event it completes, if any."""
        if line == "":
            yield from self._dispatch()
            return
        if line.startswith(":"):
            return  # a comment: keep-alive
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            self._size += len(value)
            self._data.append(value)
        elif name == "event":
            self._kind = value
        elif name == "id" and "\0" not in value:
            self._id = value
        elif name == "retry" and value.isdigit():
            self.retry_s = int(value) / 1000

    def _dispatch(self) -> Iterator[Event]:
        kind, data, size, given = self._kind or "message", self._data, self._size, self._id
        self._kind, self._data, self._size, self._id = "", [], 0, None
        if given is not None:
            self.last_id = given
        if not data or size > MAX_EVENT_CHARS:
            return
        try:
            parsed = json.loads("\n".join(data))
        except ValueError:
            parsed = {"text": "\n".join(data)}
        yield Event(given, kind, parsed if isinstance(parsed, dict) else {"value": parsed})

"""The event bus (``hybridflow.control.events``) and ``GET /v1/events`` on the service's real
app over the controllers' own event code, served by uvicorn: ids from 1, resuming with
``Last-Event-ID``, ``events_lost`` when a resume starts before the kept events, the group
filter, the token, and a reader too slow to keep up dropped while the service answers."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from hybridflow.control.events import EVENTS_LOST, EventBus
from hybridflow.http.routes.events import event_text
from tests.unit.event_backend import TOKEN, EventsBackend, app_with
from tests.unit.served_app import served

AUTH = {"Authorization": f"Bearer {TOKEN}"}


# -- the bus ------------------------------------------------------------------------------


def test_events_are_numbered_from_one_and_carry_group_time_and_fields():
    bus = EventBus(kept=10, clock=lambda: 1234.5)
    first = bus.publish("rank_lost", "g", rank=1, node="10.0.0.2", reason="ActorDiedError")
    second = bus.publish("group_status", "g", status="replacing", previous="ready")
    assert (first.id, second.id, bus.last_id) == (1, 2, 2)
    assert first.data() == {"group": "g", "at": 1234.5, "rank": 1, "node": "10.0.0.2", "reason": "ActorDiedError"}
    assert event_text(first) == ('id: 1\nevent: rank_lost\ndata: {"group":"g","at":1234.5,"rank":1,'
                                 '"node":"10.0.0.2","reason":"ActorDiedError"}\n\n')


async def _take(subscription, count: int) -> list:
    return [await asyncio.wait_for(subscription.__anext__(), 5) for _ in range(count)]


def test_a_reader_resumes_after_an_id_and_a_filter_keeps_one_groups_events():
    async def scenario():
        bus = EventBus(kept=100)
        for index in range(6):
            bus.publish("job", "a" if index % 2 == 0 else "b", job_id=str(index), status="queued")
        resumed = bus.subscribe(since=3)
        assert [e.id for e in await _take(resumed, 3)] == [4, 5, 6]
        only_a = bus.subscribe(since=0, group="a")
        assert [e.fields["job_id"] for e in await _take(only_a, 3)] == ["0", "2", "4"]
        live = bus.subscribe()
        bus.publish("job", "b", job_id="6", status="running")
        bus.publish("job", "a", job_id="7", status="running")
        assert [e.id for e in await _take(live, 2)] == [7, 8]
        assert [e.id for e in await _take(only_a, 1)] == [8]
        for reader in (resumed, only_a, live):
            reader.close()
        assert bus.readers == 0

    asyncio.run(scenario())


def test_a_resume_from_before_the_kept_events_starts_with_events_lost():
    async def scenario():
        bus = EventBus(kept=4)
        for index in range(10):
            bus.publish("job", "g", job_id=str(index), status="queued")
        reader = bus.subscribe(since=2)
        lost, *kept = await _take(reader, 5)
        # ids 3..6 are no longer kept: 4 dropped; the event's id lets a resume go on after them
        assert (lost.kind, lost.id, lost.fields["dropped"]) == (EVENTS_LOST, 6, 4)
        assert [e.id for e in kept] == [7, 8, 9, 10]
        gone = bus.subscribe(since=50)  # an id this bus never gave: it started again since
        lost, *kept = await _take(gone, 5)
        assert (lost.kind, lost.fields["dropped"]) == (EVENTS_LOST, None)
        assert [e.id for e in kept] == [7, 8, 9, 10]

    asyncio.run(scenario())


def test_a_slow_reader_is_dropped_never_waited_for():
    async def scenario():
        bus = EventBus(kept=1000, queue_size=5)
        slow, keeping_up = bus.subscribe(), bus.subscribe()
        got = []
        for index in range(20):
            bus.publish("job", "g", job_id=str(index), status="queued")
            got += await _take(keeping_up, 1)
        assert [e.id for e in got] == list(range(1, 21))
        assert bus.readers == 1  # the slow one left at its sixth unread event
        events = await _take(slow, 6)
        assert [e.id for e in events[:5]] == [1, 2, 3, 4, 5]
        assert events[5].kind == EVENTS_LOST and events[5].id is None and events[5].fields["dropped"] == 15
        with pytest.raises(StopAsyncIteration):
            await slow.__anext__()
        resumed = bus.subscribe(since=5)  # where it resumes: nothing kept is missed
        assert [e.id for e in await _take(resumed, 15)] == list(range(6, 21))

    asyncio.run(scenario())


# -- the route ----------------------------------------------------------------------------


@pytest.fixture()
def backend():
    return EventsBackend(EventBus(kept=5))


@pytest.fixture()
def url(backend):
    with served(app_with(backend)) as base:
        yield base


def read_events(lines, count: int) -> list[tuple[str | None, str, dict]]:
    """The next ``count`` events of a streamed response's lines (or the response): (id, kind, data)."""
    found, block = [], {}
    for line in (lines.iter_lines() if isinstance(lines, httpx.Response) else lines):
        if line == "":
            if "event" in block:
                found.append((block.get("id"), block["event"], json.loads(block["data"])))
                if len(found) == count:
                    return found
            block = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(": ")
            block[name] = value
    return found


def test_the_stream_needs_the_token_a_served_group_and_an_id_it_gave(url, backend):
    with httpx.Client(base_url=url, timeout=10) as client:
        assert client.get("/v1/events").status_code == 401
        unknown = client.get("/v1/events", params={"group": "nope"}, headers=AUTH)
        assert unknown.status_code == 404 and "unknown group 'nope'" in unknown.json()["error"]
        bad = client.get("/v1/events", headers={**AUTH, "Last-Event-ID": "x1"})
        assert bad.status_code == 400 and "Last-Event-ID 'x1' is not an event id" in bad.json()["error"]
    assert backend.readers() == 0


def test_events_stream_as_they_happen_resume_and_filter(url, backend):
    backend.publish(("job", "counter", {"job_id": "j0", "status": "queued"}))
    with httpx.Client(base_url=url, timeout=10, headers=AUTH) as client:
        with client.stream("GET", "/v1/events") as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = response.iter_lines()
            assert next(lines) == ": events of hybridflow"
            assert next(lines) == "id: 1"  # where this stream starts: after the event before it
            backend.publish(("rank_lost", "counter", {"rank": 1, "node": "n1", "reason": "ActorDiedError"}),
                            ("group_status", "other", {"status": "ready", "previous": "starting"}))
            got = read_events(lines, 2)
        assert got[0] == ("2", "rank_lost", {"group": "counter", "at": got[0][2]["at"], "rank": 1, "node": "n1",
                                             "reason": "ActorDiedError"})
        assert got[1][:2] == ("3", "group_status") and abs(got[1][2]["at"] - time.time()) < 60
        with client.stream("GET", "/v1/events", headers={"Last-Event-ID": "2"}) as response:
            assert read_events(response, 1)[0][:2] == ("3", "group_status")
        with client.stream("GET", "/v1/events", params={"group": "counter", "since": "0"}) as response:
            assert [e[0] for e in read_events(response, 2)] == ["1", "2"]
        backend.publish(*[("job", "other", {"job_id": f"j{i}", "status": "running"}) for i in range(4)])
        with client.stream("GET", "/v1/events", headers={"Last-Event-ID": "1"}) as response:
            lost, first = read_events(response, 2)  # 7 events, 5 kept (3 to 7): id 2 is gone
        assert lost == ("2", EVENTS_LOST, {"group": None, "at": lost[2]["at"], "dropped": 1})
        assert first[0] == "3"
    deadline = time.monotonic() + 10
    while backend.readers() and time.monotonic() < deadline:  # each closed stream lets go of its reader
        time.sleep(0.05)
    assert backend.readers() == 0


def test_a_reader_that_does_not_read_is_dropped_while_the_service_answers(url, backend):
    backend.events_bus.queue_size = 50
    reason = "r" * 65536  # large events fill the sockets' buffers (tens of MB on Linux) in a few rounds
    with httpx.Client(base_url=url, timeout=30, headers=AUTH) as client:
        with client.stream("GET", "/v1/events") as response:
            assert backend.connected.wait(10)
            lines = response.iter_lines()
            assert next(lines) == ": events of hybridflow"
            deadline = time.monotonic() + 180
            while not backend.readers():  # the stream subscribes as it begins to send
                assert time.monotonic() < deadline, "the stream never subscribed"
                time.sleep(0.01)
            published = 0
            while backend.readers() and time.monotonic() < deadline:
                backend.publish(*[("snapshot_failed", "counter", {"reason": reason})] * 50)
                published += 50
                assert client.get("/healthz").status_code == 200  # the service keeps answering
            assert backend.readers() == 0, f"still following after {published} events"
            kinds = []
            for line in lines:  # what was written before it was dropped, then the end
                if line.startswith("event: "):
                    kinds.append(line[7:])
        assert kinds[-1] == EVENTS_LOST and set(kinds[:-1]) == {"snapshot_failed"}
        assert len(kinds) - 1 < published

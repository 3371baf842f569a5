"""``client.events()`` (blocking and async) and ``hybridflow events`` against the service's
real app over the controllers' own event code, served by uvicorn: events arrive as they
are published, a stream the server cuts is resumed with ``Last-Event-ID`` so none is
missed or repeated, a refused token raises, and the CLI prints them."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from hybridflow.control.events import EventBus
from hybridflow_client import cli
from hybridflow_client.events import EventParser
from hybridflow_client.python_client import AsyncSingleControllerClient, ServiceError, SingleControllerClient
from tests.unit.event_backend import TOKEN, EventsBackend, app_with
from tests.unit.served_app import served


@pytest.fixture()
def backend():
    return EventsBackend(EventBus(kept=100))


@pytest.fixture()
def url(backend):
    with served(app_with(backend)) as base:
        yield base


def jobs(first: int, count: int, group: str = "counter") -> list[tuple[str, str, dict]]:
    return [("job", group, {"job_id": f"j{i}", "status": "queued"}) for i in range(first, first + count)]


def test_the_parser_follows_the_event_stream_format():
    parser = EventParser()
    lines = [": a comment", "id: 7", "", "id: 8", "event: rank_lost", 'data: {"group": "g",',
             'data: "rank": 1}', "", "retry: 2500", "event: events_lost", 'data: {"dropped": 3}', ""]
    events = [event for line in lines for event in parser.feed(line)]
    assert parser.retry_s == 2.5 and parser.last_id == "8"  # an id without data moves the resume point only
    assert [(e.id, e.kind, e.data) for e in events] == [
        ("8", "rank_lost", {"group": "g", "rank": 1}), (None, "events_lost", {"dropped": 3})]
    assert events[0].group == "g" and events[0]["rank"] == 1


def test_events_resume_after_the_server_cuts_the_stream(url, backend):
    backend.publish(*jobs(0, 3))
    backend.cut_after = 2  # every stream ends after two events, as a proxy's timeout would cut it
    with SingleControllerClient(url, token=TOKEN, timeout=30) as client:
        stream = client.events(since=0)
        got = [next(stream) for _ in range(3)]
        backend.publish(*jobs(3, 3))
        got += [next(stream) for _ in range(3)]
        stream.close()
    assert [e.id for e in got] == ["1", "2", "3", "4", "5", "6"]
    assert [e["job_id"] for e in got] == [f"j{i}" for i in range(6)]
    assert backend.asked[:3] == ["0", "2", "4"]  # each reconnection resumed after the last event it had


def test_events_from_now_on_of_one_group(url, backend):
    backend.publish(*jobs(0, 2))
    with SingleControllerClient(url, token=TOKEN, timeout=30) as client:
        stream = client.events(group="other")
        def publish_once_connected() -> None:
            assert backend.connected.wait(30)
            backend.publish(*jobs(2, 2, "counter"), *jobs(4, 1, "other"))

        threading.Thread(target=publish_once_connected, daemon=True).start()
        event = next(stream)
        stream.close()
    assert (event.id, event.group, event["job_id"]) == ("5", "other", "j4")


def test_a_refused_token_raises_instead_of_reconnecting(url):
    with SingleControllerClient(url, token="wrong", timeout=30) as client, pytest.raises(ServiceError) as refused:
        next(client.events())
    assert refused.value.status_code == 401


def test_the_async_client_follows_events_too(url, backend):
    backend.publish(*jobs(0, 4))
    backend.cut_after = 3

    async def scenario():
        async with AsyncSingleControllerClient(url, token=TOKEN, timeout=30) as client:
            got = []
            async for event in client.events(since=1):
                got.append(event)
                if len(got) == 3:
                    break
            return got

    got = asyncio.run(scenario())
    assert [(e.id, e["job_id"]) for e in got] == [("2", "j1"), ("3", "j2"), ("4", "j3")]


def test_the_cli_prints_events_as_they_come(url, backend, capsys):
    backend.publish(("rank_lost", "counter", {"rank": 1, "node": "10.1.2.3", "reason": "ActorDiedError"}),
                    ("rank_replaced", "counter", {"rank": 1, "seconds": 2.5}))
    common = ["--url", url, "--token", TOKEN, "events", "--since", "0", "--count", "2"]
    assert cli.main(common) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].split(" ", 1)[1] == '1 rank_lost counter rank=1 node="10.1.2.3" reason="ActorDiedError"'
    assert lines[1].endswith("2 rank_replaced counter rank=1 seconds=2.5")
    assert cli.main([*common, "--json", "--group", "counter"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(p["id"], p["event"], p["data"]["rank"]) for p in printed] == [("1", "rank_lost", 1),
                                                                          ("2", "rank_replaced", 1)]
    assert cli.main(["--url", url, "--token", TOKEN, "events", "--group", "nope"]) == 1
    assert "unknown group 'nope'" in capsys.readouterr().err

"""The event stream where each controller runs in a replica of its own (the second service
of tests/e2e/conftest.py: the ingress scaled to two replicas, three deployments, a token):
the ingress merges the controllers' streams over Serve handles, each event's id joins
the three controllers' (``n1.n2.n3``), a stream resumed from such an id in whichever
ingress replica answers misses nothing, and a job's events come through the controller
that owns its group."""

from __future__ import annotations

import json

import httpx


def read_events(client: httpx.Client, count: int, **options) -> tuple[str, list[tuple[str, str, dict]]]:
    """The stream's starting id and its first ``count`` events, (id, kind, data); fewer when
    the stream stays quiet for 10 s."""
    start, found, block = "", [], {}
    try:
        with client.stream("GET", "/v1/events", timeout=10, **options) as stream:
            assert stream.status_code == 200, stream.read()
            for line in stream.iter_lines():
                if line == "":
                    if "event" in block:
                        found.append((block["id"], block["event"], json.loads(block["data"])))
                    elif "id" in block and not start:
                        start = block["id"]
                    block = {}
                    if start and len(found) >= count:
                        break
                elif not line.startswith(":"):
                    name, _, value = line.partition(": ")
                    block[name] = value
    except httpx.ReadTimeout:
        pass
    return start, found


def sources(start: str, ids: list[str]) -> list[tuple[int, int]]:
    """Which controller gave each event, and its own id there: the one part of the joined
    id that grew from the one before."""
    found, before = [], [int(n) for n in start.split(".")]
    for event_id in ids:
        now = [int(n) for n in event_id.split(".")]
        grown = [k for k, (a, b) in enumerate(zip(before, now, strict=True)) if a != b]
        assert len(grown) == 1 and now[grown[0]] > before[grown[0]], (before, now)
        found.append((grown[0], now[grown[0]]))
        before = now
    return found


def test_ids_join_the_controllers_and_a_resume_misses_nothing(limited, client):
    start, first = read_events(client, 4, params={"since": "0"})
    assert start == "0.0.0" and len(first) == 4  # at least one event per group: its start
    ids = [event_id for event_id, _, _ in first]
    origin = sources(start, ids)  # every event grows one controller's part by its own id
    _, resumed = read_events(client, 40, headers={"Last-Event-ID": ids[1]})
    again = dict(zip(sources(ids[1], [event_id for event_id, _, _ in resumed]),
                     [(kind, data) for _, kind, data in resumed], strict=True))
    for (controller, own), (_, kind, data) in zip(origin[2:], first[2:], strict=True):
        assert again[(controller, own)] == (kind, data)  # the same event, resumed in either ingress replica
    assert httpx.get(f"{limited.url}/v1/events", timeout=10).status_code == 401
    bad = client.get("/v1/events", headers={"Last-Event-ID": "7"})
    assert bad.status_code == 400 and "3 numbers joined by dots" in bad.json()["error"]


def test_a_jobs_events_come_through_its_controller(limited, client):
    position, _ = read_events(client, 0)
    job = client.post("/v1/jobs/counter/get", json={})  # read-only: the counters stay as they start
    assert job.status_code == 202, job.text
    _, found = read_events(client, 3, params={"group": "counter"}, headers={"Last-Event-ID": position})
    assert [(kind, data["job_id"], data["status"]) for _, kind, data in found] == [
        ("job", job.json()["id"], status) for status in ("queued", "running", "succeeded")]

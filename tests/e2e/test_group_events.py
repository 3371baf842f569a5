"""Groups' events on the service as shipped (its controllers in the ingress replica):

- one client's bad call stays that client's: a mutating call that raises on the ranks (a
  wrong argument type) restores its group in place, on the same processes, while
  ``/readyz`` and ``/v2/health/ready`` keep answering 200; the group's own status
  (``restoring``, in the event stream) says it restores;
- a job's statuses are events of its group, sent by the jobs deployment through the
  ingress, in order, behind HAProxy as the stream's every other event."""

from __future__ import annotations

import threading
import time

import httpx


def identity(http: httpx.Client, group: str) -> tuple[list[int], list[float], int]:
    detail = http.get(f"/v1/groups/{group}").json()
    values = [item["data"][0] for item in http.post(f"/v1/groups/{group}/get_value", json={}).json()["output"]]
    return [rank["pid"] for rank in detail["ranks"]], values, detail["rebuilds"]


def event_position(url: str) -> str:
    """The id the event stream stands at now (its first ``id:`` line)."""
    with httpx.stream("GET", f"{url}/v1/events", timeout=30) as stream:
        for line in stream.iter_lines():
            if line.startswith("id: "):
                return line[4:]
    raise AssertionError("the event stream gave no position")


def events_after(url: str, position: str, group: str, until) -> list[tuple[str, dict]]:
    import json

    found: list[tuple[str, dict]] = []
    headers = {"Last-Event-ID": position}
    with httpx.stream("GET", f"{url}/v1/events", params={"group": group}, headers=headers, timeout=10) as stream:
        kind = None
        for line in stream.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: ") and kind is not None:
                found.append((kind, json.loads(line[6:])))
                if until(found):
                    return found
    return found


def wait_for(predicate, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(0.02)


def test_a_bad_add_restores_its_group_in_place_while_the_service_stays_ready(service, http):
    pids, values, rebuilds = identity(http, "gpu_accumulator")
    position = event_position(service.url)
    answers: list[tuple[int, int]] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=service.url, timeout=30) as prober:
            while not stop.is_set():
                answers.append((prober.get("/readyz").status_code, prober.get("/v2/health/ready").status_code))

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        wait_for(lambda: answers, "the first probe")
        bad = http.post("/v1/groups/gpu_accumulator/add", json={"kwargs": {"x": "one"}})
        assert bad.status_code == 422 and "TypeError" in bad.json()["error"], bad.text
        assert "restored to its acknowledged state" in bad.json()["error"]
        deadline = time.monotonic() + 60
        while http.get("/v1/groups/gpu_accumulator").json()["status"] != "ready":
            assert time.monotonic() < deadline, "gpu_accumulator did not restore"
            time.sleep(0.05)
        probed = len(answers)
        wait_for(lambda: len(answers) > probed, "a probe after the restore")
    finally:
        stop.set()
        prober.join(timeout=60)
    assert answers and set(answers) == {(200, 200)}  # never out of service for one client's error
    statuses = events_after(service.url, position, "gpu_accumulator",
                            lambda found: found[-1][0] == "group_status" and found[-1][1]["status"] == "ready")
    assert [(data["previous"], data["status"]) for kind, data in statuses if kind == "group_status"] == [
        ("ready", "restoring"), ("restoring", "ready")]
    assert identity(http, "gpu_accumulator") == (pids, values, rebuilds)  # same processes, same state


def test_a_jobs_statuses_are_events_of_its_group(service, http):
    position = event_position(service.url)
    job = http.post("/v1/jobs/test_actor/record", json={"kwargs": {"item": "a job"}})
    assert job.status_code == 202, job.text
    job_id = job.json()["id"]
    found = events_after(service.url, position, "test_actor",
                         lambda found: found[-1][0] == "job" and found[-1][1]["status"] == "succeeded")
    assert [(data["job_id"], data["status"]) for kind, data in found if kind == "job"] == [
        (job_id, "queued"), (job_id, "running"), (job_id, "succeeded")]

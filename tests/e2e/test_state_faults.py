"""The state store's bounds on a live service (the small service of tests/e2e/conftest.py:
test_actor on 2 ranks and the plain ``accumulator`` actor, snapshots every 100 calls, a
SQLite file): a call nested as
deep as the wire takes does not stop snapshots; a job sent twice with one Idempotency-Key
runs once; a stored call whose replay raises leaves its group failed (with the reason,
no rebuild loop) while the others serve, until ``POST /v1/admin/groups/{group}/reset``.
(Restarts of the replica that hosts the controllers, and of ``serve run``, are in
test_state_restart.py.)"""

from __future__ import annotations

import time

import httpx
import pytest

from hybridflow.state.backends import open_store
from hybridflow.state.codec import encode_call
from tests.e2e.conftest import SMALL_HEALTH_CHECK_PERIOD_S, SNAPSHOT_EVERY
from tests.e2e.jobs import wait_for_job

pytestmark = pytest.mark.own_cluster  # the small service: serve run in a cluster of its own


@pytest.fixture(scope="module")
def http(small_service):
    with httpx.Client(base_url=small_service.url, timeout=120) as client:
        yield client


def test_a_call_as_deep_as_the_wire_takes_does_not_stop_snapshots(http):
    item: list = ["deep"]
    for _ in range(98):  # 99 levels in the call's body: as deep as limits.max_depth allows
        item = [item]
    assert http.post("/v1/groups/test_actor/record", json={"kwargs": {"item": item}}).status_code == 200
    for i in range(SNAPSHOT_EVERY + 10):
        assert http.post("/v1/groups/test_actor/record", json={"kwargs": {"item": i}}).status_code == 200
    deadline = time.monotonic() + 60
    while (group := http.get("/v1/groups/test_actor").json())["journal_length"] > SNAPSHOT_EVERY:
        assert time.monotonic() < deadline, group
        time.sleep(0.5)
    assert group["snapshot_error"] is None


def record(http: httpx.Client, item: str) -> int:
    """Record ``item``; the length of rank 0's history after it."""
    answer = http.post("/v1/groups/test_actor/record", json={"kwargs": {"item": item}})
    assert answer.status_code == 200, answer.text
    return answer.json()["output"][0]


def test_a_job_sent_twice_with_one_key_runs_once(http):
    before = record(http, "before the jobs")
    headers = {"Idempotency-Key": "job-once"}
    first = http.post("/v1/jobs/test_actor/record", json={"kwargs": {"item": "once"}}, headers=headers)
    again = http.post("/v1/jobs/test_actor/record", json={"kwargs": {"item": "once"}}, headers=headers)
    assert first.status_code == again.status_code == 202, (first.text, again.text)
    assert again.json()["id"] == first.json()["id"]
    other = http.post("/v1/jobs/test_actor/record", json={"kwargs": {"item": "twice"}}, headers=headers)
    assert other.status_code == 422 and "different request body" in other.json()["error"]
    final, _ = wait_for_job(http, first.json()["id"], timeout=60)
    assert final["status"] == "succeeded", final
    assert record(http, "after the jobs") == before + 2  # the job's record ran once


def wait_status(http: httpx.Client, group: str, status: str, timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        found = http.get(f"/v1/groups/{group}").json()
        if found["status"] == status:
            return found
        assert time.monotonic() < deadline, found
        time.sleep(0.5)


def test_a_replay_that_raises_fails_its_group_until_an_operator_resets_it(small_service, http):
    assert http.post("/v1/groups/accumulator/add", json={"args": [4]}).json()["output"] is None
    # A stored call that raises when it is replayed (as a deleted checkpoint would)
    with open_store(str(small_service.state_path)) as store:
        store.record_call("accumulators/accumulator", 2**40, encode_call("add", ("not a number",), {}))
    # A mutating call that raises restores the group from the store: that replay raises
    assert http.post("/v1/groups/accumulator/add", json={"args": ["x"]}).status_code == 422
    failed = wait_status(http, "accumulator", "failed")
    assert "TypeError" in failed["last_error"] and "/v1/admin/groups/accumulator/reset" in failed["last_error"]
    seen = set()
    deadline = time.monotonic() + 4 * SMALL_HEALTH_CHECK_PERIOD_S + 1  # health checks: no rebuild loop
    while time.monotonic() < deadline:
        seen.add(http.get("/v1/groups/accumulator").json()["status"])
        time.sleep(0.5)
    assert seen == {"failed"}
    refused = http.post("/v1/groups/accumulator/get_value", json={})
    assert refused.status_code == 503 and "Retry-After" not in refused.headers
    assert http.post("/v1/groups/test_actor/foo", json={"kwargs": {"y": 1}}).status_code == 200  # others serve

    reset = http.post("/v1/admin/groups/accumulator/reset")
    assert reset.status_code == 202, reset.text
    wait_status(http, "accumulator", "ready")
    assert http.post("/v1/groups/accumulator/get_value", json={}).json()["output"] == 0  # fresh

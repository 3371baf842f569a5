"""Limits and access on the second service (tests/e2e/conftest.py): a bearer token, a
1 KiB body limit and a 3 s request timeout."""

from __future__ import annotations

import time

import httpx

from tests.e2e.jobs import wait_for_job


def wait_until_serving(client: httpx.Client, timeout_s: float = 60) -> None:
    """Until ``test_actor`` answers a call: after a call past the timeout the controller
    checks the group's workers (one of them still runs that call), and calls meanwhile
    get 503."""
    deadline = time.monotonic() + timeout_s
    while client.post("/v1/groups/test_actor/foo", json={"kwargs": {"y": 0}}).status_code != 200:
        assert time.monotonic() < deadline, f"test_actor did not serve within {timeout_s:g} s"
        time.sleep(0.1)


def test_token_required_everywhere_but_health(limited, client):
    with httpx.Client(base_url=limited.url, timeout=60) as anonymous:
        for path in ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"):
            assert anonymous.get(path).status_code == 200, path
        for method, path in (("GET", "/v1/groups"), ("GET", "/v1/groups/test_actor"), ("GET", "/v2"),
                             ("POST", "/v1/groups/test_actor/foo"), ("GET", "/v2/models/mlp")):
            response = anonymous.request(method, path, json={})
            assert response.status_code == 401, (path, response.text)
            assert response.json()["error"]
        wrong = anonymous.get("/v1/groups", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
    assert client.get("/v1/groups").status_code == 200
    assert client.post("/v1/groups/test_actor/foo", json={"kwargs": {"y": 3}}).json()["output"] == [5, 5, 5, 5]


def test_body_over_the_limit_is_413(client):
    big = {"kwargs": {"y": 1, "pad": "x" * 2000}}
    response = client.post("/v1/groups/test_actor/foo", json=big)
    assert response.status_code == 413
    assert "limit" in response.json()["error"]


def test_call_past_the_timeout_is_504(client):
    wait_until_serving(client)
    response = client.post("/v1/groups/test_actor/sleep", json={"kwargs": {"seconds": 10}})
    assert response.status_code == 504, response.text
    assert response.json()["error"]


def test_a_job_whose_call_passes_the_deadline_fails_as_a_timeout(client):
    """With the controllers in replicas of their own: the job's call comes back from its
    controller as a timeout, and the job says so (not an unknown group)."""
    wait_until_serving(client)
    job = client.post("/v1/jobs/test_actor/sleep", json={"kwargs": {"seconds": 6}})
    assert job.status_code == 202, job.text
    final, _ = wait_for_job(client, job.json()["id"], timeout=60)
    assert (final["status"], final["status_code"], final["error_kind"]) == ("failed", 504, "timeout"), final
    assert "did not finish within 3 s" in final["error"]


def test_groups_of_other_deployments_are_absent(client):
    assert client.post("/v1/groups/accumulator/add", json={}).status_code == 404
    assert client.get("/v2/models/mlp").status_code == 404

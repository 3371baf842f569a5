"""Limits and access on the second service (tests/e2e/conftest.py): a bearer token, a
1 KiB body limit and a 3 s request timeout."""

from __future__ import annotations

import httpx


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
    response = client.post("/v1/groups/test_actor/sleep", json={"kwargs": {"seconds": 10}})
    assert response.status_code == 504, response.text
    assert response.json()["error"]


def test_groups_of_other_deployments_are_absent(client):
    assert client.post("/v1/groups/accumulator/add", json={}).status_code == 404
    assert client.get("/v2/models/mlp").status_code == 404

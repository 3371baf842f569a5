"""A worker group of classes the project has never seen, served from YAML alone: the
second service (tests/e2e/conftest.py) declares ``my_counters.workers`` from a package in
a temporary directory; here it is called over HTTP and recovered after a worker kill."""

from __future__ import annotations

import numpy as np
import pytest

from tests.e2e.cluster import kill_actor, wait_until_noticed, wait_until_ready


def call(client, group, method, **body):
    response = client.post(f"/v1/groups/{group}/{method}", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_group_is_listed_with_its_declared_pool(client):
    groups = {g["name"]: g for g in client.get("/v1/groups").json()["groups"]}
    counter = groups["counter"]
    assert counter["deployment"] == "counters" and counter["worker_class"] == "Counter"
    assert counter["world_size"] == 2 and counter["status"] == "ready"
    methods = {m["name"]: m for m in counter["methods"]}
    assert methods["add"]["dispatch_mode"] == "ONE_TO_ALL" and not methods["add"]["read_only"]
    assert methods["get"]["dispatch_mode"] == "EXECUTE_ALL" and methods["get"]["read_only"]
    assert groups["counter_view"]["resource_pool"] == counter["resource_pool"]


def test_registered_unregistered_and_read_only_methods(client):
    assert call(client, "counter", "get")["output"] == [5, 6]  # init_kwargs start=5, plus the rank
    journal = client.get("/v1/groups/counter").json()["journal_length"]
    answer = call(client, "counter", "add", kwargs={"x": 10})
    assert answer["dispatch_mode"] == "ONE_TO_ALL" and answer["output"] == [15, 16]
    assert call(client, "counter", "get")["output"] == [15, 16]
    # the mutating call is journaled, the read-only ones are not
    assert client.get("/v1/groups/counter").json()["journal_length"] == journal + 1
    # a group sharing the pool: separate processes on the same bundles
    view = client.get("/v1/groups/counter_view").json()["ranks"]
    counter = client.get("/v1/groups/counter").json()["ranks"]
    assert {r["pid"] for r in view}.isdisjoint({r["pid"] for r in counter})
    assert [r["node_id"] for r in view] == [r["node_id"] for r in counter]
    assert client.post("/v1/groups/counter/nope", json={}).status_code == 404


def test_an_inference_model_on_the_group(limited, client):
    tritonclient = pytest.importorskip("tritonclient.http")
    from tests.e2e.conftest import TOKEN

    value = call(client, "counter", "get")["output"][0]
    triton = tritonclient.InferenceServerClient(limited.url.removeprefix("http://"))
    x = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    inp = tritonclient.InferInput("x", [3], "FP32")
    inp.set_data_from_numpy(x)
    y = triton.infer("scaler", [inp], headers={"Authorization": f"Bearer {TOKEN}"}).as_numpy("y")
    assert y.tolist() == (x * value).tolist()


def test_a_killed_worker_is_replaced_and_the_state_replayed(limited, client):
    before = call(client, "counter", "add", kwargs={"x": 1})["output"]
    detail = client.get("/v1/groups/counter").json()
    victim = detail["ranks"][1]["actor_name"]
    kill_actor(limited, detail["namespace"], victim)
    wait_until_noticed(client, "counter", "get", detail["rebuilds"], timeout_s=60)
    wait_until_ready(client, ["counter"])
    assert call(client, "counter", "get")["output"] == before
    assert client.get("/v1/groups/counter").json()["rebuilds"] == detail["rebuilds"] + 1

"""End to end: `controllers_in_ingress: true`, the controllers inside the ingress replica
(one Serve hop fewer per call), on the second service (tests/e2e/conftest.py). Its
declared deployments answer as the usual service does: group calls in order, group
details, OIP models, and jobs (which reach the controllers through the ingress)."""

from __future__ import annotations

import time


def values(http, group):
    return [item["data"][0] for item in http.post(f"/v1/groups/{group}/get_value", json={}).json()["output"]]


def test_calls_details_models_and_jobs_with_the_controllers_in_the_ingress(limited, client):
    http = client
    assert limited.overrides["controllers_in_ingress"] is True
    assert values(http, "gpu_accumulator") == [0.0, 1.0, 2.0, 3.0]
    for _ in range(3):
        assert http.post("/v1/groups/gpu_accumulator/add", json={"kwargs": {"x": [1, 1, 1, 1]}}).status_code == 200
    assert values(http, "gpu_accumulator") == [3.0, 4.0, 5.0, 6.0]
    detail = http.get("/v1/groups/test_actor").json()
    assert detail["status"] == "ready" and [r["rank"] for r in detail["ranks"]] == [0, 1, 2, 3]
    assert http.post("/v1/groups/test_actor/foo", json={"kwargs": {"y": 3}}).json()["output"] == [5, 5, 5, 5]
    assert http.post("/v1/groups/nope/add", json={}).status_code == 404
    x = {"name": "x", "datatype": "FP32", "shape": [1, 1, 3], "data": [1, 2, 3.5]}
    answer = http.post("/v2/models/checksum/infer", json={"inputs": [x]})
    assert answer.status_code == 200 and answer.json()["outputs"][0]["data"] == [6.5]
    job = http.post("/v1/jobs/gpu_accumulator/add", json={"kwargs": {"x": [2, 2, 2, 2]}}).json()
    deadline = time.monotonic() + 60
    while http.get(f"/v1/jobs/{job['id']}").json()["status"] in ("queued", "running"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert http.get(f"/v1/jobs/{job['id']}").json()["status"] == "succeeded"
    assert values(http, "gpu_accumulator") == [5.0, 6.0, 7.0, 8.0]

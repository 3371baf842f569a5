"""End to end: both layouts of the controllers answer alike. The shipped config (the
session's service: one ingress replica) hosts every controller inside its ingress replica
(``controllers_in_ingress: auto``); the second service scales the ingress out to two
replicas, so its controllers run in replicas of their own. On each: group calls in order,
group details, an OIP model and a job (which reaches the controllers through the ingress)
give the tutorial's numbers, and Ray's own actor list shows the layout."""

from __future__ import annotations

from collections import Counter

from tests.e2e.cluster import replicas as cluster_replicas
from tests.e2e.jobs import wait_for_job


def replicas(proc) -> Counter:
    """Replicas per deployment of a running application, read from Ray's actor list (Serve
    names them ``SERVE_REPLICA::<app>#<deployment>#<id>``)."""
    return Counter(name.split("#")[1] for name in cluster_replicas(proc))


def values(http, group):
    return [item["data"][0] for item in http.post(f"/v1/groups/{group}/get_value", json={}).json()["output"]]


def calls_details_models_and_jobs(http) -> None:
    before = values(http, "gpu_accumulator")
    for _ in range(3):
        assert http.post("/v1/groups/gpu_accumulator/add", json={"kwargs": {"x": [1, 1, 1, 1]}}).status_code == 200
    assert values(http, "gpu_accumulator") == [v + 3 for v in before]
    detail = http.get("/v1/groups/test_actor").json()
    assert detail["status"] == "ready" and [r["rank"] for r in detail["ranks"]] == [0, 1, 2, 3]
    assert http.post("/v1/groups/test_actor/foo", json={"kwargs": {"y": 3}}).json()["output"] == [5, 5, 5, 5]
    assert http.post("/v1/groups/nope/add", json={}).status_code == 404
    x = {"name": "x", "datatype": "FP32", "shape": [1, 1, 3], "data": [1, 2, 3.5]}
    answer = http.post("/v2/models/checksum/infer", json={"inputs": [x]})
    assert answer.status_code == 200 and answer.json()["outputs"][0]["data"] == [6.5]
    job = http.post("/v1/jobs/gpu_accumulator/add", json={"kwargs": {"x": [2, 2, 2, 2]}}).json()
    assert wait_for_job(http, job["id"], timeout=60)[0]["status"] == "succeeded"
    assert values(http, "gpu_accumulator") == [v + 5 for v in before]


def test_the_shipped_config_hosts_the_controllers_in_its_one_ingress_replica(service, http):
    calls_details_models_and_jobs(http)
    layout = replicas(service)
    assert layout["ingress"] == 1, layout
    assert not {"accumulators", "test_actor", "mlp"} & set(layout), layout  # no controller replicas


def test_a_scaled_out_ingress_keeps_the_controllers_in_replicas_of_their_own(limited, client):
    assert limited.args["ingress_replicas"] == 2
    calls_details_models_and_jobs(client)
    layout = replicas(limited)
    assert layout["ingress"] == 2, layout
    assert layout["accumulators"] == 1 and layout["test_actor"] == 1, layout

"""What an operator scrapes and asks, against the session's service: the controllers'
metrics on Ray's Prometheus endpoint (the counts a few calls made), and the OIP
statistics and repository index as tritonclient reads them."""

from __future__ import annotations

import numpy as np
import pytest

from tests.e2e.cluster import Samples, metrics_endpoints, scrape_until

tritonhttp = pytest.importorskip("tritonclient.http")

CALLS = "ray_hybridflow_calls_total"
ZERO_RANK = {"group": "test_actor", "method": "foo_rank_zero"}
RAISED = {**ZERO_RANK, "kind": "method_raised", "code": "422"}


@pytest.fixture(scope="module")
def endpoints(service):
    return metrics_endpoints(service)


@pytest.fixture(scope="module")
def triton(service):
    client = tritonhttp.InferenceServerClient(service.url.removeprefix("http://"))
    yield client
    client.close()


def checksum(triton, values: list[float]) -> float:
    x = tritonhttp.InferInput("x", [1, 1, len(values)], "FP32")
    x.set_data_from_numpy(np.array(values, dtype=np.float32).reshape(1, 1, -1))
    return float(triton.infer("checksum", [x]).as_numpy("y")[0])


def test_metrics_count_the_calls_and_inferences_made(service, http, endpoints, triton):
    # Ray exports what a process recorded every few seconds, all of it at once: once a
    # call of an outcome no other test makes shows, every earlier call shows too.
    seen = Samples(endpoints).total(CALLS, **RAISED)
    assert http.post("/v1/groups/test_actor/foo_rank_zero", json={"kwargs": {"x": "a", "y": 1}}).status_code == 422
    before = scrape_until(endpoints, lambda s: s.total(CALLS, **RAISED) > seen)

    made = {("ok", "200"): 3, ("method_raised", "422"): 1}
    for y in range(3):
        assert http.post("/v1/groups/test_actor/foo_rank_zero", json={"kwargs": {"x": 1, "y": y}}).json()["output"] == 3 + y
    assert http.post("/v1/groups/test_actor/foo_rank_zero", json={"kwargs": {"x": "a", "y": 1}}).status_code == 422
    for name in ("no_such_method", "another_one"):
        assert http.post(f"/v1/groups/test_actor/{name}", json={}).status_code == 404
    assert [checksum(triton, [1, 2, 3.5]), checksum(triton, [4])] == [6.5, 4.0]

    def counts(samples):
        calls = {(kind, code): samples.total(CALLS, **ZERO_RANK, kind=kind, code=code) for kind, code in made}
        calls["unknown"] = samples.total(CALLS, group="test_actor", method="(unknown)", kind="unknown_method", code="404")
        calls["duration"] = samples.total("ray_hybridflow_call_duration_seconds_count", **ZERO_RANK)
        for name in ("model_inferences_total", "model_batch_size_count", "model_queue_duration_seconds_count",
                     "model_compute_duration_seconds_count"):
            calls[name] = samples.total(f"ray_hybridflow_{name}", model="checksum", **(
                {"kind": "ok", "code": "200"} if name.endswith("_total") else {}))
        return calls

    expected = {key: value + made.get(key, 0) for key, value in counts(before).items()}
    expected["unknown"] += 2
    expected["duration"] += 4
    for name in expected:
        if str(name).startswith("model_"):
            expected[name] += 2
    after = scrape_until(endpoints, lambda s: all(counts(s)[k] >= v for k, v in expected.items()))
    assert counts(after) == expected
    # Serve labels the series with the replica's deployment: the ingress, where the shipped
    # layout runs the controllers; nothing is left in flight
    (labels, _), *_ = after.matching(CALLS, **ZERO_RANK, kind="ok")
    assert labels["deployment"] == "ingress" and labels["application"] == "hybridflow"
    assert after.total("ray_hybridflow_calls_in_flight", **ZERO_RANK) == 0
    # the batch size of a request that ran alone is 1
    assert after.total("ray_hybridflow_model_batch_size_bucket", model="checksum", le="1.0") >= 2


def test_journal_length_gauge_follows_the_group(http, endpoints):
    assert http.post("/v1/groups/accumulator/add", json={"args": [1]}).status_code == 200
    journal = http.get("/v1/groups/accumulator").json()["journal_length"]
    assert journal >= 1
    scrape_until(endpoints, lambda s: s.total("ray_hybridflow_group_journal_length", group="accumulator") == journal)


def test_tritonclient_reads_statistics_and_the_repository_index(triton):
    before = triton.get_inference_statistics("checksum")["model_stats"][0]
    assert checksum(triton, [1, 1]) == 2.0
    (stats,) = triton.get_inference_statistics("checksum")["model_stats"]
    assert (stats["name"], stats["version"]) == ("checksum", "1")
    success = stats["inference_stats"]["success"]
    assert success["count"] == before["inference_stats"]["success"]["count"] + 1
    assert stats["inference_count"] == before["inference_count"] + 1
    assert stats["execution_count"] == before["execution_count"] + 1
    assert stats["inference_stats"]["compute_infer"]["ns"] > before["inference_stats"]["compute_infer"]["ns"]
    assert success["ns"] >= stats["inference_stats"]["compute_infer"]["ns"]
    every = {s["name"] for s in triton.get_inference_statistics()["model_stats"]}
    assert every == {"echo", "checksum", "mlp", "mlp_rollout"}
    index = {m["name"]: m for m in triton.get_model_repository_index()}
    assert set(index) == {"echo", "checksum", "mlp", "mlp_rollout"}
    assert all(m["state"] == "READY" and m["version"] == "1" for m in index.values()), index
    assert {"statistics", "model_repository"} <= set(triton.get_server_metadata()["extensions"])

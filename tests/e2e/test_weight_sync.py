"""End to end, on the session's service as shipped: `mlp_rollout` (the tp=2 layer) took
`mlp`'s weights (tp=4) at start; after a train step on `mlp`, `POST /v1/weights/mlp_rollout`
gives it the trained weights under a new version, which its OIP answers carry, and a
killed rank of it comes back with exactly those weights and that version. The same sync as
a job, the requests a sync refuses without changing anything, and syncs past the bounded
queue: 429 with Retry-After, while those waiting run once and answer one version."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import yaml

from tests.e2e.cluster import kill_actor, triton_grpc
from tests.serve_process import CONFIG

HIDDEN, FFN = 4096, 11008
#: One full copy of the layer: gate, up and down, float32.
FULL_BYTES = 3 * HIDDEN * FFN * 4


def shipped_config(group: str) -> dict:
    """The config the shipped ``init_calls`` give ``group``: other tests re-initialise
    ``mlp`` at other sizes, and a sync needs both layers of one shape."""
    args = yaml.safe_load(Path(CONFIG).read_text())["applications"][0]["args"]
    groups = {g["name"]: g for d in args["deployments"] for g in d["groups"]}
    (call,) = groups[group]["init_calls"]
    return call["kwargs"]["config"]


def tensor_json(t: torch.Tensor) -> dict:
    return {"datatype": "FP32", "shape": list(t.shape), "data": t.flatten().tolist()}


def infer(http, model: str, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    answer = http.post(f"/v2/models/{model}/infer", json={"inputs": [{"name": "x", **tensor_json(x)}]})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    (out,) = body["outputs"]
    y = torch.from_numpy(np.asarray(out["data"], dtype=np.float32).reshape(out["shape"]))
    return y, body["parameters"]["weights_version"]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def group(http, name: str) -> dict:
    answer = http.get(f"/v1/groups/{name}")
    assert answer.status_code == 200, answer.text
    return answer.json()


def wait_until(check, what: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(1)
    raise AssertionError(f"{what} within {timeout_s:g} s")


@pytest.fixture(scope="module")
def synced_at_start(http) -> int:
    """``mlp_rollout``'s version after its sync at start (and ``mlp`` back at its shipped shape)."""
    wait_until(lambda: (group(http, "mlp_rollout")["weights_version"] or 0) >= 1 or group(
        http, "mlp_rollout")["weights_error"], "the sync at start")
    detail = group(http, "mlp_rollout")
    assert http.post("/v1/groups/mlp/init_model", json={"kwargs": {"config": shipped_config("mlp")}}).is_success
    if detail["weights_error"] is not None:
        # in a whole session, a test before this module may have given mlp another shape
        # before the sync at start read it: that sync is refused, and one now succeeds
        assert "cannot reshard" in detail["weights_error"], detail
        synced = http.post("/v1/weights/mlp_rollout", json={"from": "mlp"})
        assert synced.status_code == 200, synced.text
        return synced.json()["weights_version"]
    assert detail["weights_version"] >= 1, detail
    return detail["weights_version"]


X = torch.randn(2, 1, HIDDEN, generator=torch.Generator().manual_seed(21))


def test_a_trained_layer_synced_to_its_rollout_answers_alike_and_survives_a_killed_worker(
    service, http, synced_at_start
):
    g = torch.Generator().manual_seed(22)
    x, target = torch.randn(2, 1, HIDDEN, generator=g), torch.randn(2, 1, HIDDEN, generator=g)
    stepped = http.post("/v1/groups/mlp/train_step",
                        json={"kwargs": {"x": tensor_json(x), "target": tensor_json(target), "lr": 50.0}})
    assert stepped.status_code == 200, stepped.text
    trained, trained_version = infer(http, "mlp", X)
    stale, stale_version = infer(http, "mlp_rollout", X)
    assert stale_version == synced_at_start and trained_version == 0
    assert relative(stale, trained) > 1e-3  # the step moved mlp away from what mlp_rollout holds

    answer = http.post("/v1/weights/mlp_rollout", json={"from": "mlp"})
    assert answer.status_code == 200, answer.text
    report = answer.json()
    assert report["weights_version"] == synced_at_start + 1 and report["from"] == "mlp"
    assert report["full_bytes"] == FULL_BYTES and report["bytes_per_rank"] == [FULL_BYTES // 2] * 2
    assert report["seconds"] > 0 and report["stage_seconds"] > 0

    synced, version = infer(http, "mlp_rollout", X)
    assert version == report["weights_version"]
    assert relative(synced, trained) <= 1e-5
    assert group(http, "mlp_rollout")["weights_version"] == version
    layout = http.get("/v1/weights/mlp_rollout").json()
    assert layout["weights_version"] == version
    assert [(r["tp_rank"], r["tp_size"]) for r in layout["layout"]["ranks"]] == [(0, 2), (1, 2)]
    assert [p["name"] for p in layout["layout"]["ranks"][0]["params"]] == ["gate_proj", "up_proj", "down_proj"]

    # mlp moves on; a killed rank of mlp_rollout must come back with the synced weights, not these
    assert http.post("/v1/groups/mlp/train_step",
                     json={"kwargs": {"x": tensor_json(target), "target": tensor_json(x), "lr": 50.0}}).is_success
    detail = group(http, "mlp_rollout")
    kill_actor(service, detail["namespace"], detail["ranks"][1]["actor_name"])
    wait_until(lambda: (lambda d: d["rebuilds"] > detail["rebuilds"] and d["status"] == "ready")(
        group(http, "mlp_rollout")), "mlp_rollout rebuilt")
    after, after_version = infer(http, "mlp_rollout", X)
    assert after_version == version and group(http, "mlp_rollout")["weights_version"] == version
    assert torch.equal(after, synced)


def test_the_grpc_answer_carries_the_weights_version(service, http, synced_at_start):
    tritongrpc = pytest.importorskip("tritonclient.grpc")
    x = X.numpy()
    item = tritongrpc.InferInput("x", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    client = triton_grpc(service.grpc_address, service.app_name)
    try:
        response = client.infer("mlp_rollout", [item]).get_response()
    finally:
        client.close()
    over_http, version = infer(http, "mlp_rollout", X)
    assert response.parameters["weights_version"].int64_param == version == group(http, "mlp_rollout")[
        "weights_version"]
    y = np.frombuffer(response.raw_output_contents[0], dtype=np.float32).reshape(over_http.shape)
    assert torch.equal(torch.from_numpy(y.copy()), over_http)


def test_a_sync_as_a_job(http, synced_at_start):
    before = group(http, "mlp_rollout")["weights_version"]
    submitted = http.post("/v1/weights/mlp_rollout?job=true", json={"from": "mlp"})
    assert submitted.status_code == 202, submitted.text
    location = submitted.headers["location"]
    assert location == f"/v1/jobs/{submitted.json()['id']}"
    status: dict = {}

    def finished() -> bool:
        status.update(http.get(location).json())
        return status["status"] not in ("queued", "running")

    wait_until(finished, "the sync job", timeout_s=300)
    assert status["status"] == "succeeded", status
    result = http.get(f"{location}/result").json()
    assert result["output"]["weights_version"] == before + 1
    assert infer(http, "mlp_rollout", X)[1] == before + 1

    # a source of another shape: the job fails with the status a sync would answer, and changes nothing
    small = {**shipped_config("mlp"), "hidden_size": 64, "intermediate_size": 128}
    assert http.post("/v1/groups/mlp/init_model", json={"kwargs": {"config": small}}).is_success
    failing = http.post("/v1/weights/mlp_rollout?job=true", json={"from": "mlp"})
    assert failing.status_code == 202, failing.text
    location = failing.headers["location"]
    wait_until(finished, "the failing sync job", timeout_s=300)
    assert status["status"] == "failed" and status["status_code"] == 422, status
    detail = group(http, "mlp_rollout")
    assert detail["weights_version"] == before + 1 and "failed" in detail["weights_error"]
    assert http.post("/v1/groups/mlp/init_model", json={"kwargs": {"config": shipped_config("mlp")}}).is_success


def test_syncs_past_the_queue_answer_429_with_retry_after(service, http, synced_at_start):
    def post(_: int) -> httpx.Response:  # a client each, all at once
        return httpx.post(f"{service.url}/v1/weights/mlp_rollout", json={"from": "mlp"}, timeout=600)

    # one runs (a 4096 x 11008 layer: seconds), limits.weight_syncs_queued (4) wait, two are refused
    with ThreadPoolExecutor(7) as pool:
        answers = list(pool.map(post, range(7)))
    assert sorted(a.status_code for a in answers) == [200] * 5 + [429] * 2, [a.text[:200] for a in answers]
    for refused in (a for a in answers if a.status_code == 429):
        assert int(refused.headers["retry-after"]) >= 1
        assert "limits.weight_syncs_queued" in refused.json()["error"]
    versions = sorted(a.json()["weights_version"] for a in answers if a.status_code == 200)
    assert versions[1:] == [versions[0] + 1] * 4, versions  # the four that waited ran once, together
    assert group(http, "mlp_rollout")["weights_version"] == versions[-1]
    # the kept files: the latest two syncs' (state.weights_kept), the latest the restore point
    kept = http.get("/v1/weights/mlp_rollout").json()["kept"]
    assert [(s["version"], s["restore_point"]) for s in kept["syncs"]] == [(versions[0], False), (versions[-1], True)]
    assert kept["bytes"] == sum(s["bytes"] for s in kept["syncs"]) and kept["weights_kept"] == 2
    assert all(FULL_BYTES < s["bytes"] < FULL_BYTES + 4096 for s in kept["syncs"]), kept


@pytest.mark.parametrize(("path", "body", "status", "words"), [
    ("/v1/weights/nope", {"from": "mlp"}, 404, "unknown group 'nope'"),
    ("/v1/weights/mlp_rollout", {"from": "nope"}, 404, "unknown group 'nope'"),
    ("/v1/weights/mlp_rollout", {"from": "test_actor"}, 422, "groups of one deployment"),
    ("/v1/weights/gpu_accumulator", {"from": "gpu_accumulator_a"}, 422, "declares no weights"),
    ("/v1/weights/mlp_rollout", {"from": "mlp_rollout"}, 422, "from itself"),
    ("/v1/weights/mlp_rollout", {"src": "mlp"}, 422, '{"from": "<source group>"}'),
    ("/v1/weights/mlp_rollout", b"{", 400, "not valid JSON"),
])
def test_refused_syncs_change_nothing(http, synced_at_start, path, body, status, words):
    before = group(http, "mlp_rollout")["weights_version"]
    kwargs = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {
        "json": body}
    answer = http.post(path, **kwargs)
    assert answer.status_code == status, answer.text
    assert words in answer.json()["error"]
    assert group(http, "mlp_rollout")["weights_version"] == before
    assert http.get("/v1/weights/test_actor").status_code == 404

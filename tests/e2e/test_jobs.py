"""Long calls as jobs on the live service: submit, progress, result (JSON and safetensors),
cancel, and the CLI's job command (a job's state outliving the ingress replica is in
test_state_restart.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch
from safetensors.torch import load, save

from tests.e2e.jobs import wait_for_job
from tests.mlp_reference import SMALL, assert_close, reference_mlp


def test_layer_call_as_a_job_through_the_binary_route(http):
    assert http.post("/v1/groups/mlp/init_model", json={"kwargs": {"config": SMALL}}).status_code == 200
    weights = http.post("/v1/groups/mlp/get_weights", json={}).json()["output"]
    x = torch.rand(64, 2, SMALL["hidden_size"])
    submitted = http.post(
        "/v1/jobs/mlp/run_layer?split=4",
        content=save({"x.0": x}),
        headers={"Content-Type": "application/x-safetensors"},
    )
    assert submitted.status_code == 202, submitted.text
    job = submitted.json()
    assert submitted.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["status"] in ("queued", "running") and job["split"] == 4
    final, progress = wait_for_job(http, job["id"])
    assert final["status"] == "succeeded" and final["progress"] == 1.0
    assert progress == sorted(progress)  # progress never goes back
    result = http.get(f"/v1/jobs/{job['id']}/result", headers={"Accept": "application/x-safetensors"})
    assert result.status_code == 200, result.text
    y = load(result.content)["output.0"]
    assert y.shape == x.shape
    assert_close(y, reference_mlp(weights, x))
    as_json = http.get(f"/v1/jobs/{job['id']}/result").json()
    assert as_json["dispatch_mode"] == "MEGATRON_COMPUTE" and as_json["output"][0]["shape"] == [64, 2, 64]
    assert any(j["id"] == job["id"] for j in http.get("/v1/jobs").json()["jobs"])


def test_unfinished_cancelled_and_unknown_jobs(http):
    slow = http.post("/v1/jobs/test_actor/sleep", json={"kwargs": {"seconds": 3}}).json()
    early = http.get(f"/v1/jobs/{slow['id']}/result")
    assert early.status_code == 409 and early.json()["error"]
    cancelled = http.delete(f"/v1/jobs/{slow['id']}")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert http.get(f"/v1/jobs/{slow['id']}/result").status_code >= 400
    assert http.get("/v1/jobs/not-a-job").status_code == 404
    assert http.post("/v1/jobs/nope/run", json={}).status_code == 404
    bad_split = http.post("/v1/jobs/mlp/run_layer?split=4", json={"args": [[1, 2]]})
    assert bad_split.status_code == 422, bad_split.text
    time.sleep(3)  # let the cancelled piece finish on the workers


def test_cli_runs_a_job_with_progress(service, http):
    assert http.post("/v1/groups/mlp/init_model", json={"kwargs": {"config": SMALL}}).status_code == 200
    done = subprocess.run(
        [sys.executable, "-m", "hybridflow_client.cli", "job", "mlp", "run_layer", "--random-input", "32,2,64",
         "--binary", "--split", "4", "--json", "--url", service.url],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "submitted" in done.stderr and "mlp.run_layer" in done.stderr
    (y,) = json.loads(done.stdout)
    assert y["datatype"] == "FP32" and y["shape"] == [32, 2, 64]

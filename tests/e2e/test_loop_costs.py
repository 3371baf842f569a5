"""What a request costs the event loop that serves the ingress and hosts the controllers
(the small service of tests/e2e/conftest.py: test_actor on 2 ranks, the mesh group):
``/healthz`` answers within a second while a jagged TensorDict of 400,001 rows is split
across the ranks and while a column of 120,000 Python objects is echoed; and the byte
bounds of kept answers hold for batches whose bytes are in their object columns
(``limits.idempotency_bytes`` 64 MiB, ``limits.jobs_result_bytes`` 16 MiB there)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import httpx
import pytest
import torch
from tensordict import TensorDict

from hybridflow_client.wire.safetensors_call import decode_output_body, encode_call_body
from single_controller import tensordict_utils as tu
from tests.e2e.conftest import SMALL_LIMITS
from tests.e2e.jobs import wait_for_job

pytestmark = pytest.mark.own_cluster  # the small service: serve run in a cluster of its own

#: The longest a /healthz may take while a large request is served.
HEALTHZ_S = 1.0
MIB = 1 << 20
SAFETENSORS = {"Content-Type": "application/x-safetensors", "Accept": "application/x-safetensors"}


@pytest.fixture(scope="module")
def http(small_service):
    small_service.wait_ready(timeout_s=300)
    with httpx.Client(base_url=small_service.url, timeout=300) as client:
        yield client


def healthz_while(url: str, call: Callable[[], httpx.Response], times: int = 3) -> tuple[list, list[float]]:
    """``call()`` ``times`` times in a thread, ``/healthz`` asked again and again meanwhile:
    the calls' answers and the seconds each health answer took."""
    answers: list = []
    thread = threading.Thread(target=lambda: answers.extend(call() for _ in range(times)))
    latencies: list[float] = []
    with httpx.Client(base_url=url, timeout=60) as probe:
        thread.start()
        while thread.is_alive():
            start = time.perf_counter()
            assert probe.get("/healthz").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.02)
    thread.join()
    return answers, latencies


def jagged_batch(rows: int) -> TensorDict:
    """``rows`` rows of one int8 each (row ``i`` holds ``i % 100``)."""
    values = (torch.arange(rows) % 100).to(torch.int8)
    return TensorDict({"ids": tu.jagged_from_parts(values, torch.arange(rows + 1), 1)}, batch_size=[rows])


def test_healthz_answers_while_a_jagged_tensordict_is_split_across_the_ranks(small_service, http):
    body = encode_call_body({"data": jagged_batch(400_001)})  # 3.4 MiB: values and offsets
    answers, latencies = healthz_while(
        small_service.url, lambda: http.post("/v1/groups/test_actor/score", content=body, headers=SAFETENSORS))
    for answer in answers:
        # decoded, padded, split in two and sent: the ranks ran score, which reads a
        # DataProto's .batch, and raised on the TensorDict they were given
        assert answer.status_code == 422, answer.text
        assert "raised AttributeError" in answer.json()["error"] and "batch" in answer.json()["error"]
    assert latencies and max(latencies) < HEALTHZ_S, latencies


def test_healthz_answers_while_a_jagged_tensordict_goes_to_a_mesh_and_back(small_service, http):
    rows = 400_001
    data = jagged_batch(rows)
    data["x"] = torch.arange(rows, dtype=torch.float32)
    data["tags"] = tu.object_column([i % 7 for i in range(rows)])
    body = encode_call_body({"data": data})
    answers, latencies = healthz_while(
        small_service.url, lambda: http.post("/v1/groups/doubler/double", content=body, headers=SAFETENSORS), times=2)
    for answer in answers:
        assert answer.status_code == 200, answer.text
        output = decode_output_body(answer.content)
        values, offsets, _ = tu.jagged_parts(output["ids"])
        assert torch.equal(offsets, torch.arange(rows + 1))
        assert torch.equal(values, (torch.arange(rows) % 100).to(torch.int8) * 2)
        assert torch.equal(output["x"], torch.arange(rows, dtype=torch.float32) * 2)
        assert tu.get(output, "tags") == [i % 7 for i in range(rows)]
    assert latencies and max(latencies) < HEALTHZ_S, latencies


def test_healthz_answers_while_an_object_column_is_echoed(small_service, http):
    rows = 120_000
    document = {"batch_size": [rows], "tensors": {}, "objects": {"o": [0] * rows}}
    body = json.dumps({"kwargs": {"x": {"__tensordict__": document}}}).encode()  # 240 KB: decoded on the loop
    answers, latencies = healthz_while(
        small_service.url,
        lambda: http.post("/v1/groups/test_actor/echo", content=body, headers={"Content-Type": "application/json"}))
    for answer in answers:
        assert answer.status_code == 200, answer.text
        echoed = answer.json()["output"]["__tensordict__"]
        assert echoed["batch_size"] == [rows] and echoed["objects"] == {"o": [0] * rows}
    assert latencies and max(latencies) < HEALTHZ_S, latencies


def holding(kind: str, text: str) -> dict:
    """A call body whose argument ``x`` is a batch of one row holding ``text`` in an
    object column: a TensorDict's ``objects`` or a DataProto's ``non_tensor_batch``."""
    if kind == "tensordict":
        x = {"__tensordict__": {"batch_size": [1], "tensors": {}, "objects": {"text": [text]}}}
    else:
        column = {"dtype": "object", "shape": [1], "data": [text]}
        x = {"__dataproto__": {"rows": 1, "batch": {}, "non_tensor_batch": {"text": column}, "meta_info": {}}}
    return {"kwargs": {"x": x}}


def eight_mib(tag: str) -> str:
    return tag + "x" * (8 * MIB - len(tag))


@pytest.mark.parametrize("kind", ["tensordict", "dataproto"])
def test_kept_answers_count_the_strings_in_their_object_columns(http, kind):
    assert SMALL_LIMITS["idempotency_bytes"] == 64 * MIB
    for i in range(16):
        answer = http.post("/v1/groups/test_actor/echo", json=holding(kind, eight_mib(f"{kind}-{i}")),
                           headers={"Idempotency-Key": f"{kind}-k{i}"})
        assert answer.status_code == 200, answer.text[:200]
    # 16 answers of 8 MiB passed 64 MiB: the first went, so its key runs another body
    again = http.post("/v1/groups/test_actor/echo", json=holding(kind, "another body"),
                      headers={"Idempotency-Key": f"{kind}-k0"})
    assert again.status_code == 200, again.text[:200]
    assert "another body" in again.text
    # the last is kept: its key with another body is refused
    last = http.post("/v1/groups/test_actor/echo", json=holding(kind, "another body"),
                     headers={"Idempotency-Key": f"{kind}-k15"})
    assert last.status_code == 422 and "different request body" in last.json()["error"]


@pytest.mark.parametrize("kind", ["tensordict", "dataproto"])
def test_finished_jobs_keep_at_most_jobs_result_bytes_of_object_columns(http, kind):
    assert SMALL_LIMITS["jobs_result_bytes"] == 16 * MIB
    ids = []
    for i in range(6):
        submitted = http.post("/v1/jobs/test_actor/echo", json=holding(kind, eight_mib(f"{kind}-job-{i}")))
        assert submitted.status_code == 202, submitted.text[:200]
        ids.append(submitted.json()["id"])
        final, _ = wait_for_job(http, ids[-1])
        assert final["status"] == "succeeded", final
    listed = {job["id"] for job in http.get("/v1/jobs").json()["jobs"]}
    kept = [job_id for job_id in ids if job_id in listed]
    # each result holds 8 MiB: at most 16 MiB of them is two, the newest kept
    assert 1 <= len(kept) <= 2 and kept[-1] == ids[-1], (kept, ids)
    assert http.get(f"/v1/jobs/{ids[0]}/result").status_code == 404
    newest = http.get(f"/v1/jobs/{ids[-1]}/result")
    assert newest.status_code == 200 and f"{kind}-job-5" in newest.text[:100_000]

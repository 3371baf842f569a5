"""``/v1/weights`` on the service's real app, over a backend stand-in that records what it
is asked and answers as a controller would: token-protected; an unknown group 404 and
groups of two deployments 422 before anything reaches a controller; a body that is not
JSON 400, not ``{"from": "<group>"}`` 422, too large 413, of another type 415; a sync's
answer 200, a controller's refusal with its status, ``?job=true`` 202 with the job's
``Location``; an Idempotency-Key carried with the body's fingerprint."""

from __future__ import annotations

import httpx
import pytest

from hybridflow.control.contract import (
    WEIGHTS_LAYOUT,
    WEIGHTS_SYNC,
    CallRequest,
    CallResult,
    ControllerError,
    ErrorKind,
)
from hybridflow.http.app import create_app
from hybridflow.http.settings import IngressSettings
from tests.unit.served_app import served

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
REPORT = {"group": "rollout", "from": "trainer", "weights_version": 2, "transport": "object_store", "backend": None,
          "reason": "CPU ranks", "bytes_per_rank": [98304, 98304], "slices_per_rank": [6, 6], "full_bytes": 196608,
          "stage_seconds": 0.1, "commit_seconds": 0.01, "seconds": 0.2}


class WeightsBackend:
    """Answers a sync with REPORT (a refusal for the group 'refusing'), a layout for
    'rollout', 'declares no weights' for any other group, and records every request."""

    def __init__(self) -> None:
        self.calls: list[CallRequest] = []
        self.jobs: list[tuple[CallRequest, int]] = []

    async def call(self, request: CallRequest) -> CallResult:
        self.calls.append(request)
        if request.method == WEIGHTS_LAYOUT:
            if request.group != "rollout":
                return CallResult(error=ControllerError(ErrorKind.UNKNOWN_METHOD, "group declares no weights"))
            return CallResult(output={"group": "rollout", "weights_version": 2, "layout": {"ranks": []}})
        if request.group == "refusing":
            return CallResult(error=ControllerError(ErrorKind.BAD_ARGUMENTS, "layouts do not fit"))
        return CallResult(output=REPORT, weights_version=2)

    async def submit(self, controller: str, request: CallRequest, split: int) -> dict:
        self.jobs.append((request, split))
        return {"id": "j1", "group": request.group, "method": request.method, "status": "queued", "progress": 0.0,
                "split": split, "error": None, "error_kind": None, "cancel_requested": False,
                "submitted_at": 1.0, "elapsed_s": 0.0}


@pytest.fixture(scope="module")
def backend():
    return WeightsBackend()


@pytest.fixture(scope="module")
def client(backend):
    groups = {"trainer": "mlp", "rollout": "mlp", "refusing": "mlp", "echo": "other"}
    with served(create_app(backend, IngressSettings(auth_token=TOKEN, groups=groups), backend)) as url:
        with httpx.Client(base_url=url, headers=AUTH) as opened:
            yield opened


@pytest.fixture(autouse=True)
def forget(backend):
    backend.calls.clear()
    backend.jobs.clear()


def test_a_sync_answers_the_report_and_asks_the_destinations_controller(client, backend):
    answer = client.post("/v1/weights/rollout", json={"from": "trainer"})
    assert answer.status_code == 200, answer.text
    assert answer.json() == REPORT
    (request,) = backend.calls
    assert (request.group, request.method, request.kwargs, request.operation) == (
        "rollout", WEIGHTS_SYNC, {"from": "trainer"}, True)
    assert request.idempotency_key is None and request.fingerprint is None


def test_a_sync_as_a_job_answers_202_with_its_location(client, backend):
    answer = client.post("/v1/weights/rollout?job=true", json={"from": "trainer"})
    assert answer.status_code == 202, answer.text
    assert answer.headers["location"] == "/v1/jobs/j1"
    assert answer.json()["status"] == "queued" and answer.json()["error_kind"] is None
    ((request, split),) = backend.jobs
    assert request.operation and request.method == WEIGHTS_SYNC and split == 1 and backend.calls == []


def test_an_idempotency_key_goes_with_the_bodys_fingerprint(client, backend):
    assert client.post("/v1/weights/rollout", json={"from": "trainer"}, headers={"Idempotency-Key": "k"}).is_success
    (request,) = backend.calls
    assert request.idempotency_key == "k" and len(request.fingerprint) == 64
    long = client.post("/v1/weights/rollout", json={"from": "trainer"}, headers={"Idempotency-Key": "k" * 201})
    assert long.status_code == 400 and "Idempotency-Key" in long.json()["error"]


@pytest.mark.parametrize(("path", "kwargs", "status", "words"), [
    ("/v1/weights/nope", {"json": {"from": "trainer"}}, 404, "unknown group 'nope'"),
    ("/v1/weights/rollout", {"json": {"from": "nope"}}, 404, "unknown group 'nope'"),
    ("/v1/weights/rollout", {"json": {"from": "echo"}}, 422, "groups of one deployment"),
    ("/v1/weights/rollout", {"content": b"{not json", "headers": {"Content-Type": "application/json"}}, 400,
     "not valid JSON"),
    ("/v1/weights/rollout", {"content": b"", "headers": {"Content-Type": "application/json"}}, 400, "JSON"),
    ("/v1/weights/rollout", {"json": {"from": 3}}, 422, '{"from": "<source group>"}'),
    ("/v1/weights/rollout", {"json": {"source": "trainer"}}, 422, '{"from": "<source group>"}'),
    ("/v1/weights/rollout", {"json": {"from": "trainer", "to": "x"}}, 422, '{"from": "<source group>"}'),
    ("/v1/weights/rollout", {"json": ["trainer"]}, 422, '{"from": "<source group>"}'),
    ("/v1/weights/rollout", {"json": {"from": "t" * 5000}}, 413, "over the limit"),
    ("/v1/weights/rollout", {"content": b"from=trainer",
                             "headers": {"Content-Type": "application/x-www-form-urlencoded"}}, 415, "media type"),
])
def test_bad_requests_never_reach_a_controller(client, backend, path, kwargs, status, words):
    for suffix in ("", "?job=true"):
        answer = client.post(path + suffix, **kwargs)
        assert answer.status_code == status, answer.text
        assert words in answer.json()["error"]
    assert backend.calls == [] and backend.jobs == []


def test_a_controllers_refusal_keeps_its_status(client):
    answer = client.post("/v1/weights/refusing", json={"from": "trainer"})
    assert answer.status_code == 422 and answer.json() == {"error": "layouts do not fit"}


def test_the_layout_and_version_of_a_group(client, backend):
    answer = client.get("/v1/weights/rollout")
    assert answer.status_code == 200 and answer.json()["weights_version"] == 2
    assert client.get("/v1/weights/trainer").status_code == 404
    assert client.get("/v1/weights/nope").status_code == 404
    assert [(r.group, r.method, r.operation) for r in backend.calls] == [
        ("rollout", WEIGHTS_LAYOUT, True), ("trainer", WEIGHTS_LAYOUT, True)]


def test_the_routes_need_the_token(client, backend):
    for method, path in (("POST", "/v1/weights/rollout"), ("GET", "/v1/weights/rollout")):
        answer = httpx.request(method, str(client.base_url) + path, json={"from": "trainer"})
        assert answer.status_code == 401 and answer.json()["error"]
    assert backend.calls == []

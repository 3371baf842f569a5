"""The OIP statistics and model repository extensions, read with tritonclient from the
service's real app (over a stub backend whose statistics are the controller's own
``hybridflow.control.model_statistics``), and the controller-side hook that keeps them."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
import yaml

from hybridflow.config import load_config
from hybridflow.control import model_statistics
from hybridflow.control.contract import ErrorKind
from hybridflow.control.controller import GroupController
from hybridflow.control.models import ModelServer
from hybridflow.control.placement import GpuBudget, plan_deployment
from tests.serve_process import CONFIG
from tests.unit.observed_stub import MODELS, observed_app
from tests.unit.served_app import served

tritonhttp = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402


@pytest.fixture(scope="module")
def url():
    with served(observed_app()) as base:
        yield base


@pytest.fixture
def triton(url, monkeypatch):
    monkeypatch.setattr(model_statistics, "_TABLE", {})  # every model's counts start again
    client = tritonhttp.InferenceServerClient(url.removeprefix("http://"))
    yield client
    client.close()


def test_server_metadata_names_the_extensions(triton):
    extensions = triton.get_server_metadata()["extensions"]
    assert {"binary_tensor_data", "statistics", "model_repository"} <= set(extensions)


def test_tritonclient_reads_one_models_statistics(triton):
    stats = model_statistics.of("double")
    stats.succeeded(0.010, queue_s=0.0, infer_s=0.006, batch_size=1)
    stats.succeeded(0.020, queue_s=0.0, infer_s=0.012, batch_size=1)
    for _ in range(2):  # two requests that ran in one batch of 2: one execution
        stats.succeeded(0.050, queue_s=0.004, infer_s=0.030, batch_size=2)
    stats.failed(0.001)

    (answer,) = triton.get_inference_statistics("double")["model_stats"]
    assert (answer["name"], answer["version"]) == ("double", "1")
    assert answer["inference_count"] == 4 and answer["execution_count"] == 3
    assert answer["last_inference"] > 0
    inference = answer["inference_stats"]
    assert inference["success"] == {"count": 4, "ns": 130_000_000}
    assert inference["fail"] == {"count": 1, "ns": 1_000_000}
    assert inference["queue"] == {"count": 4, "ns": 8_000_000}
    assert inference["compute_infer"] == {"count": 4, "ns": 78_000_000}
    # what is left of each request before the group call: 4 + 8 + 16 + 16 ms
    assert inference["compute_input"] == {"count": 4, "ns": 44_000_000}
    assert inference["compute_output"]["count"] == 4
    batches = {b["batch_size"]: b for b in answer["batch_stats"]}
    assert batches[1]["compute_infer"] == {"count": 2, "ns": 18_000_000}
    assert batches[2]["compute_infer"] == {"count": 1, "ns": 30_000_000}
    # by version, as tritonclient asks with model_version
    by_version = triton.get_inference_statistics("double", model_version="1")["model_stats"]
    assert by_version == [answer | {"last_inference": by_version[0]["last_inference"]}]


def test_tritonclient_reads_every_models_statistics(triton):
    model_statistics.of("checksum").succeeded(0.002, 0.0, 0.001, 1)
    every = triton.get_inference_statistics()["model_stats"]
    assert [s["name"] for s in every] == sorted(MODELS)
    counts = {s["name"]: s["inference_count"] for s in every}
    assert counts == {"checksum": 1, "double": 0, "mlp": 0}


def test_statistics_of_an_unknown_model_or_version_are_404(triton, url):
    for model, version in (("nope", ""), ("double", "2")):
        with pytest.raises(InferenceServerException) as caught:
            triton.get_inference_statistics(model, model_version=version)
        assert caught.value.status() == "404", caught.value
    assert httpx.get(f"{url}/v2/models/nope/stats").json() == {"error": "unknown model 'nope'; models: checksum, double, mlp"}


def test_tritonclient_reads_the_repository_index(triton, url):
    index = triton.get_model_repository_index()
    assert index == [
        {"name": "checksum", "version": "1", "state": "UNAVAILABLE",
         "reason": "group 'test_actor' is rebuilding: test_actor: a worker is lost (ActorDiedError)"},
        {"name": "double", "version": "1", "state": "READY", "reason": ""},
        {"name": "mlp", "version": "1", "state": "UNAVAILABLE",
         "reason": "group 'mlp' is failed: rebuild failed: ResourceUnavailableError: no GPUs left"},
    ]
    ready = httpx.post(f"{url}/v2/repository/index", json={"ready": True})
    assert ready.status_code == 200 and [m["name"] for m in ready.json()] == ["double"]


@pytest.mark.parametrize("body", [b"[1]", b'{"ready": "yes"}', b'{"ready": true, "repository": "x"}', b"{nope"])
def test_a_malformed_index_request_is_400(url, body):
    answer = httpx.post(f"{url}/v2/repository/index", content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code == 400 and answer.json()["error"].startswith("index request")


def test_load_and_unload_are_refused_as_with_model_control_off(triton, url):
    for action in (triton.load_model, triton.unload_model):
        with pytest.raises(InferenceServerException) as caught:
            action("double")
        assert caught.value.status() == "400" and "serve config" in caught.value.message()
    assert httpx.post(f"{url}/v2/repository/models/nope/load").status_code == 404


# -- the controller's hook ---------------------------------------------------------------


def test_the_model_server_counts_a_failed_request_for_its_model_only(monkeypatch):
    """A real controller whose groups never started: inference fails as unavailable, and
    only a model it serves gets statistics."""
    monkeypatch.setattr(model_statistics, "_TABLE", {})
    config = load_config(yaml.safe_load(CONFIG.read_text())["applications"][0]["args"])
    deployment = next(d for d in config.deployments if d.name == "test_actor")
    plan = plan_deployment(deployment, config, GpuBudget(0))
    server = ModelServer(deployment.models, GroupController(deployment, plan, []))

    async def scenario():
        known = await server.infer("checksum", {"x": torch.ones(1, 1, 3)})
        unknown = await server.infer("nope", {"x": torch.ones(1, 1, 3)})
        return known, unknown

    known, unknown = asyncio.run(scenario())
    assert known.error.kind is ErrorKind.UNAVAILABLE and unknown.error.kind is ErrorKind.UNKNOWN_MODEL
    answer = model_statistics.of("checksum").as_triton()
    assert answer["inference_stats"]["fail"]["count"] == 1 and answer["inference_count"] == 0
    assert "nope" not in model_statistics._TABLE

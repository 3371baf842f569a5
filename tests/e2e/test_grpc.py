"""End to end: the Open Inference Protocol over gRPC, through Serve's gRPC proxy as
serve_config.yaml declares it (``grpc_options``), driven with tritonclient.grpc at its
defaults. The session's service (controllers inside its one ingress replica) answers
metadata, readiness and inference on the same models as over HTTP, with the same answers;
the second service (its ingress scaled out, the controllers in replicas of their own)
needs the bearer token as ``authorization`` metadata and bounds the request's bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.e2e.cluster import Samples, metrics_endpoints, scrape_until, triton_grpc
from tests.e2e.conftest import TOKEN
from tests.serve_process import CONFIG

tritongrpc = pytest.importorskip("tritonclient.grpc")
tritonhttp = pytest.importorskip("tritonclient.http")
grpc = pytest.importorskip("grpc")
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

CHECKSUM_X = np.array([[[1, 2, 3.5]]], dtype=np.float32)


def infer_input(name: str, array: np.ndarray, module=tritongrpc):
    item = module.InferInput(name, list(array.shape), module.np_to_triton_dtype(array.dtype))
    item.set_data_from_numpy(array)
    return item


def successes(http, model: str) -> int:
    """The model's successful inferences, from its OIP statistics (HTTP)."""
    (stats,) = http.get(f"/v2/models/{model}/stats").json()["model_stats"]
    return stats["inference_stats"]["success"]["count"]


def status_of(call) -> str:
    with pytest.raises(InferenceServerException) as refused:
        call()
    return refused.value.status()


@pytest.fixture(scope="module")
def triton(service):
    client = triton_grpc(service.grpc_address, service.app_name)
    yield client
    client.close()


def test_the_service_listens_on_the_declared_grpc_port(service):
    options = yaml.safe_load(Path(CONFIG).read_text())["grpc_options"]
    assert options["port"] == 9000
    assert options["grpc_servicer_functions"] == ["hybridflow.oip_grpc.registration.add_inference_service"]
    assert service.grpc_address.endswith(f":{service.grpc_port}")


def test_liveness_readiness_and_metadata(triton):
    assert triton.is_server_live() and triton.is_server_ready()
    server = triton.get_server_metadata()
    assert server.name == "hybridflow-single-controller" and server.version
    assert triton.is_model_ready("checksum") and triton.is_model_ready("mlp", "1")
    echo = triton.get_model_metadata("echo")
    assert (echo.name, list(echo.versions)) == ("echo", ["1"])
    assert [(t.name, t.datatype, list(t.shape)) for t in echo.inputs] == [("x", "FP32", [-1, -1, -1])]
    checksum = triton.get_model_metadata("checksum", as_json=True)
    assert checksum["outputs"] == [{"name": "y", "datatype": "FP64", "shape": ["1"]}]


def test_checksum_and_echo(triton, http):
    before = successes(http, "checksum")
    result = triton.infer("checksum", [infer_input("x", CHECKSUM_X)], request_id="sum-1")
    y = result.as_numpy("y")
    assert y.dtype == np.float64 and y.shape == (1,) and y.tolist() == [6.5]
    assert result.get_response().id == "sum-1" and result.get_response().model_version == "1"
    # the controller counts it as it counts an HTTP request
    assert successes(http, "checksum") == before + 1
    x = np.random.default_rng(3).standard_normal((2, 3, 5)).astype(np.float32)
    echoed = triton.infer("echo", [infer_input("x", x)], outputs=[tritongrpc.InferRequestedOutput("y")])
    assert np.array_equal(echoed.as_numpy("y"), x)


def test_typed_contents_through_the_proxy(service):
    """A client that sends its values in the typed ``contents`` fields, not raw bytes."""
    request = service_pb2.ModelInferRequest(model_name="checksum")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 1, 3]).contents.fp32_contents.extend([1, 2, 3.5])
    with grpc.insecure_channel(service.grpc_address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        answer = stub.ModelInfer(request, timeout=60, metadata=[("application", service.app_name)])
    assert [o.datatype for o in answer.outputs] == ["FP64"]
    assert np.frombuffer(answer.raw_output_contents[0], "<f8").tolist() == [6.5]


def test_mlp_answers_as_over_http(service, http, triton):
    # the layer as the config starts it (another module may have re-initialised it smaller)
    args = yaml.safe_load(Path(CONFIG).read_text())["applications"][0]["args"]
    (mlp,) = [g for d in args["deployments"] for g in d["groups"] if g["name"] == "mlp"]
    config = mlp["init_calls"][0]["kwargs"]["config"]
    assert http.post("/v1/groups/mlp/init_model", json={"kwargs": {"config": config}}).status_code == 200
    x = torch.randn(2, 1, 4096, generator=torch.Generator().manual_seed(21)).numpy()
    over_grpc = triton.infer("mlp", [infer_input("x", x)]).as_numpy("y")
    binary = tritonhttp.InferenceServerClient(service.url.removeprefix("http://"))
    over_http = binary.infer("mlp", [infer_input("x", x, tritonhttp)]).as_numpy("y")
    assert over_grpc.shape == (2, 1, 4096) and over_grpc.dtype == np.float32
    assert np.array_equal(over_grpc, over_http)


GRPC_REQUESTS = "ray_hybridflow_grpc_requests_total"


def test_refusals_carry_status_codes_and_are_counted(service, triton):
    endpoints = metrics_endpoints(service)

    def refusals(samples: Samples) -> dict[str, float]:
        return {code: samples.total(GRPC_REQUESTS, rpc="ModelInfer", code=code)
                for code in ("NOT_FOUND", "INVALID_ARGUMENT")}

    before = refusals(Samples(endpoints))
    x = [infer_input("x", CHECKSUM_X)]
    assert status_of(lambda: triton.infer("nope", x)) == "StatusCode.NOT_FOUND"
    assert status_of(lambda: triton.get_model_metadata("nope")) == "StatusCode.NOT_FOUND"
    assert status_of(lambda: triton.is_model_ready("checksum", "2")) == "StatusCode.NOT_FOUND"
    flat = np.array([1, 2, 3.5], dtype=np.float32)
    assert status_of(lambda: triton.infer("checksum", [infer_input("x", flat)])).endswith("INVALID_ARGUMENT")
    wide = CHECKSUM_X.astype(np.float64)
    assert status_of(lambda: triton.infer("checksum", [infer_input("x", wide)])).endswith("INVALID_ARGUMENT")
    text = np.array([[[b"a", b"b", b"c"]]], dtype=np.object_)
    with pytest.raises(InferenceServerException, match="BYTES") as refused:
        triton.infer("checksum", [infer_input("x", text)])
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    unknown_output = [tritongrpc.InferRequestedOutput("z")]
    with pytest.raises(InferenceServerException, match="no output 'z'"):
        triton.infer("checksum", x, outputs=unknown_output)
    assert status_of(lambda: triton.get_inference_statistics("checksum")) == "StatusCode.UNIMPLEMENTED"
    expected = {"NOT_FOUND": before["NOT_FOUND"] + 1, "INVALID_ARGUMENT": before["INVALID_ARGUMENT"] + 4}
    after = scrape_until(endpoints, lambda samples: refusals(samples) == expected)
    assert refusals(after) == expected


def test_the_token_and_the_size_bound(limited):
    client = triton_grpc(limited.grpc_address, limited.app_name)
    bearer = {"authorization": f"Bearer {TOKEN}"}
    try:
        assert client.is_server_live() and client.is_server_ready()  # open, like the HTTP probes
        x = [infer_input("x", CHECKSUM_X)]
        with pytest.raises(InferenceServerException, match="bearer token") as refused:
            client.infer("checksum", x)
        assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
        wrong = {"authorization": "Bearer not-it"}
        unauthenticated = status_of(lambda: client.get_model_metadata("checksum", headers=wrong))
        assert unauthenticated == "StatusCode.UNAUTHENTICATED"
        assert client.infer("checksum", x, headers=bearer).as_numpy("y").tolist() == [6.5]
        assert client.get_model_metadata("checksum", headers=bearer).name == "checksum"
        # 1200 bytes of tensor data against the second service's max_body_bytes of 1024
        large = [infer_input("x", np.ones((1, 1, 300), np.float32))]
        with pytest.raises(InferenceServerException, match="max_body_bytes") as over:
            client.infer("checksum", large, headers=bearer)
        assert over.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    finally:
        client.close()

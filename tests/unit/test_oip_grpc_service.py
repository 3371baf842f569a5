"""The gRPC RPCs (hybridflow.oip_grpc.service) over a backend of plain objects: the token,
unknown models and versions, the controllers' errors as status codes, and answers as
tritonclient.grpc reads them. No Ray, no Serve."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import numpy as np
import pytest
import torch

tritongrpc = pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2 as pb  # noqa: E402

from hybridflow.control.contract import ControllerError, ErrorKind, InferResult  # noqa: E402
from hybridflow.oip_grpc.registration import SERVED_RPCS, add_inference_service  # noqa: E402
from hybridflow.oip_grpc.service import GrpcSettings, OipGrpcService  # noqa: E402
from hybridflow.oip_grpc.status import CODE_OF_KIND  # noqa: E402

TOKEN = "s3cret-token"


class Context:
    """A call's context as Serve hands it over: the metadata in, the status out."""

    def __init__(self, metadata: list[tuple[str, Any]] | None = None) -> None:
        self.metadata = metadata or []
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailing: list[tuple[str, str]] = []

    def invocation_metadata(self) -> list[tuple[str, Any]]:
        return self.metadata

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, trailing_metadata: list[tuple[str, str]]) -> None:
        self.trailing = trailing_metadata


class Backend:
    """Sums its input (``checksum``); answers what ``error`` says instead when set."""

    def __init__(self) -> None:
        self.error: ControllerError | None = None
        self.raises: Exception | None = None
        self.calls: list[dict[str, torch.Tensor]] = []

    async def ready(self) -> dict[str, bool]:
        return {"test_actor": True}

    async def model_metadata(self, model: str) -> dict[str, Any] | ControllerError:
        return {
            "name": model,
            "versions": ["1"],
            "platform": "p",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, -1, -1]}],
            "outputs": [{"name": "y", "datatype": "FP64", "shape": [1]}],
        }

    async def model_ready(self, model: str) -> bool:
        return True

    async def infer(self, model: str, inputs: dict[str, Any]) -> InferResult:
        if self.raises is not None:
            raise self.raises
        if self.error is not None:
            return InferResult(error=self.error)
        self.calls.append(inputs)
        return InferResult(outputs={"y": inputs["x"].double().sum().reshape(1)}, batch_size=2)


def service(backend: Backend, token: str | None = TOKEN, **settings: Any) -> OipGrpcService:
    return OipGrpcService(backend, GrpcSettings(models={"checksum": ("y",)}, auth_token=token, **settings))


def checksum_request(**kwargs: Any) -> pb.ModelInferRequest:
    x = tritongrpc.InferInput("x", [1, 1, 3], "FP32").set_data_from_numpy(
        np.array([[[1, 2, 3.5]]], np.float32)
    )
    request = pb.ModelInferRequest(model_name="checksum", **kwargs)
    request.inputs.append(x._get_tensor())
    request.raw_input_contents.append(x._get_content())
    return request


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


AUTHORIZED = [("authorization", f"Bearer {TOKEN}")]


def test_infer_answers_the_sum_with_the_batch_size_parameter():
    backend = Backend()
    context = Context(AUTHORIZED)
    response = run(service(backend).model_infer(checksum_request(id="7").SerializeToString(), context))
    assert context.code is None
    result = tritongrpc.InferResult(response)
    assert result.as_numpy("y").tolist() == [6.5] and result.as_numpy("y").dtype == np.float64
    assert response.id == "7" and response.parameters["batch_size"].int64_param == 2


@pytest.mark.parametrize("metadata", [[], [("authorization", "Bearer wrong")], [("authorization", TOKEN)]])
def test_without_the_token_every_rpc_but_health_is_unauthenticated(metadata):
    backend = Backend()
    rpcs = service(backend)
    for call, request in [
        (rpcs.model_infer, checksum_request()),
        (rpcs.server_metadata, pb.ServerMetadataRequest()),
        (rpcs.model_ready, pb.ModelReadyRequest(name="checksum")),
        (rpcs.model_metadata, pb.ModelMetadataRequest(name="checksum")),
    ]:
        context = Context(metadata)
        answer = run(call(request, context))
        assert context.code == grpc.StatusCode.UNAUTHENTICATED and "Bearer <token>" in context.details
        assert answer == type(answer)()
    assert backend.calls == []
    for call, request in [
        (rpcs.server_live, pb.ServerLiveRequest()),
        (rpcs.server_ready, pb.ServerReadyRequest()),
    ]:
        context = Context(metadata)
        assert run(call(request, context)).ListFields() and context.code is None


def test_the_scheme_is_case_insensitive_and_no_token_means_open():
    assert run(
        service(Backend()).server_metadata(
            pb.ServerMetadataRequest(), Context([("authorization", f"bearer {TOKEN}")])
        )
    )
    context = Context()
    assert (
        run(
            service(Backend(), token=None, server_version="v").server_metadata(
                pb.ServerMetadataRequest(), context
            )
        ).version
        == "v"
    )
    assert context.code is None


@pytest.mark.parametrize(
    ("request_", "code", "details"),
    [
        (
            pb.ModelInferRequest(model_name="nope"),
            grpc.StatusCode.NOT_FOUND,
            "unknown model 'nope'; models: checksum",
        ),
        (checksum_request(model_version="2"), grpc.StatusCode.NOT_FOUND, "no version '2'"),
        (pb.ModelInferRequest(model_name="checksum"), grpc.StatusCode.INVALID_ARGUMENT, "at least one input"),
    ],
)
def test_requests_refused_before_the_model_runs(request_, code, details):
    backend = Backend()
    context = Context(AUTHORIZED)
    run(service(backend).model_infer(request_, context))
    assert context.code == code and details in context.details and backend.calls == []


def test_an_unknown_output_is_refused_before_the_model_runs():
    backend = Backend()
    request = checksum_request()
    request.outputs.add(name="z")
    context = Context(AUTHORIZED)
    run(service(backend).model_infer(request, context))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and "no output 'z'" in context.details
    assert backend.calls == []


def test_a_message_over_max_body_bytes_is_refused_unparsed():
    data = checksum_request().SerializeToString()
    context = Context(AUTHORIZED)
    run(service(Backend(), max_message_bytes=len(data) - 1).model_infer(data, context))
    assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"{len(data)} bytes, over the limit of {len(data) - 1}" in context.details
    context = Context(AUTHORIZED)
    run(service(Backend(), max_message_bytes=len(data)).model_infer(data, context))
    assert context.code is None


def test_bytes_that_are_not_the_message_are_invalid_argument():
    for rpc in ("model_infer", "model_metadata", "model_ready"):
        context = Context(AUTHORIZED)
        run(getattr(service(Backend()), rpc)(b"\xff\xff\xff", context))
        assert context.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "is not a valid inference." in context.details


@pytest.mark.parametrize(("kind", "code"), sorted(CODE_OF_KIND.items(), key=lambda item: item[0].value))
def test_controller_errors_map_to_status_codes(kind, code):
    backend = Backend()
    backend.error = ControllerError(
        kind, "it went wrong", retry_after_s=2.4 if kind is ErrorKind.UNAVAILABLE else None
    )
    context = Context(AUTHORIZED)
    run(service(backend).model_infer(checksum_request(), context))
    assert context.code == code and context.details == "it went wrong"
    assert context.trailing == ([("retry-after", "2")] if kind is ErrorKind.UNAVAILABLE else [])


def test_a_collect_failed_answers_internal_with_the_controllers_message():
    """A mutating model call applied and journaled whose collect function failed: the
    client reads that it counts, not a generic internal error."""
    backend = Backend()
    message = ("checksum.forward was applied on every rank and journaled, but collecting its outputs failed "
               "(ValueError: bad shapes): it counts, and has no output")
    backend.error = ControllerError(ErrorKind.COLLECT_FAILED, message)
    context = Context(AUTHORIZED)
    run(service(backend).model_infer(checksum_request(), context))
    assert (context.code, context.details, context.trailing) == (grpc.StatusCode.INTERNAL, message, [])


def test_an_exception_the_backend_raises_propagates():
    """The backend answers errors as values; one that raises is a fault of the service,
    which Serve answers as INTERNAL and logs."""
    backend = Backend()
    backend.raises = KeyError("bug")
    with pytest.raises(KeyError):
        run(service(backend).model_infer(checksum_request(), Context(AUTHORIZED)))


def test_metadata_and_readiness():
    rpcs = service(Backend())
    meta = run(
        rpcs.model_metadata(pb.ModelMetadataRequest(name="checksum", version="1"), Context(AUTHORIZED))
    )
    assert (
        meta.name == "checksum"
        and meta.outputs[0].datatype == "FP64"
        and list(meta.inputs[0].shape) == [-1, -1, -1]
    )
    assert run(rpcs.model_ready(pb.ModelReadyRequest(name="checksum"), Context(AUTHORIZED))).ready
    context = Context(AUTHORIZED)
    run(rpcs.model_ready(pb.ModelReadyRequest(name="other"), context))
    assert context.code == grpc.StatusCode.NOT_FOUND
    assert run(rpcs.server_ready(pb.ServerReadyRequest(), Context())).ready


def test_the_proxy_registers_the_served_rpcs_and_no_other():
    """On a plain gRPC server (Serve's proxy replaces the handlers with its routes): the
    served RPCs exist, the service's others answer UNIMPLEMENTED."""
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add_inference_service(None, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = tritongrpc.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        assert "answered by the Serve ingress" in refusal(client.is_server_live)
        assert "Method not found" in refusal(lambda: client.get_inference_statistics("checksum"))
    finally:
        client.close()
        server.stop(None)
    assert set(SERVED_RPCS) == {
        "ServerLive", "ServerReady", "ServerMetadata", "ModelReady", "ModelMetadata", "ModelInfer"
    }


def refusal(call: Any) -> str:
    """The details of the UNIMPLEMENTED status a call gets."""
    with pytest.raises(tritongrpc.InferenceServerException) as refused:
        call()
    assert refused.value.status() == "StatusCode.UNIMPLEMENTED"
    return refused.value.message()

"""The RPCs of KServe v2's ``inference.GRPCInferenceService`` over the controllers: server
liveness, readiness and metadata, model readiness and metadata, and inference, with the
same models, limits and token as the HTTP routes (``hybridflow.http.routes.oip``).

Serve's gRPC proxy hands each RPC to the ingress deployment's method of the same name
(``hybridflow.serve.grpc_ingress``) with the request's bytes (``registration``) and a
context that carries the call's metadata and takes its status; those methods call
:class:`OipGrpcService`, which checks the token and the size before it parses anything.
A refused RPC answers an empty message with the status code and details set on the
context (a group that is rebuilding adds ``retry-after`` trailing metadata), never a
raised exception, so Serve logs no traceback for a client's mistake.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import grpc
import torch
from google.protobuf.message import DecodeError, Message
from tritonclient.grpc import service_pb2 as pb

from hybridflow.control.backend import Backend
from hybridflow.control.contract import ControllerError, InferResult
from hybridflow.oip_grpc.messages import (
    VERSION,
    InferCall,
    chosen_outputs,
    decode_infer_request,
    encode_infer_response,
    model_metadata_response,
)
from hybridflow.oip_grpc.status import GrpcError
from hybridflow.wire.loop_work import off_loop
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.limits import DEFAULT_LIMITS, WireLimits

Answer = TypeVar("Answer")
Request = TypeVar("Request", bound=Message)
#: A request as the proxy forwards it (its bytes), or already parsed.
Incoming = bytes | Message


class CallContext(Protocol):
    """What the RPCs use of a call's context (``ray.serve.grpc_util.RayServegRPCContext``)."""

    def invocation_metadata(self) -> Sequence[tuple[str, Any]]: ...

    def set_code(self, code: grpc.StatusCode) -> None: ...

    def set_details(self, details: str) -> None: ...

    def set_trailing_metadata(self, trailing_metadata: list[tuple[str, str]]) -> None: ...


@dataclass(frozen=True)
class GrpcSettings:
    """What the service knows: each model's output names, the token, and the bounds."""

    #: model -> its output names, in order.
    models: Mapping[str, Sequence[str]] = field(default_factory=dict)
    auth_token: str | None = None
    #: Bytes of an inference request's message, as ``max_body_bytes`` bounds an HTTP body.
    max_message_bytes: int = 1 << 30
    limits: WireLimits = DEFAULT_LIMITS
    server_name: str = "hybridflow-single-controller"
    server_version: str = ""
    extensions: tuple[str, ...] = ()


def bearer_token(metadata: Sequence[tuple[str, Any]]) -> str | None:
    """The token of the call's ``authorization: Bearer <token>`` metadata, if any."""
    for key, value in metadata:
        if key.lower() == "authorization":
            text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
            return text[7:] if text[:7].lower() == "bearer " else None
    return None


def _size(request: Incoming) -> int:
    return len(request) if isinstance(request, bytes) else request.ByteSize()


def _parse(request: Incoming, kind: type[Request]) -> Request:
    """The request as a ``kind`` message; INVALID_ARGUMENT for bytes that are not one."""
    if isinstance(request, kind):
        return request
    try:
        return kind.FromString(request)
    except (DecodeError, TypeError):
        raise GrpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request is not a valid {kind.DESCRIPTOR.full_name} message",
        ) from None


def _decode(request: pb.ModelInferRequest, limits: WireLimits) -> InferCall:
    try:
        return decode_infer_request(request, limits=limits)
    except WireError as exc:
        raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None


def _encode(call: InferCall, chosen: list[str], result: InferResult) -> pb.ModelInferResponse:
    try:
        return encode_infer_response(call.model, call.id, result.outputs, chosen, result.answer_parameters())
    except WireError as exc:
        raise GrpcError(grpc.StatusCode.INTERNAL, f"cannot encode the answer: {exc}") from None


class OipGrpcService:
    """The RPCs over ``backend`` (the controllers' backend, as the HTTP routes use it);
    each takes the request's bytes (or its parsed message). A backend's error is a
    ``ControllerError``, answered with its kind's code (``CODE_OF_KIND``)."""

    def __init__(self, backend: Backend, settings: GrpcSettings) -> None:
        self.backend = backend
        self.settings = settings

    # -- the RPCs --------------------------------------------------------------------------
    async def server_live(self, request: Incoming, context: CallContext) -> pb.ServerLiveResponse:
        """Open, like ``GET /v2/health/live``: the proxy reached a replica."""
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request: Incoming, context: CallContext) -> pb.ServerReadyResponse:
        """Open, like ``GET /v2/health/ready``: whether every group came up (readiness)."""

        async def work() -> pb.ServerReadyResponse:
            groups = await self.backend.ready()
            return pb.ServerReadyResponse(ready=bool(groups) and all(groups.values()))

        return await self._answer(context, pb.ServerReadyResponse, work)

    async def server_metadata(self, request: Incoming, context: CallContext) -> pb.ServerMetadataResponse:
        async def work() -> pb.ServerMetadataResponse:
            self._authorize(context)
            s = self.settings
            return pb.ServerMetadataResponse(
                name=s.server_name, version=s.server_version, extensions=s.extensions
            )

        return await self._answer(context, pb.ServerMetadataResponse, work)

    async def model_ready(self, request: Incoming, context: CallContext) -> pb.ModelReadyResponse:
        async def work() -> pb.ModelReadyResponse:
            self._authorize(context)
            asked = _parse(request, pb.ModelReadyRequest)
            self._model(asked.name, asked.version)
            return pb.ModelReadyResponse(ready=bool(await self.backend.model_ready(asked.name)))

        return await self._answer(context, pb.ModelReadyResponse, work)

    async def model_metadata(self, request: Incoming, context: CallContext) -> pb.ModelMetadataResponse:
        async def work() -> pb.ModelMetadataResponse:
            self._authorize(context)
            asked = _parse(request, pb.ModelMetadataRequest)
            self._model(asked.name, asked.version)
            found = await self.backend.model_metadata(asked.name)
            if isinstance(found, ControllerError):
                raise GrpcError.of(found)
            return model_metadata_response(found)

        return await self._answer(context, pb.ModelMetadataResponse, work)

    async def model_infer(self, request: Incoming, context: CallContext) -> pb.ModelInferResponse:
        return await self._answer(context, pb.ModelInferResponse, lambda: self._infer(request, context))

    # -- the steps ---------------------------------------------------------------------------
    async def _infer(self, incoming: Incoming, context: CallContext) -> pb.ModelInferResponse:
        """The token, then the size, before any byte is parsed; the model, then the
        tensors, before any model runs."""
        self._authorize(context)
        size = _size(incoming)
        if size > self.settings.max_message_bytes:
            raise GrpcError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the request is {size} bytes, over the limit of {self.settings.max_message_bytes} "
                "(max_body_bytes)",
            )
        call, chosen = await off_loop(size, self._read, incoming)  # one trip off the loop, not two
        result = await self.backend.infer(call.model, call.inputs)
        if result.error is not None:
            raise GrpcError.of(result.error)
        answer_size = sum(
            t.numel() * t.element_size() for t in result.outputs.values() if isinstance(t, torch.Tensor)
        )
        return await off_loop(answer_size, _encode, call, chosen, result)

    def _read(self, incoming: Incoming) -> tuple[InferCall, list[str]]:
        """The request parsed, its model checked, then its tensors decoded; the call and
        the outputs it asks for."""
        request = _parse(incoming, pb.ModelInferRequest)
        outputs = self._model(request.model_name, request.model_version)
        call = _decode(request, self.settings.limits)
        try:
            return call, chosen_outputs(call, outputs)
        except WireError as exc:
            raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None

    def _authorize(self, context: CallContext) -> None:
        token = self.settings.auth_token
        if not token:
            return
        given = bearer_token(context.invocation_metadata())
        if given is None or not hmac.compare_digest(given.encode(), token.encode()):
            raise GrpcError(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong bearer token: send the metadata 'authorization: Bearer <token>'",
            )

    def _model(self, name: str, version: str) -> Sequence[str]:
        """The model's output names; NOT_FOUND for a model or version it does not serve."""
        outputs = self.settings.models.get(name)
        if outputs is None:
            raise GrpcError(
                grpc.StatusCode.NOT_FOUND,
                f"unknown model {name!r:.200}; models: {', '.join(sorted(self.settings.models))}",
            )
        if version not in ("", VERSION):
            raise GrpcError(
                grpc.StatusCode.NOT_FOUND,
                f"model {name!r} has no version {version!r:.40}; versions: {VERSION}",
            )
        return outputs

    async def _answer(
        self, context: CallContext, empty: type[Answer], work: Callable[[], Awaitable[Answer]]
    ) -> Answer:
        try:
            return await work()
        except GrpcError as exc:
            return self._refuse(context, exc, empty)

    @staticmethod
    def _refuse(context: CallContext, error: GrpcError, empty: type[Answer]) -> Answer:
        context.set_code(error.code)
        context.set_details(error.message)
        trailing = error.trailing_metadata()
        if trailing:
            context.set_trailing_metadata(trailing)
        return empty()

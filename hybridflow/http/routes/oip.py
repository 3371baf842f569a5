"""The Open Inference Protocol v2: server and model metadata, readiness, and inference
(JSON, or the binary tensor data extension), as tritonclient speaks it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from hybridflow.http import oip
from hybridflow.http.auth import require_token
from hybridflow.http.body import JSON, OCTET_STREAM, media_type, read_body
from hybridflow.http.errors import ApiError
from hybridflow.http.oip_models import InferResponse, ModelMetadata, ServerMetadata
from hybridflow.http.routes.common import backend, errors, found, settings
from hybridflow.http.schemas import INFER_BODY_DOC
from hybridflow.http.settings import ModelRoute
from hybridflow.wire.loop_work import off_loop

#: Probes: they answer without a token.
probes = APIRouter(tags=["inference"])
router = APIRouter(tags=["inference"], dependencies=[Depends(require_token)])


@probes.get("/v2/health/live")
async def oip_live() -> Response:
    return Response(status_code=200)


@probes.get("/v2/health/ready", responses=errors(503))
async def oip_ready(request: Request) -> Response:
    groups = await backend(request).ready()
    return Response(status_code=200 if groups and all(groups.values()) else 503)


@router.get("/v2", response_model=ServerMetadata, responses=errors(401))
async def server_metadata() -> dict[str, Any]:
    return {"name": oip.SERVER_NAME, "version": oip.SERVER_VERSION, "extensions": oip.EXTENSIONS}


def model_route(request: Request, model: str) -> ModelRoute:
    route = settings(request).models.get(model)
    if route is None:
        raise ApiError(404, f"unknown model {model!r}; models: {', '.join(sorted(settings(request).models))}")
    return route


@router.get("/v2/models/{model}", response_model=ModelMetadata, responses=errors(401, 404, 503, 504))
async def model_metadata(model: str, request: Request) -> dict[str, Any]:
    model_route(request, model)
    return found(await backend(request).model_metadata(model))


@router.get("/v2/models/{model}/ready", responses=errors(401, 404, 503))
async def model_ready(model: str, request: Request) -> Response:
    model_route(request, model)
    return Response(status_code=200 if await backend(request).model_ready(model) else 503)


@router.post(
    "/v2/models/{model}/infer",
    responses={
        200: {"model": InferResponse, "description": "outputs (JSON, or JSON header + binary tensors)"},
        **errors(400, 401, 404, 413, 415, 503, 504),
    },
    openapi_extra=INFER_BODY_DOC,
)
async def infer(model: str, request: Request) -> Response:
    route = model_route(request, model)
    kind = media_type(request.headers.get("content-type"))
    decode = oip.INFER_BODIES.get(kind)
    if decode is None:
        raise ApiError(415, f"unsupported media type {kind!r}; send {' or '.join(filter(None, oip.INFER_BODIES))}")
    body = await read_body(request, settings(request).max_body_bytes)
    limits = settings(request).wire_limits()
    header_length = request.headers.get("inference-header-content-length")
    inference, inputs = await off_loop(
        oip.request_work(body, header_length), decode, body, header_length, limits
    )
    chosen, binary = oip.chosen_outputs(model, inference, route.outputs)
    result = await backend(request).infer(model, inputs)
    if result.error is not None:
        raise ApiError.of(result.error)
    answer, header_length = await off_loop(
        oip.answer_work(result.outputs, binary), oip.response, model, inference, chosen, binary, result.outputs,
        result.answer_parameters(),
    )
    if header_length is None:
        return Response(answer, media_type=JSON)
    return Response(
        answer, media_type=OCTET_STREAM, headers={"Inference-Header-Content-Length": str(header_length)}
    )

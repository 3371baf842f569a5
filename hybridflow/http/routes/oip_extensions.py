"""Two Open Inference Protocol extensions, as Triton defines them and tritonclient calls
them: statistics (per model and version, cumulative counts and durations kept by the
controller that serves the model) and the model repository (its index; the serve config
fixes the models, so load and unload answer 400, as Triton does when model control is
off).

Included before the core OIP router: ``/v2/models/stats`` must not be read as a model
named ``stats``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError

from hybridflow.http.auth import require_token
from hybridflow.http.body import read_body
from hybridflow.http.errors import ApiError
from hybridflow.http.oip_models import ModelStatisticsResponse, RepositoryIndexRequest, RepositoryModel
from hybridflow.http.routes.common import backend, errors, found, settings
from hybridflow.http.routes.oip import model_route
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.strict_json import loads_strict

router = APIRouter(tags=["inference"], dependencies=[Depends(require_token)])

#: The one version of every model (``versions: ["1"]`` in its metadata).
VERSION = "1"
#: An index request is ``{"ready": true}`` at most.
MAX_INDEX_BODY = 4096
READY, UNAVAILABLE = "READY", "UNAVAILABLE"


async def _statistics(request: Request, models: list[str]) -> dict[str, Any]:
    answers = await asyncio.gather(*(backend(request).model_statistics(m) for m in models))
    return {"model_stats": [found(answer) for answer in answers]}


@router.get("/v2/models/stats", response_model=ModelStatisticsResponse, responses=errors(401, 503, 504))
async def all_statistics(request: Request) -> dict[str, Any]:
    """Every model's statistics."""
    return await _statistics(request, sorted(settings(request).models))


@router.get("/v2/models/{model}/stats", response_model=ModelStatisticsResponse, responses=errors(401, 404, 503, 504))
async def model_statistics(model: str, request: Request) -> dict[str, Any]:
    """The model's statistics since its controller replica started: success and fail
    counts, cumulative queue, compute input, compute infer and compute output times."""
    model_route(request, model)
    return await _statistics(request, [model])


@router.get(
    "/v2/models/{model}/versions/{version}/stats",
    response_model=ModelStatisticsResponse,
    responses=errors(401, 404, 503, 504),
)
async def version_statistics(model: str, version: str, request: Request) -> dict[str, Any]:
    model_route(request, model)
    if version != VERSION:
        raise ApiError(404, f"model {model!r} has no version {version!r}; versions: {VERSION}")
    return await _statistics(request, [model])


def _index_request(body: bytes) -> RepositoryIndexRequest:
    if not body.strip():
        return RepositoryIndexRequest()
    try:
        return RepositoryIndexRequest.model_validate(loads_strict(body, "index request"))
    except WireError as exc:
        raise ApiError(400, str(exc)) from None
    except ValidationError as exc:
        problem = exc.errors()[0]
        where = ".".join(str(part) for part in problem["loc"]) or "body"
        raise ApiError(400, f"index request: {where}: {problem['msg']}") from None


@router.post(
    "/v2/repository/index",
    response_model=list[RepositoryModel],
    responses=errors(400, 401, 413, 415),
    openapi_extra={"requestBody": {"required": False, "content": {
        "application/json": {"schema": RepositoryIndexRequest.model_json_schema()}
    }}},
)
async def repository_index(request: Request) -> list[dict[str, Any]]:
    """Every model with its state: READY when its group is ready, else UNAVAILABLE with
    the reason. ``{"ready": true}`` lists the ready ones only."""
    wanted = _index_request(await read_body(request, MAX_INDEX_BODY))
    groups = {summary.name: summary for summary in await backend(request).describe()}
    index = []
    for name, route in sorted(settings(request).models.items()):
        group = groups.get(route.group)
        if group is None:
            state, reason = UNAVAILABLE, f"the controller of group {route.group!r} did not answer"
        elif group.status == "ready":
            state, reason = READY, ""
        else:
            state = UNAVAILABLE
            reason = f"group {route.group!r} is {group.status}" + (f": {group.last_error}" if group.last_error else "")
        if state == READY or not wanted.ready:
            index.append({"name": name, "version": VERSION, "state": state, "reason": reason})
    return index


@router.post("/v2/repository/models/{model}/load", responses=errors(400, 401, 404, 415))
async def load_model(model: str, request: Request) -> None:
    """Refused: the serve config fixes the models, and every one is loaded at start."""
    model_route(request, model)
    raise ApiError(400, f"model {model!r} is loaded from the serve config; it cannot be loaded or reloaded over HTTP")


@router.post("/v2/repository/models/{model}/unload", responses=errors(400, 401, 404, 415))
async def unload_model(model: str, request: Request) -> None:
    """Refused: the serve config fixes the models."""
    model_route(request, model)
    raise ApiError(400, f"model {model!r} is served from the serve config; it cannot be unloaded over HTTP")

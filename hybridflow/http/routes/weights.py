"""``/v1/weights``: a weight sync between two groups of one deployment, now or as a job,
and a group's weights layout and version (docs/weight-sync.md). Token-protected like
every route."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from hybridflow.control.contract import WEIGHTS_LAYOUT, WEIGHTS_SYNC, CallRequest
from hybridflow.http.auth import require_token
from hybridflow.http.body import JSON, body_kind, fingerprint, read_body
from hybridflow.http.errors import ApiError
from hybridflow.http.routes.common import MAX_IDEMPOTENCY_KEY_CHARS, backend, errors, found, jobs, settings
from hybridflow.http.routes.jobs import public
from hybridflow.http.schemas import JobStatus
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.strict_json import loads_strict

router = APIRouter(tags=["weights"], dependencies=[Depends(require_token)])

#: A sync's body names one group: anything longer is refused before it is read.
MAX_SYNC_BODY_BYTES = 4096


class WeightSyncBody(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    source: str = Field(..., alias="from", description="the group whose weights the destination takes")


class WeightSyncAnswer(BaseModel):
    group: str
    source: str = Field(..., alias="from")
    weights_version: int = Field(..., description="the destination's new weights version")
    transport: str = Field(..., description="object_store or collective")
    backend: str | None = Field(None, description="nccl or gloo, for a collective transfer")
    reason: str
    bytes_per_rank: list[int] = Field(..., description="bytes each destination rank received")
    slices_per_rank: list[int]
    full_bytes: int = Field(..., description="one full copy of the model, for comparison")
    stage_seconds: float
    commit_seconds: float
    seconds: float


class KeptSyncAnswer(BaseModel):
    version: int
    bytes: int = Field(..., description="bytes of its shard files, every rank's")
    restore_point: bool = Field(..., description="whether a rebuild of the group starts from this sync")


class KeptAnswer(BaseModel):
    bytes: int = Field(..., description="disk use of the kept shard files")
    weights_kept: int = Field(..., description="state.weights_kept: the latest syncs whose files stay in any case")
    syncs: list[KeptSyncAnswer] = Field(..., description="the syncs whose files are kept, oldest first")


class WeightsAnswer(BaseModel):
    group: str
    weights_version: int
    layout: dict[str, Any] = Field(..., description="WeightLayout.to_dict(): every rank's place and parameters")
    kept: KeptAnswer | None = Field(None, description="the synced shards kept for a rebuild (null: unreadable now)")


def _deployment(request: Request, group: str) -> str:
    deployment = settings(request).deployment_of(group)
    if deployment is None:
        raise ApiError(404, f"unknown group {group!r}; groups: {', '.join(sorted(settings(request).groups))}")
    return deployment


async def _source(request: Request) -> tuple[str, bytearray]:
    """The body's source group, and the body (400: not JSON; 422: not ``{"from": "<group>"}``)."""
    body_kind(request, (JSON,))
    body = await read_body(request, min(MAX_SYNC_BODY_BYTES, settings(request).max_body_bytes))
    try:
        value = loads_strict(body, "body", settings(request).wire_limits())
    except WireError as exc:
        raise ApiError(400, str(exc)) from None
    if not isinstance(value, dict) or set(value) != {"from"} or not isinstance(value["from"], str):
        raise ApiError(422, 'a weight sync\'s body is {"from": "<source group>"}')
    return value["from"], body


@router.post(
    "/v1/weights/{group}",
    response_model=WeightSyncAnswer,
    responses={**errors(400, 401, 404, 413, 415, 422, 503, 504), 202: {"model": JobStatus},
               429: {**errors(429)[429], "description": "limits.weight_syncs_queued syncs wait already (Retry-After)"}},
    openapi_extra={"requestBody": {"required": True, "content": {
        JSON: {"schema": WeightSyncBody.model_json_schema(by_alias=True)}}}},
)
async def sync_weights(group: str, request: Request, job: bool = False) -> Any:
    """Give ``group`` the weights of the body's ``from`` group (of the same deployment),
    resharded to its layout, under a new weights version; calls on ``group`` wait while
    the weights are swapped. With ``?job=true`` it runs as a job: 202 and its
    ``Location``. With an ``Idempotency-Key``, a repeat gets the first sync's answer.
    429 with ``Retry-After`` when ``limits.weight_syncs_queued`` syncs wait already."""
    deployment = _deployment(request, group)
    source, body = await _source(request)
    if _deployment(request, source) != deployment:
        raise ApiError(422, (
            f"{source!r} is a group of deployment {settings(request).deployment_of(source)!r} and {group!r} of "
            f"{deployment!r}: a weight sync runs between groups of one deployment"))
    key = request.headers.get("idempotency-key") or None
    if key is not None and len(key) > MAX_IDEMPOTENCY_KEY_CHARS:
        raise ApiError(400, f"Idempotency-Key has {len(key)} characters, over the limit of {MAX_IDEMPOTENCY_KEY_CHARS}")
    call = CallRequest(group, WEIGHTS_SYNC, kwargs={"from": source}, idempotency_key=key,
                       fingerprint=fingerprint(JSON, body) if key else None, operation=True)
    if job:
        started = found(await jobs(request).submit(deployment, call, 1))
        return JSONResponse(public(started), status_code=202, headers={"Location": f"/v1/jobs/{started['id']}"})
    result = await backend(request).call(call)
    if result.error is not None:
        raise ApiError.of(result.error)
    return JSONResponse(result.output)


@router.get("/v1/weights/{group}", response_model=WeightsAnswer, responses=errors(401, 404, 503, 504))
async def weights(group: str, request: Request) -> Any:
    """The group's weights version and layout: each rank's tp/dp/pp place, device, and
    parameters by logical name with full shape, dtype and split dimension; and the disk
    use of the synced shards it keeps (``kept``). 404 for a group whose worker declares no
    weights."""
    _deployment(request, group)
    result = await backend(request).call(CallRequest(group, WEIGHTS_LAYOUT, operation=True))
    if result.error is not None:
        raise ApiError.of(result.error)
    return JSONResponse(result.output)

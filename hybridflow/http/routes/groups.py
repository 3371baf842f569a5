"""``/v1/groups``: the groups, one group's ranks, and calls on a group's methods."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from hybridflow.control.contract import CallResult, GroupSummary
from hybridflow.http.auth import require_token
from hybridflow.http.call_body import call_answer_body
from hybridflow.http.errors import ApiError
from hybridflow.http.routes.common import backend, call_request, encoded, errors, found, settings
from hybridflow.http.schemas import CALL_BODY_DOC, CallResponse, GroupDetail, GroupList

router = APIRouter(tags=["groups"], dependencies=[Depends(require_token)])


def summary_json(summary: GroupSummary) -> dict[str, Any]:
    """A group as the API shows it: a Megatron group's tp/dp/pp sizes at the top level."""
    data = dataclasses.asdict(summary)
    data.update(data.pop("layout") or {})
    for key in ("ranks", "namespace", "meshes"):
        if data[key] is None:
            del data[key]
    return data


async def answer(request: Request, group: str, method: str, result: CallResult) -> Response:
    """A call's answer: its output as JSON (with the call's modes) or safetensors."""
    envelope = {
        "group": group,
        "method": method,
        "dispatch_mode": result.dispatch_mode,
        "execute_mode": result.execute_mode,
        "world_size": result.world_size,
    }
    body, media = await encoded(
        call_answer_body, result.output, envelope, request.headers.get("accept"), settings(request).wire_limits()
    )
    return Response(body, media_type=media)


@router.get("/v1/groups", response_model=GroupList, responses=errors(401))
async def list_groups(request: Request) -> dict[str, Any]:
    """Every group: name, world size, resource pool, status, methods with their modes."""
    return {"groups": [summary_json(s) for s in await backend(request).describe()]}


@router.get("/v1/groups/{group}", response_model=GroupDetail, responses=errors(401, 404, 503, 504))
async def get_group(group: str, request: Request) -> dict[str, Any]:
    """One group with per-rank details (rank, local rank, node, pid, GPU; tp/dp/pp for Megatron)."""
    return summary_json(found(await backend(request).describe_group(group)))


@router.post(
    "/v1/groups/{group}/{method}",
    response_model=CallResponse,
    responses={
        **errors(400, 401, 404, 406, 413, 415, 422, 500, 503, 504),
        200: {"content": {"application/x-safetensors": {}}, "description": "collected output"},
    },
    openapi_extra=CALL_BODY_DOC,
)
async def call_method(group: str, method: str, request: Request) -> Response:
    """Call ``method`` on ``group`` with its registered dispatch mode (a method without
    ``@register`` runs like ``execute_all_sync``: one value per rank)."""
    call = await call_request(request, group, method)
    result = await backend(request).call(call)
    if result.error is not None:
        raise ApiError.of(result.error)
    return await answer(request, group, method, result)

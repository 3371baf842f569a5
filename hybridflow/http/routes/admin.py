"""``/v1/admin``: what an operator does to one group (reset it, restart it). Token-protected
like every route."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from hybridflow.http.auth import require_token
from hybridflow.http.routes.common import backend, errors, found
from hybridflow.http.routes.groups import summary_json
from hybridflow.http.schemas import GroupBody

router = APIRouter(tags=["admin"], dependencies=[Depends(require_token)])


@router.post("/v1/admin/groups/{group}/reset", status_code=202, response_model=GroupBody,
             responses=errors(401, 404, 415, 503, 504))
async def reset_group(group: str, request: Request) -> Any:
    """Discard the group's stored state (journal, snapshot, Idempotency-Key answers) and
    rebuild it fresh, as its workers' constructor and init calls leave it; other groups
    keep theirs. The way out for a group whose stored state cannot be restored (status
    ``failed``); on a ready group it discards every acknowledged call. Answers at once:
    the group is ``rebuilding``, then ``ready`` (poll ``GET /v1/groups/{group}``)."""
    return JSONResponse(summary_json(found(await backend(request).reset_group(group))), status_code=202)


@router.post("/v1/admin/groups/{group}/restart", status_code=202, response_model=GroupBody,
             responses=errors(401, 404, 415, 503, 504))
async def restart_group(group: str, request: Request) -> Any:
    """Rebuild the group on fresh workers with its stored state: the way back for a group
    its supervision halted (``on_rank_lost: halt``, or past ``max_restarts``), and a fresh
    start for any other; its restart count starts again. Answers at once: the group is
    ``rebuilding``, then ``ready`` (poll ``GET /v1/groups/{group}``, or follow
    ``GET /v1/events``)."""
    return JSONResponse(summary_json(found(await backend(request).restart_group(group))), status_code=202)

"""Liveness and readiness probes: they answer without a token. Readiness names the groups
only to a client with the token (when one is configured): the group names are the API's."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from hybridflow.http.auth import authorized
from hybridflow.http.errors import error_response
from hybridflow.http.routes.common import backend, errors
from hybridflow.http.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, response_model_exclude_none=True)
async def healthz() -> dict[str, Any]:
    """Liveness: the ingress answers."""
    return {"status": "live"}


@router.get("/readyz", response_model=Health, response_model_exclude_none=True, responses=errors(503))
async def readyz(request: Request) -> Any:
    """Readiness: the service can serve, every group of every controller having come up
    since its controller's replica started. One group's trouble after that (restoring after
    a client's failed call, a lost worker, a halt) is in its own status and its 503s, not
    here: it takes no other group out of service. With the token (or when none is
    configured), the answer says so of each group."""
    groups = await backend(request).ready()
    detail = authorized(request)
    if groups and all(groups.values()):
        return {"status": "ready", "groups": groups} if detail else {"status": "ready"}
    if not detail:
        return error_response(503, "not ready")
    waiting = sorted(name for name, ok in groups.items() if not ok) or ["controllers"]
    return error_response(503, f"not ready: {', '.join(waiting)}")

"""Liveness and readiness probes: they answer without a token."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from hybridflow.http.errors import error_response
from hybridflow.http.routes.common import backend, errors
from hybridflow.http.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz() -> dict[str, Any]:
    """Liveness: the ingress answers."""
    return {"status": "live"}


@router.get("/readyz", response_model=Health, responses=errors(503))
async def readyz(request: Request) -> Any:
    """Readiness: every group of every controller is ready."""
    groups = await backend(request).ready()
    if groups and all(groups.values()):
        return {"status": "ready", "groups": groups}
    waiting = sorted(name for name, ok in groups.items() if not ok) or ["controllers"]
    return error_response(503, f"not ready: {', '.join(waiting)}")

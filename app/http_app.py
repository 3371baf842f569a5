"""The FastAPI application of the ingress, built around a backend (the controllers' Serve
handles in the service; anything with the same methods in tests)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from app import oip
from app.auth import require_token
from app.backend import Backend
from app.errors import install_error_handlers
from app.routes import groups, health, jobs
from app.routes import oip as oip_routes
from app.settings import IngressSettings

#: The API docs, behind the token like every route but the probes.
docs = APIRouter(include_in_schema=False, dependencies=[Depends(require_token)])


@docs.get("/openapi.json")
async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


@docs.get("/docs")
async def swagger_ui(request: Request) -> HTMLResponse:
    return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{request.app.title} - docs")


@docs.get("/redoc")
async def redoc(request: Request) -> HTMLResponse:
    return get_redoc_html(openapi_url="/openapi.json", title=f"{request.app.title} - ReDoc")


def create_app(backend: Backend, settings: IngressSettings | dict[str, Any]) -> FastAPI:
    """The HTTP API over ``backend``: health probes, groups and calls, jobs, OIP v2, docs."""
    app = FastAPI(
        title="HybridFlow single controller",
        version=oip.SERVER_VERSION,
        description="Worker groups of the verl single-controller pattern, driven over HTTP.",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.backend = backend
    app.state.settings = IngressSettings.model_validate(settings)
    install_error_handlers(app)
    for router in (health.router, oip_routes.probes, groups.router, jobs.router, oip_routes.router, docs):
        app.include_router(router)
    return app

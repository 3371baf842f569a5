"""The FastAPI application of the ingress, built around a backend (the controllers, in the
ingress's own process or behind Serve handles; anything with the same methods in tests)
and the jobs deployment."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from hybridflow.control.backend import Backend, Jobs
from hybridflow.http import oip
from hybridflow.http.errors import install_error_handlers
from hybridflow.http.login_limit import LoginLimiter
from hybridflow.http.routes import (
    admin,
    docs,
    events,
    groups,
    health,
    login,
    oip_extensions,
    status_page,
    weights,
)
from hybridflow.http.routes import jobs as job_routes
from hybridflow.http.routes import oip as oip_routes
from hybridflow.http.settings import IngressSettings


def create_app(backend: Backend, settings: IngressSettings | dict[str, Any], jobs: Jobs | None = None) -> FastAPI:
    """The HTTP API over ``backend``: health probes, groups and calls, jobs (over ``jobs``;
    404 without it), an operator's reset and restart, the event stream, weight syncs, OIP v2 with its statistics and repository extensions,
    the status page, login and docs."""
    app = FastAPI(
        title="HybridFlow single controller",
        version=oip.SERVER_VERSION,
        description="Worker groups of the verl single-controller pattern, driven over HTTP.",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.backend = backend
    app.state.jobs = jobs
    app.state.settings = IngressSettings.model_validate(settings)
    app.state.login_limiter = LoginLimiter(
        app.state.settings.login_failures_per_minute, app.state.settings.login_failures_per_minute_total
    )
    install_error_handlers(app)
    routers = (
        health.router, oip_routes.probes, groups.router, job_routes.router, admin.router, weights.router, events.router,
        oip_extensions.router,  # before the core OIP routes: /v2/models/stats is not a model
        oip_routes.router, status_page.router, login.router, docs.router,
    )
    for router in routers:
        app.include_router(router)
    return app

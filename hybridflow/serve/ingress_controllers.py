"""The ingress hosting every controller (``controllers_in_ingress: true``): one Serve hop
fewer per call. The HTTP routes and the gRPC servicer call the controllers themselves
(:class:`~hybridflow.control.controllers.Controllers`, in this process) instead of a
Serve handle to a controller replica; the controllers, their groups and their semantics
are the same (one controller per declared deployment, each with its own groups, journal,
state store and supervisor, all on this replica's event loop).

The price: the ingress replica holds every pool's bundles in one placement group (one
node), there is one ingress replica, and a restart of the ingress restarts every group
(which then restore their stored state, as a controller replica's do).
"""

from __future__ import annotations

import warnings
from typing import Any

from fastapi import FastAPI
from ray import serve

from hybridflow.control.contract import CallRequest, CallResult
from hybridflow.control.controllers import Controllers
from hybridflow.control.placement import DeploymentPlan
from hybridflow.http.app import create_app
from hybridflow.http.settings import IngressSettings
from hybridflow.serve.backend import ServeJobs
from hybridflow.serve.grpc_ingress import GrpcIngress
from hybridflow.serve.preload import load_batch_types


@serve.deployment(name="ingress", max_ongoing_requests=256)
@serve.ingress()
class ControllingIngress(GrpcIngress):
    """The ingress (HTTP, and OIP over gRPC) with every declared deployment's controller
    inside it. ``call`` serves the jobs deployment, whose pieces run here, and
    ``publish_event`` takes its job events."""

    async def __init__(
        self,
        deployments: list[dict[str, Any]],
        plans: list[DeploymentPlan],
        shifts: list[int],
        service: dict[str, Any],
        status_codes: dict[str, int],
        settings: dict[str, Any],
        jobs: Any = None,
    ) -> None:
        load_batch_types()  # no request pays their import with the loop waiting
        self.controllers = Controllers.build(deployments, plans, service, status_codes, shifts)
        self.settings = IngressSettings.model_validate(settings)
        self.jobs = None if jobs is None else ServeJobs(jobs, self.settings.request_timeout_s)
        self.serve_grpc(self.controllers, self.settings)
        warnings.filterwarnings("ignore", message="Zero-copy tensor serialization is enabled")
        await self.controllers.begin()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_app(self.controllers, self.settings, self.jobs)

    async def call(self, request: CallRequest) -> CallResult:
        return await self.controllers.call(request)

    def publish_event(self, kind: str, group: str | None, fields: dict[str, Any]) -> None:
        """The jobs deployment's ``job`` events, numbered among the groups' events."""
        self.controllers.publish_event(kind, group, fields)

    async def check_health(self) -> None:
        await self.controllers.check_health()

    def __del__(self) -> None:
        controllers = getattr(self, "controllers", None)
        if controllers is not None:
            controllers.shutdown()

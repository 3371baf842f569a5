"""The ingress hosting every controller (``controllers_in_ingress: true``): one Serve hop
fewer per call. The HTTP routes reach the controllers as objects in their own process
instead of through a Serve handle to a controller replica; the controllers, their groups
and their semantics are the same (one controller per declared deployment, each with its
own groups, journal, state store and supervisor, all on this replica's event loop).

The price: the ingress replica holds every pool's bundles in one placement group (one
node), there is one ingress replica, and a restart of the ingress restarts every group
(which then restore their stored state, as a controller replica's do).
"""

from __future__ import annotations

import asyncio
import warnings
from types import SimpleNamespace
from typing import Any

from fastapi import FastAPI
from ray import serve

from hybridflow.control.contract import CallRequest, CallResult, ControllerError, ErrorKind
from hybridflow.control.placement import DeploymentPlan
from hybridflow.http.app import create_app
from hybridflow.http.errors import ApiError
from hybridflow.http.settings import IngressSettings
from hybridflow.serve.backend import ServeBackend
from hybridflow.serve.controller import HostedController
from hybridflow.serve.grpc_ingress import GrpcIngress


class InProcessHandle:
    """A hosted controller in the shape of a Serve handle to its replica:
    ``handle.method.remote(...)`` is the coroutine ``hosted.method(...)``, so the
    ingress's backend (hybridflow.serve.backend.ServeBackend) routes to it unchanged."""

    def __init__(self, hosted: HostedController) -> None:
        self._hosted = hosted

    def __getattr__(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(remote=getattr(self._hosted, name))


@serve.deployment(name="ingress", max_ongoing_requests=256)
@serve.ingress()
class ControllingIngress(GrpcIngress):
    """The ingress (HTTP, and OIP over gRPC) with every declared deployment's controller
    inside it. ``call`` serves the jobs deployment, whose pieces run here."""

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
        self.hosted = {
            d["name"]: HostedController(d, plan, service, status_codes, bundle_shift=shift)
            for d, plan, shift in zip(deployments, plans, shifts, strict=True)
        }
        self.settings = IngressSettings.model_validate(settings)
        handles = {name: InProcessHandle(hosted) for name, hosted in self.hosted.items()}
        self.backend = ServeBackend(handles, self.settings, jobs)
        self.serve_grpc(self.backend, self.settings)
        warnings.filterwarnings("ignore", message="Zero-copy tensor serialization is enabled")
        await asyncio.gather(*(hosted.begin() for hosted in self.hosted.values()))

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_app(self.backend, self.settings)

    async def call(self, request: CallRequest) -> CallResult:
        try:
            return await self.backend.call(request)
        except ApiError as exc:  # an unknown group: the jobs deployment checked it already
            return CallResult(error=ControllerError(ErrorKind.UNKNOWN_GROUP, exc.message))

    async def check_health(self) -> None:
        await asyncio.gather(*(hosted.check_health() for hosted in self.hosted.values()))

    def __del__(self) -> None:
        for hosted in getattr(self, "hosted", {}).values():
            hosted.shutdown()

"""The ingress hosting every controller (``controllers_in_ingress: true``): one Serve hop
fewer per call. The HTTP routes reach the controllers as objects in their own process
instead of through a Serve handle to a controller replica; the controllers, their groups
and their semantics are the same (one controller per declared deployment, each with its
own groups, journal and supervisor, all on this replica's event loop).

The price: the ingress replica holds every pool's bundles, there is one ingress replica,
and a restart of the ingress restarts every group.
"""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

from fastapi import FastAPI
from ray import serve

from app.backend import ServeBackend
from app.errors import ApiError
from app.http_app import create_app
from app.settings import IngressSettings
from deployments.contract import (
    CallRequest,
    CallResult,
    ControllerError,
    ErrorKind,
    GroupSummary,
    InferResult,
)
from deployments.placement import DeploymentPlan
from deployments.served_controller import HostedController


class LocalBackend(ServeBackend):
    """The routes' backend over controllers in this process (jobs still go to the jobs
    deployment through its handle)."""

    def __init__(self, hosted: dict[str, HostedController], settings: IngressSettings, jobs: Any = None) -> None:
        super().__init__(hosted, settings, jobs)

    async def call(self, request: CallRequest) -> CallResult:
        return await self._owner(request.group).controller.call(request)

    async def describe(self) -> list[GroupSummary]:
        return [summary for hosted in self.controllers.values() for summary in hosted.controller.describe()]

    async def describe_group(self, group: str) -> GroupSummary | None:
        return await self._owner(group).controller.describe_group(group)

    async def ready(self) -> dict[str, bool]:
        status = {group: False for group in self.settings.groups}
        for hosted in self.controllers.values():
            status.update(hosted.controller.ready())
        return status

    async def model_metadata(self, model: str) -> dict[str, Any] | ControllerError:
        return await self._model_owner(model).models.metadata(model)

    async def model_ready(self, model: str) -> bool:
        return self._model_owner(model).models.ready(model)

    async def infer(self, model: str, inputs: dict[str, Any]) -> InferResult:
        return await self._model_owner(model).models.infer(model, inputs)


@serve.deployment(name="ingress", max_ongoing_requests=256)
@serve.ingress()
class ControllingIngress:
    """The HTTP ingress with every declared deployment's controller inside it; ready when
    every controller's groups are. ``call`` serves the jobs deployment."""

    async def __init__(
        self,
        deployments: list[dict[str, Any]],
        plans: list[DeploymentPlan],
        shifts: list[int],
        service: dict[str, Any],
        settings: dict[str, Any],
        jobs: Any = None,
    ) -> None:
        self.hosted = {
            d["name"]: HostedController(d, plan, service, shift)
            for d, plan, shift in zip(deployments, plans, shifts, strict=True)
        }
        self.settings = IngressSettings.model_validate(settings)
        self.backend = LocalBackend(self.hosted, self.settings, jobs)
        warnings.filterwarnings("ignore", message="Zero-copy tensor serialization is enabled")
        await asyncio.gather(*(hosted.controller.start() for hosted in self.hosted.values()))

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_app(self.backend, self.settings)

    async def call(self, request: CallRequest) -> CallResult:
        try:
            return await self.backend.call(request)
        except ApiError as exc:  # an unknown group: the jobs deployment checked it already
            return CallResult(error=ControllerError(ErrorKind.UNKNOWN_GROUP, exc.message))

    async def check_health(self) -> None:
        await asyncio.gather(*(hosted.controller.check_health() for hosted in self.hosted.values()))

    def __del__(self) -> None:
        for hosted in getattr(self, "hosted", {}).values():
            hosted.shutdown()

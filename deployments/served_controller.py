"""Where a controller meets Ray Serve: one deployment class for every declared
deployment, each replica a single controller that owns its groups."""

from __future__ import annotations

import warnings
from typing import Any

import ray
from ray import serve

from deployments.builder import PoolSet, units
from deployments.config import DeploymentConfig, ServiceConfig
from deployments.contract import CallRequest, CallResult, ControllerError, GroupSummary, InferResult
from deployments.controller import GroupController
from deployments.models import ModelServer
from deployments.placement import DeploymentPlan


class HostedController:
    """One declared deployment's controller and models, in the process that hosts them
    (its own replica, or the ingress's with ``controllers_in_ingress``)."""

    def __init__(
        self, deployment: dict[str, Any], plan: DeploymentPlan, service: dict[str, Any], bundle_shift: int = 0
    ) -> None:
        # Tensors from the ingress arrive zero-copy, read-only (deployments.application's
        # INGRESS_RUNTIME_ENV); the controller only reads and forwards them, so torch's
        # warning about non-writable arrays says nothing here.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        config = DeploymentConfig.model_validate(deployment)
        settings = ServiceConfig.model_validate({**service, "deployments": [deployment]})
        self.pools = PoolSet(plan, ray.util.get_current_placement_group(), bundle_shift)
        self.controller = GroupController(
            config,
            plan,
            units(config, plan, self.pools),
            request_timeout_s=settings.request_timeout_s,
            health_timeout_s=settings.health_timeout_s,
            limits=settings.limits,
        )
        self.models = ModelServer(config.models, self.controller)

    def shutdown(self) -> None:
        self.controller.shutdown()
        self.pools.remove()


@serve.deployment(max_ongoing_requests=256)
class ControllerDeployment:
    """A controller replica: starts its groups in ``__init__`` (the replica is ready when
    they are), answers the ingress and the jobs deployment, and gives Serve a health
    check that never waits behind calls and never fails the replica for a lost worker
    (that group is rebuilt in the background)."""

    async def __init__(self, deployment: dict[str, Any], plan: DeploymentPlan, service: dict[str, Any]) -> None:
        self.hosted = HostedController(deployment, plan, service)
        self.controller, self.models = self.hosted.controller, self.hosted.models
        await self.controller.start()

    async def call(self, request: CallRequest) -> CallResult:
        return await self.controller.call(request)

    async def describe(self) -> list[GroupSummary]:
        return self.controller.describe()

    async def describe_group(self, group: str) -> GroupSummary | None:
        return await self.controller.describe_group(group)

    async def ready(self) -> dict[str, bool]:
        return self.controller.ready()

    async def model_metadata(self, model: str) -> dict[str, Any] | ControllerError:
        return await self.models.metadata(model)

    async def model_ready(self, model: str) -> bool:
        return self.models.ready(model)

    async def infer(self, model: str, inputs: dict[str, Any]) -> InferResult:
        return await self.models.infer(model, inputs)

    async def check_health(self) -> None:
        await self.controller.check_health()

    def __del__(self) -> None:
        hosted = getattr(self, "hosted", None)
        if hosted is not None:
            hosted.shutdown()

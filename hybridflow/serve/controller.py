"""Where a controller meets Ray Serve: one deployment class for every declared
deployment, each replica a single controller that owns its groups. The same controller
can live in the ingress's replica instead (``controllers_in_ingress``,
hybridflow.serve.ingress_controllers): :class:`HostedController` is what both host."""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

import ray
from ray import serve

from hybridflow.config import DeploymentConfig, ServiceConfig
from hybridflow.control import metrics, model_statistics
from hybridflow.control.builder import PoolSet, units
from hybridflow.control.contract import (
    CallRequest,
    CallResult,
    ControllerError,
    ErrorKind,
    GroupSummary,
    InferResult,
)
from hybridflow.control.controller import GroupController
from hybridflow.control.models import ModelServer
from hybridflow.control.placement import DeploymentPlan
from single_controller.ray.tensor_transport import send_tensors_out_of_band


class HostedController:
    """One declared deployment's controller and models, in the process that hosts them,
    with the methods the ingress and the jobs deployment call on it."""

    def __init__(
        self,
        deployment: dict[str, Any],
        plan: DeploymentPlan,
        service: dict[str, Any],
        status_codes: dict[str, int] | None = None,
        bundle_shift: int = 0,
    ) -> None:
        # The HTTP status of each error kind, for the calls' ``code`` label (hybridflow.control.metrics).
        metrics.use_status_codes(status_codes or {})
        # Tensors from the ingress arrive zero-copy, read-only (hybridflow.serve.application's
        # INGRESS_RUNTIME_ENV); the controller only reads and forwards them, so torch's
        # warning about non-writable arrays says nothing here.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        # The tensors it sends on to the workers go out of band (one copy into the object
        # store instead of torch's pickling); each rank still gets a writable tensor.
        send_tensors_out_of_band()
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
            state=settings.state,
        )
        self.models = ModelServer(config.models, self.controller)
        self._starting: asyncio.Task | None = None

    async def begin(self) -> None:
        """Claim the groups' stored state (stored state that no longer fits a group raises
        an error naming it), then start the groups and restore their state in the
        background: until a group is ready its calls answer 503 with Retry-After."""
        await self.controller.open()
        self._starting = asyncio.get_running_loop().create_task(self.controller.start())
        # A unit that fails to start is FAILED and retried by the health check; the
        # exception is logged there, so it is only retrieved here.
        self._starting.add_done_callback(lambda task: task.cancelled() or task.exception())

    async def call(self, request: CallRequest) -> CallResult:
        return await self.controller.call(request)

    async def describe(self) -> list[GroupSummary]:
        return self.controller.describe()

    async def describe_group(self, group: str) -> GroupSummary | None:
        return await self.controller.describe_group(group)

    async def reset_group(self, group: str) -> GroupSummary | None:
        """An operator's reset of one group (``POST /v1/admin/groups/{group}/reset``)."""
        return self.controller.reset_group(group)

    async def ready(self) -> dict[str, bool]:
        return self.controller.ready()

    async def model_metadata(self, model: str) -> dict[str, Any] | ControllerError:
        return await self.models.metadata(model)

    async def model_ready(self, model: str) -> bool:
        return self.models.ready(model)

    async def infer(self, model: str, inputs: dict[str, Any]) -> InferResult:
        return await self.models.infer(model, inputs)

    async def model_statistics(self, model: str) -> dict[str, Any] | ControllerError:
        """The model's cumulative statistics, as Triton's statistics extension reports them."""
        if model not in self.models.models:
            return ControllerError(ErrorKind.UNKNOWN_MODEL, f"unknown model {model!r}")
        return model_statistics.of(model).as_triton()

    async def check_health(self) -> None:
        await self.controller.check_health()
        metrics.sample_groups(self.controller)

    def shutdown(self) -> None:
        self.controller.shutdown()
        self.pools.remove()


@serve.deployment(max_ongoing_requests=256)
class ControllerDeployment(HostedController):
    """A controller replica: claims its groups' stored state in ``__init__`` (stored state
    that no longer fits a group fails the replica with an error naming it), then starts
    the groups and restores their state in the background, so a replica that Serve
    restarts answers at once: 503 with Retry-After for a group until it is ready. It
    answers the ingress and the jobs deployment, and gives Serve a health check that
    never waits behind calls and never fails the replica for a lost worker (that group
    is rebuilt in the background)."""

    async def __init__(
        self,
        deployment: dict[str, Any],
        plan: DeploymentPlan,
        service: dict[str, Any],
        status_codes: dict[str, int] | None = None,
    ) -> None:
        super().__init__(deployment, plan, service, status_codes)
        await self.begin()

    def __del__(self) -> None:
        if getattr(self, "controller", None) is not None:
            self.shutdown()

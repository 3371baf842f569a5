"""The controllers of one process, as the :class:`~hybridflow.control.backend.Backend` the
fronts call: each declared deployment's :class:`GroupController` with its models, reached
by the name of a group or a model. The ingress replica holds one over every declared
deployment (the embedded layout); a controller replica holds one over its own.
"""

from __future__ import annotations

import asyncio
import logging
import warnings
from collections.abc import AsyncIterator
from typing import Any

import ray

from hybridflow.config import DeploymentConfig, LimitsConfig, ServiceConfig
from hybridflow.control import metrics
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
from hybridflow.control.events import KINDS, Event, EventBus, EventStream, parse_since
from hybridflow.control.placement import DeploymentPlan
from hybridflow.control.transport import resolve_transports
from single_controller.ray.tensor_transport import send_tensors_out_of_band

logger = logging.getLogger(__name__)


def _unknown_group(group: str, known: Any) -> ControllerError:
    return ControllerError(ErrorKind.UNKNOWN_GROUP, f"unknown group {group!r}; groups: {', '.join(sorted(known))}")


def _unknown_model(model: str, known: Any) -> ControllerError:
    return ControllerError(ErrorKind.UNKNOWN_MODEL, f"unknown model {model!r}; models: {', '.join(sorted(known))}")


class Controllers:
    """Every controller this process hosts, answering for their groups and models."""

    def __init__(
        self, controllers: list[GroupController], pools: list[PoolSet] | None = None, events: EventBus | None = None
    ) -> None:
        self.controllers = {controller.deployment.name: controller for controller in controllers}
        #: The events of every hosted controller's groups, numbered in one sequence.
        self.events_bus = events or (controllers[0].events if len(controllers) == 1 else EventBus())
        #: group -> its controller; model -> its controller.
        self.group_owner = {group: c for c in controllers for group in c.groups}
        self.model_owner = {model: c for c in controllers for model in c.models.models}
        self.pools = pools or []
        self._starting: list[asyncio.Task] = []

    @classmethod
    def build(
        cls,
        deployments: list[dict[str, Any]],
        plans: list[DeploymentPlan],
        service: dict[str, Any],
        status_codes: dict[str, int] | None = None,
        shifts: list[int] | None = None,
    ) -> Controllers:
        """The controllers of ``deployments`` (their configs as JSON), each over its plan's
        pools; ``shifts``: where each plan's bundles start in this replica's placement
        group, when it holds several deployments' pools."""
        # The HTTP status of each error kind, for the calls' ``code`` label (hybridflow.control.metrics).
        metrics.use_status_codes(status_codes or {})
        # Tensors decoded from a request are read-only views where the body allows it; the
        # controller only reads and forwards them, so torch's warning says nothing here.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        # Tensors sent to the ranks go out of band (one copy into the object store instead
        # of torch's pickling); each rank still gets a writable tensor.
        send_tensors_out_of_band()
        placement_group = ray.util.get_current_placement_group()
        configs = [DeploymentConfig.model_validate(deployment) for deployment in deployments]
        transports = resolve_transports(configs)
        events = EventBus(LimitsConfig.model_validate(service.get("limits") or {}).events_kept)
        controllers, pool_sets = [], []
        for index, (deployment, config, plan) in enumerate(zip(deployments, configs, plans, strict=True)):
            settings = ServiceConfig.model_validate({**service, "deployments": [deployment]})
            pools = PoolSet(plan, placement_group, shifts[index] if shifts else 0)
            controllers.append(GroupController(
                config, plan, units(config, plan, pools),
                request_timeout_s=settings.request_timeout_s,
                health_timeout_s=settings.health_timeout_s,
                limits=settings.limits,
                state=settings.state,
                transports=transports,
                events=events,
            ))
            pool_sets.append(pools)
        return cls(controllers, pool_sets, events)

    async def begin(self) -> None:
        """Claim every group's stored state (stored state that no longer fits a group
        raises an error naming it), then start the groups and restore their state in the
        background: until a group is ready its calls answer 503 with Retry-After."""
        await asyncio.gather(*(controller.open() for controller in self.controllers.values()))
        loop = asyncio.get_running_loop()
        for controller in self.controllers.values():
            task = loop.create_task(controller.start())
            # A unit that fails to start is FAILED (the health check decides what next);
            # the supervisor logged it, so the exception is only retrieved here.
            task.add_done_callback(lambda done: done.cancelled() or done.exception())
            self._starting.append(task)

    # -- the Backend --------------------------------------------------------------------
    async def call(self, request: CallRequest) -> CallResult:
        owner = self.group_owner.get(request.group)
        if owner is None:
            return CallResult(error=_unknown_group(request.group, self.group_owner))
        return await owner.call(request)

    async def infer(self, model: str, inputs: dict[str, Any]) -> InferResult:
        owner = self.model_owner.get(model)
        if owner is None:
            return InferResult(error=_unknown_model(model, self.model_owner))
        return await owner.models.infer(model, inputs)

    async def describe(self) -> list[GroupSummary]:
        return [summary for controller in self.controllers.values() for summary in controller.describe()]

    async def describe_group(self, group: str) -> GroupSummary | ControllerError:
        owner = self.group_owner.get(group)
        if owner is None:
            return _unknown_group(group, self.group_owner)
        return await owner.describe_group(group)

    async def reset_group(self, group: str) -> GroupSummary | ControllerError:
        """An operator's reset of one group (``POST /v1/admin/groups/{group}/reset``)."""
        owner = self.group_owner.get(group)
        if owner is None:
            return _unknown_group(group, self.group_owner)
        return owner.reset_group(group)

    async def restart_group(self, group: str) -> GroupSummary | ControllerError:
        """An operator's restart of one group with its state (``POST /v1/admin/groups/{group}/restart``)."""
        owner = self.group_owner.get(group)
        if owner is None:
            return _unknown_group(group, self.group_owner)
        return owner.restart_group(group)

    async def events(self, since: str | None, group: str | None) -> EventStream | ControllerError:
        """The groups' events after ``since`` (a ``Last-Event-ID``; None: from now on),
        of ``group`` only when given (``GET /v1/events``)."""
        try:
            after = parse_since(since)
        except ValueError as exc:
            return ControllerError(ErrorKind.BAD_ARGUMENTS, str(exc))
        if group is not None and group not in self.group_owner:
            return _unknown_group(group, self.group_owner)
        # from now on means after the latest event now, not when the stream is first read
        after = self.events_bus.last_id if after is None else after
        return EventStream(after, self.stream_events(after, group))

    async def stream_events(self, since: int | None, group: str | None) -> AsyncIterator[Event]:
        """:meth:`events` as an async generator (what a Serve handle streams)."""
        subscription = self.events_bus.subscribe(since, group)
        try:
            async for event in subscription:
                yield event
        finally:
            subscription.close()

    def last_event_id(self) -> int:
        """The id of the latest event (0: none yet): where a stream from now on starts."""
        return self.events_bus.last_id

    def publish_event(self, kind: str, group: str | None, fields: dict[str, Any]) -> None:
        """An event from elsewhere in the service (the jobs deployment's ``job`` events)."""
        if kind in KINDS:
            self.events_bus.publish(kind, group, **fields)

    async def ready(self) -> dict[str, bool]:
        return {group: ok for controller in self.controllers.values() for group, ok in controller.ready().items()}

    async def model_metadata(self, model: str) -> dict[str, Any] | ControllerError:
        owner = self.model_owner.get(model)
        if owner is None:
            return _unknown_model(model, self.model_owner)
        return await owner.models.metadata(model)

    async def model_ready(self, model: str) -> bool:
        owner = self.model_owner.get(model)
        return owner is not None and owner.models.ready(model)

    async def model_statistics(self, model: str) -> dict[str, Any] | ControllerError:
        """The model's cumulative statistics, as Triton's statistics extension reports them."""
        owner = self.model_owner.get(model)
        if owner is None:
            return _unknown_model(model, self.model_owner)
        return owner.models.statistics(model)

    # -- the hosting replica's --------------------------------------------------------------
    async def check_health(self) -> None:
        """Serve's health check of the hosting replica: every controller looks at its
        groups (never failing the replica for a lost worker: that group is rebuilt)."""
        await asyncio.gather(*(controller.check_health() for controller in self.controllers.values()))
        for controller in self.controllers.values():
            metrics.sample_groups(controller)

    def shutdown(self) -> None:
        for task in self._starting:
            task.cancel()
        for controller in self.controllers.values():
            controller.shutdown()
        for pools in self.pools:
            pools.remove()

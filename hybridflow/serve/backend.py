"""The routes' :class:`~hybridflow.http.backend.Backend` over Serve deployment handles:
each call goes to the deployment the static route table names (one hop)."""

from __future__ import annotations

import asyncio
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

from hybridflow.control.contract import CallRequest, CallResult, ControllerError, GroupSummary, InferResult
from hybridflow.http.errors import ApiError
from hybridflow.http.settings import IngressSettings

#: What a call raises when the controller replica it went to died (or is gone).
CONTROLLER_GONE = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)
#: Seconds a client is told to wait while Serve restarts a controller replica.
RESTART_RETRY_AFTER_S = 5


class ServeBackend:
    """Calls on the controller deployments' handles, routed by the static table."""

    def __init__(self, controllers: dict[str, Any], settings: IngressSettings, jobs: Any = None) -> None:
        self.controllers = controllers
        self.settings = settings
        self.jobs = jobs

    async def _within_deadline(self, awaitable: Any, what: str) -> Any:
        # The controller enforces the request timeout on the workers; this margin only
        # catches a controller that does not answer at all.
        try:
            return await asyncio.wait_for(awaitable, timeout=self.settings.request_timeout_s + 10)
        except TimeoutError:
            raise ApiError(504, f"{what} did not answer within {self.settings.request_timeout_s:g} s") from None
        except CONTROLLER_GONE as exc:
            # The controller replica died under the request; Serve starts another, which
            # restores its groups from the state store (unless it failed to deploy at all).
            state = "failed to start (see serve run's output)" if isinstance(
                exc, DeploymentUnavailableError) else "is restarting"
            raise ApiError(
                503, f"the controller of {what} {state} ({type(exc).__name__}); retry shortly",
                {"Retry-After": str(RESTART_RETRY_AFTER_S)},
            ) from None

    def _owner(self, group: str) -> Any:
        name = self.settings.deployment_of(group)
        if name is None or name not in self.controllers:
            known = ", ".join(sorted(self.settings.groups))
            raise ApiError(404, f"unknown group {group!r}; groups: {known}")
        return self.controllers[name]

    async def _each(self, method: str) -> list[Any]:
        """Ask every controller at once; one that fails or is slow answers None, so the
        others' groups keep being served."""
        calls = [self._within_deadline(getattr(h, method).remote(), n) for n, h in self.controllers.items()]
        results = await asyncio.gather(*calls, return_exceptions=True)
        return [None if isinstance(r, BaseException) else r for r in results]

    async def call(self, request: CallRequest) -> CallResult:
        handle = self._owner(request.group)
        return await self._within_deadline(handle.call.remote(request), f"{request.group}.{request.method}")

    async def describe(self) -> list[GroupSummary]:
        return [summary for answer in await self._each("describe") if answer for summary in answer]

    async def describe_group(self, group: str) -> GroupSummary | None:
        return await self._within_deadline(self._owner(group).describe_group.remote(group), group)

    async def reset_group(self, group: str) -> GroupSummary | None:
        return await self._within_deadline(self._owner(group).reset_group.remote(group), group)

    async def ready(self) -> dict[str, bool]:
        status = {group: False for group in self.settings.groups}
        for answer in await self._each("ready"):
            status.update(answer or {})
        return status

    def _model_owner(self, model: str) -> Any:
        route = self.settings.models.get(model)
        if route is None or route.deployment not in self.controllers:
            raise ApiError(404, f"unknown model {model!r}; models: {', '.join(sorted(self.settings.models))}")
        return self.controllers[route.deployment]

    async def model_metadata(self, model: str) -> dict[str, Any] | ControllerError:
        return await self._within_deadline(self._model_owner(model).model_metadata.remote(model), model)

    async def model_ready(self, model: str) -> bool:
        return await self._within_deadline(self._model_owner(model).model_ready.remote(model), model)

    async def infer(self, model: str, inputs: dict[str, Any]) -> InferResult:
        return await self._within_deadline(self._model_owner(model).infer.remote(model, inputs), model)

    async def model_statistics(self, model: str) -> dict[str, Any] | ControllerError:
        return await self._within_deadline(self._model_owner(model).model_statistics.remote(model), model)

    # -- jobs -----------------------------------------------------------------------------
    def _jobs(self) -> Any:
        if self.jobs is None:
            raise ApiError(404, "jobs are not enabled in this deployment")
        return self.jobs

    async def submit_job(self, request: CallRequest, split: int) -> dict[str, Any] | ControllerError:
        owner = self.settings.deployment_of(request.group)
        self._owner(request.group)
        return await self._within_deadline(self._jobs().submit.remote(owner, request, split), "jobs")

    async def job(self, job_id: str, action: str = "status") -> dict[str, Any] | None:
        return await self._within_deadline(getattr(self._jobs(), action).remote(job_id), "jobs")

    async def list_jobs(self) -> list[dict[str, Any]]:
        return await self._within_deadline(self._jobs().list_jobs.remote(), "jobs")

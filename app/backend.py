"""The ingress's view of the controllers: which deployment owns which group, and calls
to them with a deadline. Knows Serve handles, not HTTP."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from app.errors import ApiError
from app.settings import ServiceSettings

#: How long the group map may be reused before it is asked for again.
GROUP_MAP_TTL_S = 30.0


class Backend:
    def __init__(self, controllers: dict[str, Any], settings: ServiceSettings, jobs: Any = None) -> None:
        self.controllers = controllers
        self.settings = settings
        self.jobs = jobs
        self._group_owner: dict[str, str] = {}
        self._group_map_at = 0.0
        self._io_specs: dict[tuple[str, str, str], dict[str, Any]] = {}

    async def _within_deadline(self, awaitable: Any, what: str) -> Any:
        # The controller enforces the request timeout on the workers; this margin only
        # catches a controller that does not answer at all.
        try:
            return await asyncio.wait_for(awaitable, timeout=self.settings.request_timeout_s + 10)
        except TimeoutError:
            raise ApiError(504, f"{what} did not answer within {self.settings.request_timeout_s:g} s") from None

    async def describe(self) -> list[dict[str, Any]]:
        names = list(self.controllers)
        results = await asyncio.gather(
            *(self._within_deadline(self.controllers[n].handle_describe.remote(), n) for n in names)
        )
        groups = []
        for name, summaries in zip(names, results, strict=True):
            for summary in summaries:
                self._group_owner[summary["name"]] = name
                groups.append(summary)
        self._group_map_at = time.monotonic()
        return groups

    async def owner_of(self, group: str) -> str:
        if group not in self._group_owner or time.monotonic() - self._group_map_at > GROUP_MAP_TTL_S:
            await self.describe()
        owner = self._group_owner.get(group)
        if owner is None:
            raise ApiError(404, f"unknown group {group!r}; groups: {', '.join(sorted(self._group_owner))}")
        return owner

    async def describe_group(self, group: str) -> dict[str, Any]:
        owner = await self.owner_of(group)
        detail = await self._within_deadline(self.controllers[owner].handle_describe_group.remote(group), group)
        if detail is None:
            raise ApiError(404, f"unknown group {group!r}")
        return detail

    async def call(
        self, group: str, method: str, args: list, kwargs: dict, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        """The controller's outcome on success; ApiError with its status otherwise."""
        owner = await self.owner_of(group)
        handle = self.controllers[owner]
        outcome = await self._within_deadline(
            handle.handle_call.remote(group, method, args, kwargs, idempotency_key), f"{group}.{method}"
        )
        if outcome["status"] >= 400:
            headers = {}
            if outcome.get("retry_after_s"):
                headers["Retry-After"] = str(max(1, round(outcome["retry_after_s"])))
            raise ApiError(outcome["status"], outcome["error"] or "call failed", headers)
        return outcome

    async def ready(self) -> dict[str, bool]:
        results = await asyncio.gather(
            *(self._within_deadline(h.handle_ready.remote(), n) for n, h in self.controllers.items()),
            return_exceptions=True,
        )
        status: dict[str, bool] = {}
        for name, result in zip(self.controllers, results, strict=True):
            if isinstance(result, BaseException):
                status[name] = False
            else:
                status.update(result)
        return status

    async def io_spec(self, controller: str, group: str, method: str, fresh: bool = False) -> dict[str, Any]:
        """A model's inputs and outputs. Kept between calls, so an inference call costs
        one hop to the controller, not two; ``fresh`` asks the controller again (the
        ingress does when an input does not fit the kept one: the layer may have been
        re-initialised with another size)."""
        key = (controller, group, method)
        if fresh or key not in self._io_specs:
            handle = self.controllers[controller]
            spec = await self._within_deadline(handle.handle_io_spec.remote(group, method), controller)
            if not spec:
                return spec  # not an inference model: nothing to keep
            self._io_specs[key] = spec
        return self._io_specs[key]

    # -- jobs -----------------------------------------------------------------------
    def _jobs(self) -> Any:
        if self.jobs is None:
            raise ApiError(404, "jobs are not enabled in this deployment")
        return self.jobs

    async def submit_job(self, group: str, method: str, args: list, kwargs: dict, split: int) -> dict[str, Any]:
        owner = await self.owner_of(group)
        job = await self._within_deadline(self._jobs().submit.remote(owner, group, method, args, kwargs, split), "jobs")
        if "id" not in job:  # refused before it was queued
            raise ApiError(422, job["error"])
        return job

    async def job(self, job_id: str, action: str = "status") -> dict[str, Any]:
        jobs = self._jobs()
        answer = await self._within_deadline(getattr(jobs, action).remote(job_id), "jobs")
        if answer is None:
            raise ApiError(404, f"unknown job {job_id!r}")
        return answer

    async def list_jobs(self) -> list[dict[str, Any]]:
        return await self._within_deadline(self._jobs().list_jobs.remote(), "jobs")

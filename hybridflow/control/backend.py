"""What the fronts (the HTTP routes, the gRPC servicer) call: the :class:`Backend` of the
controllers and the :class:`Jobs` of the jobs deployment, typed messages in and out.

One error vocabulary below the fronts: nothing here raises for a request that cannot be
served. A failure is a :class:`~hybridflow.control.contract.ControllerError` (its
``ErrorKind`` says why), inside a ``CallResult`` or ``InferResult`` or in place of the
answer; each front turns a kind into its status code once (``hybridflow.http.errors.STATUS_OF``,
``hybridflow.oip_grpc.status.CODE_OF_KIND``).

Two implementations: :class:`hybridflow.control.controllers.Controllers`, the controllers
themselves in the front's own process (the embedded layout), and
``hybridflow.serve.backend.ServeBackend``, Serve handles to controllers in replicas of
their own (a replica that died or did not answer is an ``UNAVAILABLE`` or ``TIMEOUT``).
"""

from __future__ import annotations

from typing import Any, Protocol

from hybridflow.control.contract import CallRequest, CallResult, ControllerError, GroupSummary, InferResult
from hybridflow.control.events import EventStream


class Backend(Protocol):
    async def call(self, request: CallRequest) -> CallResult: ...

    async def infer(self, model: str, inputs: dict[str, Any]) -> InferResult: ...

    async def describe(self) -> list[GroupSummary]: ...

    async def describe_group(self, group: str) -> GroupSummary | ControllerError: ...

    async def reset_group(self, group: str) -> GroupSummary | ControllerError: ...

    async def restart_group(self, group: str) -> GroupSummary | ControllerError: ...

    async def events(self, since: str | None, group: str | None) -> EventStream | ControllerError:
        """The events after ``since`` (a ``Last-Event-ID`` as this backend numbers them;
        None: from now on), of ``group`` only when given; BAD_ARGUMENTS for an id it does
        not give, UNKNOWN_GROUP for a group it does not serve."""
        ...

    async def ready(self) -> dict[str, bool]: ...

    async def model_metadata(self, model: str) -> dict[str, Any] | ControllerError: ...

    async def model_ready(self, model: str) -> bool: ...

    async def model_statistics(self, model: str) -> dict[str, Any] | ControllerError: ...


class Jobs(Protocol):
    """Long calls run in the background (``hybridflow.serve.jobs``): each answer is a job
    as ``Job.describe`` gives it, None for an unknown job, or the error."""

    async def submit(self, controller: str, request: CallRequest, split: int) -> dict[str, Any] | ControllerError: ...

    async def status(self, job_id: str) -> dict[str, Any] | None | ControllerError: ...

    async def result(self, job_id: str) -> dict[str, Any] | None | ControllerError: ...

    async def cancel(self, job_id: str) -> dict[str, Any] | None | ControllerError: ...

    async def list_jobs(self) -> list[dict[str, Any]] | ControllerError: ...

"""The fronts' backend where the controllers live in replicas of their own: Serve handles
to the controller deployments (:class:`ServeBackend`) and to the jobs deployment
(:class:`ServeJobs`). Each request is one hop, to the deployment the static route table
names. A replica that died under a request answers ``UNAVAILABLE`` with ``Retry-After``
(Serve starts another, which restores its groups), one that does not answer within the
request timeout and a margin ``TIMEOUT``: the same vocabulary as the controllers' own
answers (``hybridflow.control.backend``)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

from hybridflow.control.contract import (
    CallRequest,
    CallResult,
    ControllerError,
    ErrorKind,
    GroupSummary,
    InferResult,
)
from hybridflow.control.events import EVENTS_LOST, SUBSCRIBER_QUEUE, Event, EventStream
from hybridflow.http.settings import IngressSettings

T = TypeVar("T")

#: What a call raises when the replica it went to died (or is gone).
REPLICA_GONE = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)
#: Seconds a client is told to wait while Serve restarts a replica.
RESTART_RETRY_AFTER_S = 5.0
#: Seconds past the request timeout before a replica that has not answered is given up:
#: the controller enforces the timeout on the workers, this only catches one that hangs.
DEADLINE_MARGIN_S = 10.0


async def within_deadline(answer: Awaitable[T], what: str, timeout_s: float) -> T | ControllerError:
    """``answer``, or the error a front reports when its replica died or hangs."""
    try:
        return await asyncio.wait_for(answer, timeout=timeout_s + DEADLINE_MARGIN_S)
    except TimeoutError:
        return ControllerError(ErrorKind.TIMEOUT, f"{what} did not answer within {timeout_s:g} s")
    except REPLICA_GONE as exc:
        state = "failed to start (see serve run's output)" if isinstance(
            exc, DeploymentUnavailableError) else "is restarting"
        return ControllerError(
            ErrorKind.UNAVAILABLE, f"the replica of {what} {state} ({type(exc).__name__}); retry shortly",
            RESTART_RETRY_AFTER_S,
        )


def event_cursor(text: str | None, controllers: int) -> list[int] | None:
    """A ``Last-Event-ID`` where controllers run in replicas of their own: for each
    controller, in the config's order, the id of its latest event the client got,
    joined by dots (a plain number with one controller); ``0`` alone is every event kept.
    None for none given."""
    if text is None or not text.strip():
        return None
    if text.strip() == "0":
        return [0] * controllers
    parts = text.strip().split(".")
    if len(parts) != controllers or not all(p.isdigit() and len(p) <= 18 for p in parts):
        raise ValueError(f"Last-Event-ID {text[:60]!r} is not an event id of this service ({controllers} numbers "
                         "joined by dots, one per controller)")
    return [int(p) for p in parts]


def cursor_id(position: dict[str, int]) -> str | int:
    values = list(position.values())
    return values[0] if len(values) == 1 else ".".join(map(str, values))


class ServeBackend:
    """The controllers' methods on their deployments' handles, routed by the static table."""

    def __init__(self, controllers: dict[str, Any], settings: IngressSettings) -> None:
        self.controllers = controllers
        self.settings = settings

    def _group_owner(self, group: str) -> Any:
        return self.controllers.get(self.settings.deployment_of(group) or "")

    def _model_owner(self, model: str) -> Any:
        route = self.settings.models.get(model)
        return None if route is None else self.controllers.get(route.deployment)

    def _unknown(self, kind: ErrorKind, name: str) -> ControllerError:
        what, known = ("group", self.settings.groups) if kind is ErrorKind.UNKNOWN_GROUP else ("model", self.settings.models)
        return ControllerError(kind, f"unknown {what} {name!r}; {what}s: {', '.join(sorted(known))}")

    async def _on(self, owner: Any, method: str, what: str, *args: Any) -> Any:
        return await within_deadline(getattr(owner, method).remote(*args), what, self.settings.request_timeout_s)

    async def _each(self, method: str) -> list[Any]:
        """Ask every controller at once; one that fails or is slow answers None, so the
        others' groups keep being served."""
        answers = await asyncio.gather(
            *(self._on(handle, method, name) for name, handle in self.controllers.items()), return_exceptions=True
        )
        return [None if isinstance(a, (BaseException, ControllerError)) else a for a in answers]

    async def call(self, request: CallRequest) -> CallResult:
        owner = self._group_owner(request.group)
        if owner is None:
            return CallResult(error=self._unknown(ErrorKind.UNKNOWN_GROUP, request.group))
        answer = await self._on(owner, "call", f"{request.group}.{request.method}", request)
        return CallResult(error=answer) if isinstance(answer, ControllerError) else answer

    async def infer(self, model: str, inputs: dict[str, Any]) -> InferResult:
        owner = self._model_owner(model)
        if owner is None:
            return InferResult(error=self._unknown(ErrorKind.UNKNOWN_MODEL, model))
        answer = await self._on(owner, "infer", model, model, inputs)
        return InferResult(error=answer) if isinstance(answer, ControllerError) else answer

    async def describe(self) -> list[GroupSummary]:
        return [summary for answer in await self._each("describe") if answer for summary in answer]

    async def describe_group(self, group: str) -> GroupSummary | ControllerError:
        owner = self._group_owner(group)
        if owner is None:
            return self._unknown(ErrorKind.UNKNOWN_GROUP, group)
        return await self._on(owner, "describe_group", group, group)

    async def reset_group(self, group: str) -> GroupSummary | ControllerError:
        owner = self._group_owner(group)
        if owner is None:
            return self._unknown(ErrorKind.UNKNOWN_GROUP, group)
        return await self._on(owner, "reset_group", group, group)

    async def restart_group(self, group: str) -> GroupSummary | ControllerError:
        owner = self._group_owner(group)
        if owner is None:
            return self._unknown(ErrorKind.UNKNOWN_GROUP, group)
        return await self._on(owner, "restart_group", group, group)

    async def events(self, since: str | None, group: str | None) -> EventStream | ControllerError:
        """Every controller's events merged, each with the id ``n1.n2...`` (see
        :func:`event_cursor`): any ingress replica resumes a stream from it."""
        names = list(self.controllers)
        try:
            cursor = event_cursor(since, len(names))
        except ValueError as exc:
            return ControllerError(ErrorKind.BAD_ARGUMENTS, str(exc))
        followed = names
        if group is not None:
            owner = self.settings.deployment_of(group)
            if owner not in self.controllers:
                return self._unknown(ErrorKind.UNKNOWN_GROUP, group)
            followed = [owner]
        if cursor is None:  # from now on: after each controller's latest event
            answers = [await self._on(self.controllers[name], "last_event_id", name) for name in names]
            failed = next((a for a in answers if isinstance(a, ControllerError)), None)
            if failed is not None:
                return failed
            cursor = [int(a) for a in answers]
        position = dict(zip(names, cursor, strict=True))
        return EventStream(cursor_id(position), self._merged(position, followed, group))

    async def _merged(self, position: dict[str, int], followed: list[str], group: str | None) -> AsyncIterator[Event]:
        """The events of the ``followed`` controllers as they come, ids made from
        ``position`` (each controller's latest id given). A controller whose stream ends
        (its replica restarted, or it dropped this reader) ends the merged stream: the
        client resumes from the last id it got. Bounded like a controller's own readers."""
        queue: asyncio.Queue[tuple[str, Event | None]] = asyncio.Queue()
        behind = False

        async def follow(name: str) -> None:
            nonlocal behind
            try:
                stream = self.controllers[name].options(stream=True).stream_events.remote(position[name], group)
                async for event in stream:
                    if queue.qsize() >= SUBSCRIBER_QUEUE:  # the client reads too slowly: never waited for
                        behind = True
                        break
                    queue.put_nowait((name, event))
            except Exception:  # the replica went away: the client resumes
                pass
            finally:
                queue.put_nowait((name, None))

        followers = [asyncio.create_task(follow(name)) for name in followed]
        try:
            while True:
                name, event = await queue.get()
                if event is None:
                    if behind:
                        yield Event(None, EVENTS_LOST, None, round(time.time(), 3),
                                    {"dropped": None, "reason": "the reader fell behind; resume with Last-Event-ID"})
                    return
                given = isinstance(event.id, int)
                if given:
                    position[name] = event.id
                yield dataclasses.replace(event, id=cursor_id(position) if given else None)
                if event.kind == EVENTS_LOST and not given:
                    return  # its controller dropped this reader
        finally:
            for follower in followers:
                follower.cancel()

    async def ready(self) -> dict[str, bool]:
        status = {group: False for group in self.settings.groups}
        for answer in await self._each("ready"):
            status.update(answer or {})
        return status

    async def model_metadata(self, model: str) -> dict[str, Any] | ControllerError:
        owner = self._model_owner(model)
        if owner is None:
            return self._unknown(ErrorKind.UNKNOWN_MODEL, model)
        return await self._on(owner, "model_metadata", model, model)

    async def model_ready(self, model: str) -> bool:
        owner = self._model_owner(model)
        return owner is not None and await self._on(owner, "model_ready", model, model) is True

    async def model_statistics(self, model: str) -> dict[str, Any] | ControllerError:
        owner = self._model_owner(model)
        if owner is None:
            return self._unknown(ErrorKind.UNKNOWN_MODEL, model)
        return await self._on(owner, "model_statistics", model, model)


class ServeJobs:
    """The jobs deployment's methods on its handle (``hybridflow.control.backend.Jobs``)."""

    def __init__(self, handle: Any, timeout_s: float) -> None:
        self.handle = handle
        self.timeout_s = timeout_s

    async def _on(self, method: str, *args: Any) -> Any:
        return await within_deadline(getattr(self.handle, method).remote(*args), "jobs", self.timeout_s)

    async def submit(self, controller: str, request: CallRequest, split: int) -> dict[str, Any] | ControllerError:
        return await self._on("submit", controller, request, split)

    async def status(self, job_id: str) -> dict[str, Any] | None | ControllerError:
        return await self._on("status", job_id)

    async def result(self, job_id: str) -> dict[str, Any] | None | ControllerError:
        return await self._on("result", job_id)

    async def cancel(self, job_id: str) -> dict[str, Any] | None | ControllerError:
        return await self._on("cancel", job_id)

    async def list_jobs(self) -> list[dict[str, Any]] | ControllerError:
        return await self._on("list_jobs")

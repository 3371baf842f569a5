"""Python clients of the single-controller HTTP service: :class:`SingleControllerClient`
(blocking, ``httpx.Client``) and :class:`AsyncSingleControllerClient` (``httpx.AsyncClient``).
Both have every method of :class:`hybridflow_client.core.ClientAPI` (requests and answers
are made there, once); they differ only in how a request is sent.

    with SingleControllerClient("http://127.0.0.1:8000") as client:
        client.call("gpu_accumulator", "add", x=[1, 1, 1, 1])   # [tensor([1.]), tensor([2.]), ...]
        client.call("accumulator", "add", 10)                   # positional arguments
        client.call("mlp", "run_layer", x=[x], binary=True)     # safetensors both ways
        client.infer("mlp", x)                                  # Open Inference Protocol, binary
        client.group_proxy("test_actor").foo_rank_zero(x=1, y=2)  # 5
        job = client.submit_job("mlp", "run_layer", kwargs={"x": [x]}, binary=True, split=4)
        client.wait_job(job["id"]); client.job_result(job["id"], binary=True)

    async with AsyncSingleControllerClient("http://127.0.0.1:8000") as client:
        await client.call("gpu_accumulator", "add", x=[1, 1, 1, 1])

The contract they speak::

    GET  /healthz                      liveness
    GET  /readyz                       readiness (503 while a group is not ready)
    GET  /v1/groups                    {"groups": [...]}
    GET  /v1/groups/{group}            one group, with per-rank details
    POST /v1/groups/{group}/{method}   {"args": [...], "kwargs": {...}} -> {"group", "method",
                                       "dispatch_mode", "execute_mode", "world_size", "output"}
    POST /v1/jobs/{group}/{method}     the same body, as a job (?split=N); 202 with its status
    GET  /v1/jobs/{id}[/result]        a job's status, its answer; DELETE cancels
    GET  /v1/events                    Server-Sent Events (?group=); resumed with Last-Event-ID
    GET  /v2, /v2/models/{model}       Open Inference Protocol metadata
    POST /v2/models/{model}/infer      Open Inference Protocol, binary tensor data extension

In JSON bodies tensors are OIP tensor objects (``{"datatype", "shape", "data"}``). With
``binary=True`` a call's keyword arguments go as a safetensors body (list items as
``name.0``, ``name.1``, ...; numbers become 0-d tensors) and the output comes back as
safetensors. Tensors come back as torch tensors where torch is installed, else as numpy
arrays. Every error answer is ``{"error": "..."}`` with a 4xx/5xx status and raises
:class:`ServiceError`; network failures raise httpx's own exceptions
(``httpx.ConnectError``, ``httpx.TimeoutException``, ...).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import TypeVar

import httpx

from hybridflow_client.core import (
    DEFAULT_TIMEOUT_S,
    DEFAULT_URL,
    ClientAPI,
    Done,
    InferResult,
    Operation,
    Pause,
    Request,
    ServiceError,
    advance,
)
from hybridflow_client.events import RECONNECT_S, Event, EventParser, events_request, reconnects
from hybridflow_client.messages import check

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_URL",
    "AsyncSingleControllerClient",
    "Event",
    "InferResult",
    "ServiceError",
    "SingleControllerClient",
]

T = TypeVar("T")


class SingleControllerClient(ClientAPI):
    """Blocking client; see :class:`hybridflow_client.core.ClientAPI` for the arguments
    and methods."""

    http_client = httpx.Client

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SingleControllerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _drive(self, operation: Operation[T]) -> T:
        step = advance(operation)
        while not isinstance(step, Done):
            step = advance(operation, self._perform(step))
        return step.value

    def events(self, group: str | None = None, since: int | str | None = None, reconnect: bool = True) -> Iterator[Event]:
        """``GET /v1/events``: every event as it happens (of ``group`` only, when given),
        after the event ``since`` (an id; 0: every one the service kept; None: from now
        on). A stream that is cut is resumed with ``Last-Event-ID`` (``reconnect=False``:
        it ends instead), so nothing the service kept is missed; the iterator runs until
        the caller stops. :class:`ServiceError` for a refused token or an unknown group."""
        parser = EventParser(None if since is None else str(since))
        while True:
            request = events_request(group, parser.last_id)
            try:
                with self._http.stream(request.method, request.path, headers=request.headers) as response:
                    if response.status_code >= 400:
                        response.read()
                        check(response)
                    for line in response.iter_lines():
                        yield from parser.feed(line)
                wait = parser.retry_s or RECONNECT_S
            except (ServiceError, httpx.TransportError) as exc:
                wait = reconnects(exc)
                if wait is None or not reconnect:
                    raise
            if not reconnect:
                return
            time.sleep(wait)

    def _perform(self, step: Request | Pause) -> httpx.Response | httpx.TransportError | None:
        if isinstance(step, Pause):
            time.sleep(step.seconds)
            return None
        try:
            return self._http.request(step.method, step.path, **step.options())
        except httpx.TransportError as exc:  # the operation decides (wait_ready counts it as not ready)
            return exc


class AsyncSingleControllerClient(ClientAPI):
    """The same methods as :class:`SingleControllerClient`, each returning a coroutine
    (``httpx.AsyncClient``); ``transport`` may be ``httpx.ASGITransport(app=...)`` in tests."""

    http_client = httpx.AsyncClient

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncSingleControllerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _drive(self, operation: Operation[T]) -> T:
        step = advance(operation)
        while not isinstance(step, Done):
            step = advance(operation, await self._perform(step))
        return step.value

    async def events(
        self, group: str | None = None, since: int | str | None = None, reconnect: bool = True
    ) -> AsyncIterator[Event]:
        """:meth:`SingleControllerClient.events`, as an async iterator."""
        parser = EventParser(None if since is None else str(since))
        while True:
            request = events_request(group, parser.last_id)
            try:
                async with self._http.stream(request.method, request.path, headers=request.headers) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        check(response)
                    async for line in response.aiter_lines():
                        for event in parser.feed(line):
                            yield event
                wait = parser.retry_s or RECONNECT_S
            except (ServiceError, httpx.TransportError) as exc:
                wait = reconnects(exc)
                if wait is None or not reconnect:
                    raise
            if not reconnect:
                return
            await asyncio.sleep(wait)

    async def _perform(self, step: Request | Pause) -> httpx.Response | httpx.TransportError | None:
        if isinstance(step, Pause):
            await asyncio.sleep(step.seconds)
            return None
        try:
            return await self._http.request(step.method, step.path, **step.options())
        except httpx.TransportError as exc:  # the operation decides (wait_ready counts it as not ready)
            return exc

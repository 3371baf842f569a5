"""What every router reads from the app: the backend, the settings, and the body of a call."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Request

from hybridflow.control.backend import Backend, Jobs
from hybridflow.control.contract import CallRequest, ControllerError
from hybridflow.http.body import body_kind, fingerprint, read_body
from hybridflow.http.call_body import CALL_BODIES, parse_call_body
from hybridflow.http.errors import ApiError
from hybridflow.http.schemas import ErrorResponse
from hybridflow.http.settings import IngressSettings
from hybridflow.wire.loop_work import OFF_LOOP_BYTES, off_loop
from hybridflow_client.wire.errors import TooLargeForLoop

T = TypeVar("T")

#: Longest Idempotency-Key: the controllers keep each key with its answer (and the state
#: store journals it), so its size is bounded like a body's.
MAX_IDEMPOTENCY_KEY_CHARS = 200

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in {
        400: "malformed body",
        401: "missing or wrong bearer token",
        404: "unknown group, method, model or job",
        406: "the answer cannot be sent in the form asked for (Accept)",
        409: "job not finished",
        410: "job cancelled",
        413: "body over the size limit",
        415: "unsupported Content-Type",
        422: "arguments that do not fit the method, or the method raised",
        429: "too many jobs waiting",
        500: "a mutating call was applied and journaled, but collecting its outputs failed",
        503: "group not ready or rebuilding after a worker died (see Retry-After)",
        504: "call ran past the request timeout",
    }.items()
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: ERRORS[code] for code in codes}


def backend(request: Request) -> Backend:
    return request.app.state.backend


def jobs(request: Request) -> Jobs:
    found = request.app.state.jobs
    if found is None:
        raise ApiError(404, "jobs are not enabled in this deployment")
    return found


def found(answer: T | ControllerError) -> T:
    """A backend's answer, or its error raised as the route's answer (``ApiError.of``)."""
    if isinstance(answer, ControllerError):
        raise ApiError.of(answer)
    return answer


def settings(request: Request) -> IngressSettings:
    return request.app.state.settings


async def encoded(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, an encoder that takes ``loop_bytes``: on the loop while the work is
    small, in a thread once it says the work is larger (``TooLargeForLoop``)."""
    try:
        return fn(*args, loop_bytes=OFF_LOOP_BYTES)
    except TooLargeForLoop:
        return await asyncio.to_thread(fn, *args)


async def call_request(request: Request, group: str, method: str) -> CallRequest:
    """The call a request asks for: its group checked against the route table before its
    body is read, the body read within the limit and decoded off the loop when large."""
    config = settings(request)
    if config.deployment_of(group) is None:
        raise ApiError(404, f"unknown group {group!r}; groups: {', '.join(sorted(config.groups))}")
    key = request.headers.get("idempotency-key") or None
    if key is not None and len(key) > MAX_IDEMPOTENCY_KEY_CHARS:
        raise ApiError(
            400, f"Idempotency-Key has {len(key)} characters, over the limit of {MAX_IDEMPOTENCY_KEY_CHARS}"
        )
    kind = body_kind(request, CALL_BODIES)
    body = await read_body(request, config.max_body_bytes)
    args, kwargs = await off_loop(len(body), parse_call_body, kind, body, config.wire_limits())
    return CallRequest(group, method, args, kwargs, key, fingerprint(kind, body) if key else None)

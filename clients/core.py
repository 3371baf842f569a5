"""The clients' one core: every request built and every answer parsed here, without I/O.

Each public operation is a generator that yields what it needs done, a :class:`Request`
to send or a :class:`Pause` to wait, is sent back the ``httpx.Response`` (or the
``httpx.TransportError`` it raised, thrown in), and returns the result. :class:`ClientAPI`
defines every public method once on top of these; the blocking and the async client
(:mod:`clients.python_client`) only say how a request is sent and a pause is waited.
"""

from __future__ import annotations

import email.utils
import json
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar
from urllib.parse import quote

import httpx
import numpy as np
import torch

from hybridflow.wire.dataproto import is_dataproto
from hybridflow.wire.json_tensors import decode_json_value, encode_json_value
from hybridflow.wire.oip_messages import HEADER_LENGTH, build_infer_request, parse_header_length, parse_infer_response
from hybridflow.wire.safetensors_call import decode_output_body, encode_call_body
from hybridflow.wire.strict_json import dumps_compact

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_URL",
    "ClientAPI",
    "Done",
    "InferResult",
    "Operation",
    "Pause",
    "Request",
    "ServiceError",
    "advance",
]

T = TypeVar("T")

DEFAULT_URL = "http://127.0.0.1:8000"
#: Read timeout of a request: the tutorial's full MLP layer takes minutes on a small CPU machine.
DEFAULT_TIMEOUT_S = 600.0
JSON_TYPE = "application/json"
SAFETENSORS_TYPE = "application/x-safetensors"
OCTET_STREAM_TYPE = "application/octet-stream"


class ServiceError(Exception):
    """The service answered with an error status.

    ``status_code``: the HTTP status; ``message``: the body's ``error`` (else its text);
    ``retry_after``: seconds from the ``Retry-After`` header (503 while a group rebuilds),
    else None.
    """

    def __init__(self, status_code: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(status_code, message, retry_after)
        self.status_code = status_code
        self.message = message
        self.retry_after = retry_after

    def __str__(self) -> str:
        text = f"HTTP {self.status_code}: {self.message}"
        if self.retry_after is not None:
            text += f" (retry after {self.retry_after:g} s)"
        return text


@dataclass
class InferResult:
    """An OIP inference answer: output tensors by name, and its JSON (header) as sent."""

    model_name: str
    outputs: dict[str, torch.Tensor]
    model_version: str | None = None
    id: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


# -- the steps of an operation ---------------------------------------------------------


@dataclass
class Request:
    """An HTTP request to send; ``timeout`` (seconds) overrides the client's."""

    method: str
    path: str
    content: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    timeout: float | None = None

    def options(self) -> dict[str, Any]:
        """Keyword arguments of ``httpx.Client.request`` / ``AsyncClient.request``."""
        options: dict[str, Any] = {"content": self.content, "headers": self.headers}
        if self.timeout is not None:
            options["timeout"] = self.timeout
        return options


@dataclass
class Pause:
    """Wait this many seconds before the next step."""

    seconds: float


@dataclass
class Done:
    """An operation's result."""

    value: Any


#: What an operation yields, is sent, and returns.
Operation = Generator[Request | Pause, httpx.Response | None, T]


def advance(operation: Operation, reply: httpx.Response | BaseException | None = None) -> Request | Pause | Done:
    """Give the operation the last step's reply (an exception is thrown into it) and get
    its next step, or :class:`Done` with its result. Start it with no reply."""
    try:
        if isinstance(reply, BaseException):
            return operation.throw(reply)
        return operation.send(reply)
    except StopIteration as stop:
        return Done(stop.value)


# -- answers ---------------------------------------------------------------------------


def _media_type(response: httpx.Response) -> str:
    return response.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def _retry_after(value: str | None) -> float | None:
    """Seconds of a Retry-After header: delta-seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    parsed = email.utils.parsedate_tz(value)
    if parsed is None:
        return None
    return max(0.0, email.utils.mktime_tz(parsed) - time.time())


def _error_from(response: httpx.Response) -> ServiceError:
    try:
        payload = json.loads(response.content)
    except ValueError:
        payload = None
    if isinstance(payload, dict) and isinstance(payload.get("error"), str):
        message = payload["error"]
    elif response.content:
        message = response.content[:2000].decode("utf-8", "replace")
    else:
        message = response.reason_phrase or "no message"
    return ServiceError(response.status_code, message, _retry_after(response.headers.get("retry-after")))


def _check(response: httpx.Response) -> httpx.Response:
    if response.status_code >= 400:
        raise _error_from(response)
    return response


def _json(response: httpx.Response) -> Any:
    _check(response)
    try:
        return json.loads(response.content)
    except ValueError as exc:
        raise ServiceError(response.status_code, f"answer is not JSON: {exc}") from None


def _segment(name: str) -> str:
    return quote(name, safe="")


def _ready(response: httpx.Response) -> bool:
    if response.status_code == 503:
        return False
    _check(response)
    return True


def _call_answer(group: str, method: str, response: httpx.Response) -> dict[str, Any]:
    """The call's answer with its output decoded. A safetensors answer carries only the
    output, so its dispatch_mode, execute_mode and world_size are None."""
    _check(response)
    if _media_type(response) == SAFETENSORS_TYPE:
        output = decode_output_body(response.content)
        return {
            "group": group, "method": method, "dispatch_mode": None, "execute_mode": None, "world_size": None,
            "output": output,
        }
    answer = _json(response)
    if not isinstance(answer, dict) or "output" not in answer:
        raise ServiceError(response.status_code, f"answer has no 'output': {str(answer)[:200]}")
    answer["output"] = decode_json_value(answer["output"], "output")
    return answer


def _infer_result(response: httpx.Response) -> InferResult:
    _check(response)
    try:
        header_length = parse_header_length(response.headers.get(HEADER_LENGTH), len(response.content))
    except ValueError as exc:
        raise ServiceError(response.status_code, f"answer has a bad {HEADER_LENGTH}: {exc}") from None
    payload, outputs = parse_infer_response(response.content, header_length)
    return InferResult(
        model_name=payload.get("model_name", ""),
        outputs=outputs,
        model_version=payload.get("model_version"),
        id=payload.get("id"),
        raw=payload,
    )


# -- requests --------------------------------------------------------------------------


def _call_request(
    path: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    binary: bool,
    binary_output: bool,
    idempotency_key: str | None = None,
    timeout: float | None = None,
) -> Request:
    headers: dict[str, str] = {}
    if binary:
        if args:
            raise ValueError(
                "a binary (safetensors) call carries keyword arguments only: pass them by name, e.g. x=[x]"
            )
        content = encode_call_body(kwargs)
        headers["Content-Type"] = SAFETENSORS_TYPE
    else:
        content = dumps_compact({"args": encode_json_value(list(args)), "kwargs": encode_json_value(dict(kwargs))})
        headers["Content-Type"] = JSON_TYPE
    headers["Accept"] = SAFETENSORS_TYPE if binary_output else JSON_TYPE
    if idempotency_key:
        headers["Idempotency-Key"] = idempotency_key
    return Request("POST", path, content, headers, timeout)


def _as_torch(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    return torch.as_tensor(value)


def _infer_request(
    path: str,
    inputs: Mapping[str, Any],
    outputs: Sequence[str] | None,
    binary_inputs: bool,
    binary_outputs: bool,
    request_id: str | None,
    parameters: Mapping[str, Any] | None,
    timeout: float | None,
) -> Request:
    tensors = {name: _as_torch(value) for name, value in inputs.items()}
    body, header_length = build_infer_request(
        tensors, binary=binary_inputs, outputs=outputs, binary_outputs=binary_outputs, id=request_id,
        parameters=parameters,
    )
    headers = {"Accept": f"{OCTET_STREAM_TYPE}, {JSON_TYPE}"}
    if header_length is None:
        headers["Content-Type"] = JSON_TYPE
    else:
        headers["Content-Type"] = OCTET_STREAM_TYPE
        headers[HEADER_LENGTH] = str(header_length)
    return Request("POST", path, body, headers, timeout)


# -- operations ------------------------------------------------------------------------


def _exchange(request: Request, parse: Callable[[httpx.Response], T]) -> Operation[T]:
    """One request, its answer parsed."""
    response = yield request
    return parse(response)


def _get_json(path: str) -> Operation[Any]:
    return _exchange(Request("GET", path), _json)


def _wait_ready(timeout: float, interval: float) -> Operation[bool]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if _ready((yield Request("GET", "/readyz"))):
                return True
        except httpx.TransportError:
            pass
        if time.monotonic() >= deadline:
            return False
        yield Pause(min(interval, max(0.0, deadline - time.monotonic())))


def _job_result(job_id: str, binary: bool, full: bool) -> Operation[Any]:
    status = _json((yield Request("GET", f"/v1/jobs/{_segment(job_id)}")))
    headers = {"Accept": SAFETENSORS_TYPE} if binary else {}
    response = yield Request("GET", f"/v1/jobs/{_segment(job_id)}/result", headers=headers)
    return _full_or_output(_call_answer(status["group"], status["method"], response), full)


def _wait_job(
    job_id: str, on_progress: Callable[[dict[str, Any]], None] | None, interval: float
) -> Operation[dict[str, Any]]:
    while True:
        status = _json((yield Request("GET", f"/v1/jobs/{_segment(job_id)}")))
        if on_progress is not None:
            on_progress(status)
        if status["status"] not in ("queued", "running"):
            return status
        yield Pause(interval)


def _full_or_output(answer: dict[str, Any], full: bool) -> Any:
    return answer if full else answer["output"]


def _one_output(result: InferResult, output_name: str) -> torch.Tensor:
    if output_name not in result.outputs:
        raise ServiceError(200, f"answer has no output {output_name!r}; it has {sorted(result.outputs)}")
    return result.outputs[output_name]


# -- the API ---------------------------------------------------------------------------


def _client_options(
    url: str, token: str | None, timeout: float | httpx.Timeout | None, headers: Mapping[str, str] | None
) -> dict[str, Any]:
    all_headers = {"User-Agent": "hybridflow-serve-client/0.1"}
    all_headers.update(headers or {})
    if token:
        all_headers["Authorization"] = f"Bearer {token}"
    if timeout is not None and not isinstance(timeout, httpx.Timeout):
        timeout = httpx.Timeout(timeout, connect=min(10.0, timeout))
    return {"base_url": url.rstrip("/"), "headers": all_headers, "timeout": timeout}


class ClientAPI:
    """Every method of the clients, written once. A subclass names its httpx client class
    (``http_client``) and runs operations (``_drive``): the blocking client returns each
    method's result, the async one a coroutine of it.

    ``url``: the service, like ``http://127.0.0.1:8000``; ``token``: sent as
    ``Authorization: Bearer <token>``; ``timeout``: default seconds to wait for an answer
    (None: forever); ``headers``: extra headers on every request; ``transport``: an httpx
    transport to use instead of the network (``httpx.MockTransport``,
    ``httpx.ASGITransport`` in tests).
    """

    http_client: ClassVar[type[httpx.Client] | type[httpx.AsyncClient]]

    def __init__(
        self,
        url: str = DEFAULT_URL,
        token: str | None = None,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT_S,
        headers: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
    ) -> None:
        options = _client_options(url, token, timeout, headers)
        self.url: str = options["base_url"]
        self._http = self.http_client(transport=transport, **options)

    def _drive(self, operation: Operation[T]) -> Any:
        raise NotImplementedError

    # -- health and groups ---------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """``GET /healthz``'s answer; raises :class:`ServiceError` when not live."""
        return self._drive(_get_json("/healthz"))

    def healthy(self) -> bool:
        """True when ``GET /healthz`` answers 200."""
        return self._drive(_exchange(Request("GET", "/healthz"), lambda response: response.status_code == 200))

    def ready(self) -> bool:
        """``GET /readyz``: True when every group is ready, False on 503."""
        return self._drive(_exchange(Request("GET", "/readyz"), _ready))

    def wait_ready(self, timeout: float = 300.0, interval: float = 1.0) -> bool:
        """Poll :meth:`ready` (a connection error counts as not ready) until it is True or
        ``timeout`` seconds pass; returns whether the service became ready."""
        return self._drive(_wait_ready(timeout, interval))

    def groups(self) -> list[dict[str, Any]]:
        """``GET /v1/groups``: every group's summary."""
        return self._drive(_exchange(Request("GET", "/v1/groups"), lambda response: _json(response)["groups"]))

    def group(self, name: str) -> dict[str, Any]:
        """``GET /v1/groups/{name}``: one group with per-rank details."""
        return self._drive(_get_json(f"/v1/groups/{_segment(name)}"))

    # -- calls ---------------------------------------------------------------------------
    def call(
        self,
        group: str,
        method: str,
        *args: Any,
        binary: bool = False,
        binary_output: bool | None = None,
        full: bool = False,
        idempotency_key: str | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> Any:
        """``POST /v1/groups/{group}/{method}`` with ``args`` and ``kwargs`` (tensors, numpy
        arrays and JSON values); returns the collected output with tensors as torch tensors
        (``full=True``: the whole answer, a dict with group, method, dispatch_mode,
        execute_mode, world_size and output).

        ``binary``: send the keyword arguments as safetensors (tensors, numbers and lists of
        them) and ask for the output as safetensors (``binary_output`` overrides the
        latter). ``idempotency_key`` is sent as ``Idempotency-Key``; ``timeout`` overrides
        the client's for this call. A method keyword argument with one of these names
        must go through :meth:`call_with`."""
        return self.call_with(
            group, method, args, kwargs, binary=binary, binary_output=binary_output, full=full,
            idempotency_key=idempotency_key, timeout=timeout,
        )

    def call_with(
        self,
        group: str,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        binary: bool = False,
        binary_output: bool | None = None,
        full: bool = False,
        idempotency_key: str | None = None,
        timeout: float | None = None,
    ) -> Any:
        """:meth:`call` with the method's arguments given as a sequence and a mapping. A
        DataProto argument (verl's batch type; by keyword) always travels as safetensors,
        and a DataProto answer comes back as one."""
        if any(is_dataproto(value) for value in (kwargs or {}).values()):
            binary = True
        request = _call_request(
            f"/v1/groups/{_segment(group)}/{_segment(method)}", args, kwargs or {}, binary,
            binary if binary_output is None else binary_output, idempotency_key, timeout,
        )
        return self._drive(
            _exchange(request, lambda response: _full_or_output(_call_answer(group, method, response), full))
        )

    def group_proxy(self, group: str) -> GroupProxy:
        """``client.group_proxy("gpu_accumulator").add(x=[1, 1, 1, 1])``: the tutorial's
        ``worker_group.add(...)``, over HTTP; returns the output (awaitable with the async
        client)."""
        return GroupProxy(self, group)

    # -- jobs: long calls that answer at once ----------------------------------------------
    def submit_job(
        self,
        group: str,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        binary: bool = False,
        split: int = 1,
    ) -> dict[str, Any]:
        """``POST /v1/jobs/{group}/{method}``: the job's status (with its ``id``)."""
        path = f"/v1/jobs/{_segment(group)}/{_segment(method)}?split={int(split)}"
        return self._drive(_exchange(_call_request(path, args, kwargs or {}, binary, False), _json))

    def job(self, job_id: str) -> dict[str, Any]:
        """``GET /v1/jobs/{id}``: status, progress (0..1), elapsed seconds."""
        return self._drive(_get_json(f"/v1/jobs/{_segment(job_id)}"))

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        """``DELETE /v1/jobs/{id}``: no further pieces start; the job's status."""
        return self._drive(_exchange(Request("DELETE", f"/v1/jobs/{_segment(job_id)}"), _json))

    def job_result(self, job_id: str, binary: bool = False, full: bool = False) -> Any:
        """A finished job's output (``full=True``: the whole answer); 409 while it runs."""
        return self._drive(_job_result(job_id, binary, full))

    def wait_job(
        self, job_id: str, on_progress: Callable[[dict[str, Any]], None] | None = None, interval: float = 0.5
    ) -> dict[str, Any]:
        """Poll until the job finishes; ``on_progress`` sees every status."""
        return self._drive(_wait_job(job_id, on_progress, interval))

    # -- Open Inference Protocol -----------------------------------------------------------
    def server_metadata(self) -> dict[str, Any]:
        """``GET /v2``."""
        return self._drive(_get_json("/v2"))

    def model_metadata(self, model: str) -> dict[str, Any]:
        """``GET /v2/models/{model}``."""
        return self._drive(_get_json(f"/v2/models/{_segment(model)}"))

    def infer(
        self,
        model: str,
        x: Any,
        input_name: str = "x",
        output_name: str = "y",
        *,
        binary: bool = True,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> torch.Tensor:
        """One input, one output: ``x`` (tensor or numpy array) in as ``input_name``, the
        ``output_name`` tensor back; binary tensor data both ways unless ``binary`` is False."""
        request = _infer_request(
            f"/v2/models/{_segment(model)}/infer", {input_name: x}, [output_name], binary, binary, request_id,
            None, timeout,
        )
        return self._drive(_exchange(request, lambda response: _one_output(_infer_result(response), output_name)))

    def infer_tensors(
        self,
        model: str,
        inputs: Mapping[str, Any],
        outputs: Sequence[str] | None = None,
        *,
        binary_inputs: bool = True,
        binary_outputs: bool = True,
        request_id: str | None = None,
        parameters: Mapping[str, Any] | None = None,
        version: str | None = None,
        timeout: float | None = None,
    ) -> InferResult:
        """``POST /v2/models/{model}/infer`` with several inputs; ``outputs`` names the ones
        to return (None: all of them)."""
        path = f"/v2/models/{_segment(model)}"
        if version:
            path += f"/versions/{_segment(version)}"
        request = _infer_request(
            path + "/infer", inputs, outputs, binary_inputs, binary_outputs, request_id, parameters, timeout
        )
        return self._drive(_exchange(request, _infer_result))


class GroupProxy:
    """Attribute access gives a method caller that returns the output (a coroutine with
    the async client)."""

    def __init__(self, client: ClientAPI, group: str) -> None:
        self._client = client
        self._group = group

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        client, group = self._client, self._group

        def call(*args: Any, **kwargs: Any) -> Any:
            return client.call_with(group, method, args, kwargs)

        return call

    def __repr__(self) -> str:
        return f"<group {self._group!r} at {self._client.url}>"

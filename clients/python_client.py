"""Python clients of the single-controller HTTP service: :class:`SingleControllerClient`
(blocking, ``httpx.Client``) and :class:`AsyncSingleControllerClient` (``httpx.AsyncClient``),
torch tensors in, torch tensors out.

    with SingleControllerClient("http://127.0.0.1:8000") as client:
        client.call("gpu_accumulator", "add", x=[1, 1, 1, 1])   # [tensor([1.]), tensor([2.]), ...]
        client.call("accumulator", "add", 10)                   # positional arguments
        client.call("mlp", "run_layer", x=[x], binary=True)     # safetensors both ways
        client.infer("mlp", x)                                  # Open Inference Protocol, binary
        client.group_proxy("test_actor").foo_rank_zero(x=1, y=2)  # 5

The contract they speak::

    GET  /healthz                      liveness
    GET  /readyz                       readiness (503 while a group is not ready)
    GET  /v1/groups                    {"groups": [...]}
    GET  /v1/groups/{group}            one group, with per-rank details
    POST /v1/groups/{group}/{method}   {"args": [...], "kwargs": {...}} -> {"group", "method",
                                       "dispatch_mode", "execute_mode", "world_size", "output"}
    GET  /v2, /v2/models/{model}       Open Inference Protocol metadata
    POST /v2/models/{model}/infer      Open Inference Protocol, binary tensor data extension

In JSON bodies tensors are OIP tensor objects (``{"datatype", "shape", "data"}``). With
``binary=True`` a call's keyword arguments go as a safetensors body (list items as
``name.0``, ``name.1``, ...; numbers become 0-d tensors) and the output comes back as
safetensors. Every error answer is ``{"error": "..."}`` with a 4xx/5xx status and raises
:class:`ServiceError`; network failures raise httpx's own exceptions
(``httpx.ConnectError``, ``httpx.TimeoutException``, ...).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np
import torch

from wire.json_tensors import decode_json_value, encode_json_value
from wire.oip_messages import build_infer_request, parse_infer_response
from wire.safetensors_call import decode_safetensors, encode_safetensors, pack_call, unpack_output

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_URL",
    "AsyncSingleControllerClient",
    "InferResult",
    "ServiceError",
    "SingleControllerClient",
]

DEFAULT_URL = "http://127.0.0.1:8000"
#: Read timeout of a request: the tutorial's full MLP layer takes minutes on a small CPU machine.
DEFAULT_TIMEOUT_S = 600.0
JSON_TYPE = "application/json"
SAFETENSORS_TYPE = "application/x-safetensors"
OCTET_STREAM_TYPE = "application/octet-stream"
HEADER_LENGTH = "Inference-Header-Content-Length"


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


# -- request building and answer parsing, shared by both clients ---------------------------


@dataclass
class _Request:
    method: str
    path: str
    content: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)


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
    try:
        return json.loads(response.content)
    except ValueError as exc:
        raise ServiceError(response.status_code, f"answer is not JSON: {exc}") from None


def _segment(name: str) -> str:
    return quote(name, safe="")


def _call_request(
    group: str,
    method: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    binary: bool,
    binary_output: bool | None,
    idempotency_key: str | None,
) -> _Request:
    headers: dict[str, str] = {}
    if binary:
        if args:
            raise ValueError(
                "a binary (safetensors) call carries keyword arguments only: pass them by name, e.g. x=[x]"
            )
        content = encode_safetensors(pack_call(kwargs))
        headers["Content-Type"] = SAFETENSORS_TYPE
    else:
        body = {"args": encode_json_value(list(args)), "kwargs": encode_json_value(dict(kwargs))}
        content = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
        headers["Content-Type"] = JSON_TYPE
    wants_binary = binary if binary_output is None else binary_output
    headers["Accept"] = SAFETENSORS_TYPE if wants_binary else JSON_TYPE
    if idempotency_key:
        headers["Idempotency-Key"] = idempotency_key
    return _Request("POST", f"/v1/groups/{_segment(group)}/{_segment(method)}", content, headers)


def _job_request(
    group: str, method: str, args: Sequence[Any], kwargs: Mapping[str, Any], binary: bool, split: int
) -> _Request:
    request = _call_request(group, method, args, kwargs, binary, False, None)
    request.method = "POST"
    request.path = f"/v1/jobs/{_segment(group)}/{_segment(method)}?split={int(split)}"
    return request


def _call_answer(group: str, method: str, response: httpx.Response) -> dict[str, Any]:
    """The call's answer with its output decoded. A safetensors answer carries only the
    output, so its dispatch_mode, execute_mode and world_size are None."""
    _check(response)
    if _media_type(response) == SAFETENSORS_TYPE:
        output = unpack_output(decode_safetensors(response.content))
        return {
            "group": group, "method": method, "dispatch_mode": None, "execute_mode": None, "world_size": None,
            "output": output,
        }
    answer = _json(response)
    if not isinstance(answer, dict) or "output" not in answer:
        raise ServiceError(response.status_code, f"answer has no 'output': {str(answer)[:200]}")
    answer["output"] = decode_json_value(answer["output"], "output")
    return answer


def _as_torch(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    return torch.as_tensor(value)


def _infer_request(
    model: str,
    inputs: Mapping[str, Any],
    outputs: Sequence[str] | None,
    binary_inputs: bool,
    binary_outputs: bool,
    request_id: str | None,
    parameters: Mapping[str, Any] | None,
    version: str | None,
) -> _Request:
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
    path = f"/v2/models/{_segment(model)}"
    if version:
        path += f"/versions/{_segment(version)}"
    return _Request("POST", path + "/infer", body, headers)


def _infer_result(response: httpx.Response) -> InferResult:
    _check(response)
    length = response.headers.get(HEADER_LENGTH)
    try:
        header_length = int(length) if length is not None else None
    except ValueError:
        raise ServiceError(response.status_code, f"answer has a bad {HEADER_LENGTH}: {length!r}") from None
    payload, outputs = parse_infer_response(response.content, header_length)
    return InferResult(
        model_name=payload.get("model_name", ""),
        outputs=outputs,
        model_version=payload.get("model_version"),
        id=payload.get("id"),
        raw=payload,
    )


def _one_output(result: InferResult, output_name: str) -> torch.Tensor:
    if output_name not in result.outputs:
        raise ServiceError(200, f"answer has no output {output_name!r}; it has {sorted(result.outputs)}")
    return result.outputs[output_name]


def _ready_from(response: httpx.Response) -> bool:
    if response.status_code == 503:
        return False
    _check(response)
    return True


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


def _per_request(timeout: float | None) -> dict[str, Any]:
    return {} if timeout is None else {"timeout": timeout}


class SingleControllerClient:
    """Blocking client.

    ``url``: the service, like ``http://127.0.0.1:8000``; ``token``: sent as
    ``Authorization: Bearer <token>``; ``timeout``: default seconds to wait for an answer
    (None: forever); ``headers``: extra headers on every request; ``transport``: an httpx
    transport to use instead of the network (``httpx.MockTransport`` in tests).
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        token: str | None = None,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT_S,
        headers: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        options = _client_options(url, token, timeout, headers)
        self.url = options["base_url"]
        self._http = httpx.Client(transport=transport, **options)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SingleControllerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, request: _Request, timeout: float | None = None) -> httpx.Response:
        return self._http.request(
            request.method, request.path, content=request.content, headers=request.headers,
            **_per_request(timeout),
        )

    # -- health and groups ---------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """``GET /healthz``'s answer; raises :class:`ServiceError` when not live."""
        return _json(_check(self._http.get("/healthz")))

    def healthy(self) -> bool:
        """True when ``GET /healthz`` answers 200."""
        return self._http.get("/healthz").status_code == 200

    def ready(self) -> bool:
        """``GET /readyz``: True when every group is ready, False on 503."""
        return _ready_from(self._http.get("/readyz"))

    def wait_ready(self, timeout: float = 300.0, interval: float = 1.0) -> bool:
        """Poll :meth:`ready` (a connection error counts as not ready) until it is True or
        ``timeout`` seconds pass; returns whether the service became ready."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.ready():
                    return True
            except httpx.TransportError:
                pass
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(interval, max(0.0, deadline - time.monotonic())))

    def groups(self) -> list[dict[str, Any]]:
        """``GET /v1/groups``: every group's summary."""
        return _json(_check(self._http.get("/v1/groups")))["groups"]

    def group(self, name: str) -> dict[str, Any]:
        """``GET /v1/groups/{name}``: one group with per-rank details."""
        return _json(_check(self._http.get(f"/v1/groups/{_segment(name)}")))

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
        """:meth:`call` with the method's arguments given as a sequence and a mapping."""
        request = _call_request(group, method, args, kwargs or {}, binary, binary_output, idempotency_key)
        answer = _call_answer(group, method, self._send(request, timeout))
        return answer if full else answer["output"]

    def group_proxy(self, group: str) -> _GroupProxy:
        """``client.group_proxy("gpu_accumulator").add(x=[1, 1, 1, 1])``: the tutorial's
        ``worker_group.add(...)``, over HTTP; returns the output."""
        return _GroupProxy(self, group)

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
        request = _job_request(group, method, args, kwargs or {}, binary, split)
        return _json(_check(self._send(request)))

    def job(self, job_id: str) -> dict[str, Any]:
        """``GET /v1/jobs/{id}``: status, progress (0..1), elapsed seconds."""
        return _json(_check(self._http.get(f"/v1/jobs/{_segment(job_id)}")))

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        return _json(_check(self._http.delete(f"/v1/jobs/{_segment(job_id)}")))

    def job_result(self, job_id: str, binary: bool = False, full: bool = False) -> Any:
        """A finished job's output (``full=True``: the whole answer); 409 while it runs."""
        headers = {"Accept": SAFETENSORS_TYPE} if binary else {}
        status = self.job(job_id)
        response = self._http.get(f"/v1/jobs/{_segment(job_id)}/result", headers=headers)
        answer = _call_answer(status["group"], status["method"], response)
        return answer if full else answer["output"]

    def wait_job(
        self, job_id: str, on_progress: Callable[[dict[str, Any]], None] | None = None, interval: float = 0.5
    ) -> dict[str, Any]:
        """Poll until the job finishes; ``on_progress`` sees every status."""
        while True:
            status = self.job(job_id)
            if on_progress is not None:
                on_progress(status)
            if status["status"] not in ("queued", "running"):
                return status
            time.sleep(interval)

    # -- Open Inference Protocol -----------------------------------------------------------
    def server_metadata(self) -> dict[str, Any]:
        """``GET /v2``."""
        return _json(_check(self._http.get("/v2")))

    def model_metadata(self, model: str) -> dict[str, Any]:
        """``GET /v2/models/{model}``."""
        return _json(_check(self._http.get(f"/v2/models/{_segment(model)}")))

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
        result = self.infer_tensors(
            model, {input_name: x}, [output_name], binary_inputs=binary, binary_outputs=binary,
            request_id=request_id, timeout=timeout,
        )
        return _one_output(result, output_name)

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
        request = _infer_request(model, inputs, outputs, binary_inputs, binary_outputs, request_id, parameters, version)
        return _infer_result(self._send(request, timeout))


class AsyncSingleControllerClient:
    """:class:`SingleControllerClient`'s API with coroutines (``httpx.AsyncClient``);
    ``transport`` may be ``httpx.ASGITransport(app=...)`` in tests."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        token: str | None = None,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT_S,
        headers: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        options = _client_options(url, token, timeout, headers)
        self.url = options["base_url"]
        self._http = httpx.AsyncClient(transport=transport, **options)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncSingleControllerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _send(self, request: _Request, timeout: float | None = None) -> httpx.Response:
        return await self._http.request(
            request.method, request.path, content=request.content, headers=request.headers,
            **_per_request(timeout),
        )

    async def health(self) -> dict[str, Any]:
        return _json(_check(await self._http.get("/healthz")))

    async def healthy(self) -> bool:
        return (await self._http.get("/healthz")).status_code == 200

    async def ready(self) -> bool:
        return _ready_from(await self._http.get("/readyz"))

    async def wait_ready(self, timeout: float = 300.0, interval: float = 1.0) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if await self.ready():
                    return True
            except httpx.TransportError:
                pass
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))

    async def groups(self) -> list[dict[str, Any]]:
        return _json(_check(await self._http.get("/v1/groups")))["groups"]

    async def group(self, name: str) -> dict[str, Any]:
        return _json(_check(await self._http.get(f"/v1/groups/{_segment(name)}")))

    async def call(
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
        return await self.call_with(
            group, method, args, kwargs, binary=binary, binary_output=binary_output, full=full,
            idempotency_key=idempotency_key, timeout=timeout,
        )

    async def call_with(
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
        request = _call_request(group, method, args, kwargs or {}, binary, binary_output, idempotency_key)
        answer = _call_answer(group, method, await self._send(request, timeout))
        return answer if full else answer["output"]

    def group_proxy(self, group: str) -> _GroupProxy:
        """``await client.group_proxy("gpu_accumulator_decorator").add(x=10)``."""
        return _GroupProxy(self, group)

    async def server_metadata(self) -> dict[str, Any]:
        return _json(_check(await self._http.get("/v2")))

    async def model_metadata(self, model: str) -> dict[str, Any]:
        return _json(_check(await self._http.get(f"/v2/models/{_segment(model)}")))

    async def infer(
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
        result = await self.infer_tensors(
            model, {input_name: x}, [output_name], binary_inputs=binary, binary_outputs=binary,
            request_id=request_id, timeout=timeout,
        )
        return _one_output(result, output_name)

    async def infer_tensors(
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
        request = _infer_request(model, inputs, outputs, binary_inputs, binary_outputs, request_id, parameters, version)
        return _infer_result(await self._send(request, timeout))


class _GroupProxy:
    """Attribute access gives a method caller that returns the output (a coroutine with
    the async client)."""

    def __init__(self, client: SingleControllerClient | AsyncSingleControllerClient, group: str) -> None:
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

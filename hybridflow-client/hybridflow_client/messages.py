"""The client's HTTP messages, without I/O: the requests it sends (:class:`Request`, built
for calls and inferences here) and the answers it reads (errors as :class:`ServiceError`,
call outputs, :class:`InferResult`)."""

from __future__ import annotations

import email.utils
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx

from hybridflow_client.wire import json_call, safetensors_call
from hybridflow_client.wire.builders import ClientBuilder
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.formats import JSON, OCTET_STREAM, SAFETENSORS, CallFormat
from hybridflow_client.wire.limits import CLIENT_LIMITS
from hybridflow_client.wire.oip_messages import (
    HEADER_LENGTH,
    build_infer_request,
    parse_header_length,
    parse_infer_response,
)

if TYPE_CHECKING:
    from hybridflow_client.wire.tensors import Tensor

__all__ = [
    "CALL_FORMATS",
    "JSON_TYPE",
    "OCTET_STREAM_TYPE",
    "SAFETENSORS_TYPE",
    "InferResult",
    "Request",
    "ServiceError",
    "call_answer",
    "call_request",
    "check",
    "infer_request",
    "infer_result",
    "json_answer",
    "one_output",
    "ready_answer",
    "segment",
]

JSON_TYPE = JSON
SAFETENSORS_TYPE = SAFETENSORS
OCTET_STREAM_TYPE = OCTET_STREAM

#: The call formats by media type: what a call is encoded in, and how an answer is read.
CALL_FORMATS: dict[str, CallFormat] = {
    JSON_TYPE: json_call.FORMAT,
    SAFETENSORS_TYPE: safetensors_call.FORMAT,
}


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
    """An OIP inference answer: output tensors by name (torch tensors where torch is
    installed, else numpy arrays), and its JSON (header) as sent."""

    model_name: str
    outputs: dict[str, Tensor]
    model_version: str | None = None
    id: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


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


def segment(name: str) -> str:
    """``name`` as one path segment."""
    return quote(name, safe="")


# -- answers -----------------------------------------------------------------------------


def _retry_after(value: str | None) -> float | None:
    """Seconds of a Retry-After header: delta-seconds or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value.strip()))
    except ValueError:
        pass
    parsed = email.utils.parsedate_tz(value.strip())
    return None if parsed is None else max(0.0, email.utils.mktime_tz(parsed) - time.time())


def check(response: httpx.Response) -> httpx.Response:
    """The response, or the :class:`ServiceError` its error status means."""
    if response.status_code < 400:
        return response
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
    raise ServiceError(response.status_code, message, _retry_after(response.headers.get("retry-after")))


def json_answer(response: httpx.Response) -> Any:
    """The parsed JSON of a successful answer."""
    check(response)
    try:
        return json.loads(response.content)
    except ValueError as exc:
        raise ServiceError(response.status_code, f"answer is not JSON: {exc}") from None


def ready_answer(response: httpx.Response) -> bool:
    """``/readyz``: True on 200, False on 503."""
    if response.status_code == 503:
        return False
    check(response)
    return True


def _media_type(response: httpx.Response) -> str:
    return response.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def call_answer(
    group: str, method: str, response: httpx.Response, dataproto_type: type | None = None
) -> dict[str, Any]:
    """A call's answer with its output decoded, in the format its media type names (JSON
    when it names none the client knows). A safetensors answer carries only the output,
    so its dispatch_mode, execute_mode and world_size are None."""
    check(response)
    answer_format = CALL_FORMATS.get(_media_type(response), CALL_FORMATS[JSON_TYPE])
    answer = answer_format.decode_answer(response.content, CLIENT_LIMITS, ClientBuilder(dataproto_type))
    return {"group": group, "method": method, "dispatch_mode": None, "execute_mode": None, "world_size": None,
            **answer}


def infer_result(response: httpx.Response) -> InferResult:
    """An OIP inference answer, JSON or binary."""
    check(response)
    try:
        header_length = parse_header_length(response.headers.get(HEADER_LENGTH), len(response.content))
    except WireError as exc:
        raise ServiceError(response.status_code, f"answer has a bad {HEADER_LENGTH}: {exc}") from None
    payload, outputs = parse_infer_response(response.content, header_length, CLIENT_LIMITS, ClientBuilder())
    return InferResult(
        model_name=payload.get("model_name", ""),
        outputs=outputs,
        model_version=payload.get("model_version"),
        id=payload.get("id"),
        raw=payload,
    )


def one_output(result: InferResult, output_name: str) -> Tensor:
    """The output ``output_name`` of an inference answer."""
    if output_name not in result.outputs:
        raise ServiceError(200, f"answer has no output {output_name!r}; it has {sorted(result.outputs)}")
    return result.outputs[output_name]


# -- requests ----------------------------------------------------------------------------


def call_request(
    path: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    binary: bool,
    binary_output: bool,
    idempotency_key: str | None = None,
    timeout: float | None = None,
) -> Request:
    """A call (or job) request: JSON ``{"args", "kwargs"}``, or with ``binary`` the
    keyword arguments as safetensors; ``binary_output`` asks for a safetensors answer."""
    media_type = SAFETENSORS_TYPE if binary else JSON_TYPE
    content = CALL_FORMATS[media_type].encode_call(args, kwargs, CLIENT_LIMITS)
    headers = {"Content-Type": media_type, "Accept": SAFETENSORS_TYPE if binary_output else JSON_TYPE}
    if idempotency_key:
        headers["Idempotency-Key"] = idempotency_key
    return Request("POST", path, content, headers, timeout)


def infer_request(
    path: str,
    inputs: Mapping[str, Any],
    outputs: Sequence[str] | None,
    binary_inputs: bool,
    binary_outputs: bool,
    request_id: str | None,
    parameters: Mapping[str, Any] | None,
    timeout: float | None,
) -> Request:
    """An OIP inference request (binary tensor data, or JSON only)."""
    body, header_length = build_infer_request(
        inputs, binary=binary_inputs, outputs=outputs, binary_outputs=binary_outputs, id=request_id,
        parameters=parameters,
    )
    headers = {"Accept": f"{OCTET_STREAM_TYPE}, {JSON_TYPE}"}
    if header_length is None:
        headers["Content-Type"] = JSON_TYPE
    else:
        headers["Content-Type"] = OCTET_STREAM_TYPE
        headers[HEADER_LENGTH] = str(header_length)
    return Request("POST", path, body, headers, timeout)

"""Turning a call's HTTP body into arguments, and a call's output into a body.

JSON bodies are ``{"args": [...], "kwargs": {...}}`` with tensors as OIP tensor
objects; safetensors bodies carry keyword tensors (list items as ``name.0``, ...) and
DataProtos (their tensors as ``name@key``, the rest as JSON in the metadata; wire.dataproto).
Client bytes are only ever parsed as JSON or safetensors, never unpickled, and every
decoder works within the service's ``limits`` (wire.limits).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from hybridflow.http.body import JSON, SAFETENSORS
from hybridflow.http.errors import ApiError
from hybridflow.http.schemas import CallRequest
from hybridflow.wire.errors import WireError
from hybridflow.wire.json_tensors import check_json_output, decode_json_value, encode_json_value
from hybridflow.wire.limits import DEFAULT_LIMITS, WireLimits
from hybridflow.wire.safetensors_call import decode_call_body, encode_output_body
from hybridflow.wire.strict_json import dumps_compact, loads_strict


def parse_call_body(kind: str, body: bytes | bytearray, limits: WireLimits = DEFAULT_LIMITS) -> tuple[list, dict]:
    """``(args, kwargs)`` of a call whose body is ``kind`` (JSON or safetensors, checked
    by the route), tensors decoded to torch."""
    if kind == SAFETENSORS:
        try:
            return [], decode_call_body(body, limits)
        except WireError as exc:
            raise ApiError(400, f"bad safetensors body: {exc}") from None
    try:
        payload = loads_strict(body, "body", limits) if body and not body.isspace() else {}
    except WireError as exc:
        raise ApiError(400, str(exc)) from None
    try:
        request = CallRequest.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise ApiError(422, f"invalid call body at {where}: {first.get('msg')}") from None
    try:
        # args and kwargs together: the body's tensors count against one bound
        decoded = decode_json_value({"args": request.args, "kwargs": request.kwargs}, "body", limits)
    except WireError as exc:
        raise ApiError(422, str(exc)) from None
    return decoded["args"], decoded["kwargs"]


def wants_safetensors(accept: str | None) -> bool:
    return SAFETENSORS in (accept or "").lower()


def output_as_safetensors(output: Any, limits: WireLimits = DEFAULT_LIMITS) -> bytes:
    try:
        return encode_output_body(output, limits)
    except WireError as exc:
        raise ApiError(406, f"output cannot be sent as safetensors ({exc}); ask for {JSON}") from None


def call_answer_body(
    output: Any, envelope: dict[str, Any], accept: str | None, limits: WireLimits = DEFAULT_LIMITS
) -> tuple[bytes, str]:
    """The body and media type answering a call: safetensors when asked for, else JSON
    (refused past ``limits.max_json_output_values`` values, pointing to safetensors)."""
    if wants_safetensors(accept):
        return output_as_safetensors(output, limits), SAFETENSORS
    try:
        check_json_output(output, limits)
    except WireError as exc:
        raise ApiError(406, str(exc)) from None
    try:
        encoded = encode_json_value(output, limits)
    except WireError as exc:
        raise ApiError(500, f"output cannot be encoded as JSON: {exc}") from None
    return dumps_compact({**envelope, "output": encoded}), JSON

"""Turning a call's HTTP body into arguments, and a call's output into a body.

JSON bodies are ``{"args": [...], "kwargs": {...}}`` with tensors as OIP tensor
objects; safetensors bodies carry keyword tensors (list items as ``name.0``, ...) and
DataProtos (their tensors as ``name@key``, the rest as JSON in the metadata; wire.dataproto).
Client bytes are only ever parsed as JSON or safetensors, never unpickled, and every
decoder works within the service's ``limits`` (wire.limits).
"""

from __future__ import annotations

from typing import Any

from hybridflow.http.body import JSON, SAFETENSORS
from hybridflow.http.errors import ApiError
from hybridflow.wire.errors import AnswerTooLarge, WireError
from hybridflow.wire.json_tensors import decode_json_value, encode_json_value
from hybridflow.wire.limits import DEFAULT_LIMITS, WireLimits
from hybridflow.wire.safetensors_call import decode_call_body, encode_output_body
from hybridflow.wire.strict_json import dumps_compact, loads_strict

#: The keys of a JSON call body, and the JSON type each takes.
CALL_BODY_KEYS = {"args": list, "kwargs": dict}


def parse_call_body(kind: str, body: bytes | bytearray, limits: WireLimits = DEFAULT_LIMITS) -> tuple[list, dict]:
    """``(args, kwargs)`` of a call whose body is ``kind`` (JSON or safetensors, checked
    by the route), tensors decoded to torch: the body parsed once, its shape checked, and
    its values decoded in place."""
    if kind == SAFETENSORS:
        try:
            return [], decode_call_body(body, limits)
        except WireError as exc:
            raise ApiError(400, f"bad safetensors body: {exc}") from None
    try:
        payload = loads_strict(body, "body", limits) if body and not body.isspace() else {}
    except WireError as exc:
        raise ApiError(400, str(exc)) from None
    if not isinstance(payload, dict):
        raise ApiError(422, f"invalid call body: an object with {' and '.join(CALL_BODY_KEYS)} is expected")
    for key, value in payload.items():
        expected = CALL_BODY_KEYS.get(key)
        if expected is None:
            raise ApiError(422, f"invalid call body at {key}: not a key of a call body ({', '.join(CALL_BODY_KEYS)})")
        if not isinstance(value, expected):
            raise ApiError(422, f"invalid call body at {key}: a JSON {'array' if expected is list else 'object'} "
                                "is expected")
    try:
        # args and kwargs together: the body's tensors count against one bound
        decoded = decode_json_value({"args": payload.get("args", []), "kwargs": payload.get("kwargs", {})},
                                    "body", limits)
    except WireError as exc:
        raise ApiError(422, str(exc)) from None
    return decoded["args"], decoded["kwargs"]


def wants_safetensors(accept: str | None) -> bool:
    return SAFETENSORS in (accept or "").lower()


def call_answer_body(
    output: Any,
    envelope: dict[str, Any],
    accept: str | None,
    limits: WireLimits = DEFAULT_LIMITS,
    loop_bytes: int | None = None,
) -> tuple[bytes, str]:
    """The body and media type answering a call: safetensors when asked for, else JSON
    (refused past ``limits.max_json_output_values`` values, pointing to safetensors).
    The output is walked once; ``TooLargeForLoop`` (from ``hybridflow.wire.errors``) when it
    holds more than about ``loop_bytes``, before the costly part (the caller, on the event
    loop, runs it again in a thread)."""
    if wants_safetensors(accept):
        try:
            return encode_output_body(output, limits, loop_bytes), SAFETENSORS
        except WireError as exc:
            raise ApiError(406, f"output cannot be sent as safetensors ({exc}); ask for {JSON}") from None
    try:
        encoded = encode_json_value(output, limits, None if loop_bytes is None else loop_bytes // 8)
    except AnswerTooLarge as exc:
        raise ApiError(406, str(exc)) from None
    except WireError as exc:
        raise ApiError(500, f"output cannot be encoded as JSON: {exc}") from None
    return dumps_compact({**envelope, "output": encoded}), JSON

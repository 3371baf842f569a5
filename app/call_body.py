"""Turning a call's HTTP body into arguments, and a call's output into a body.

JSON bodies are ``{"args": [...], "kwargs": {...}}`` with tensors as OIP tensor
objects; safetensors bodies carry keyword tensors (list items as ``name.0``, ...).
Client bytes are only ever parsed as JSON or safetensors, never unpickled.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import ValidationError

from app.body import JSON, SAFETENSORS
from app.errors import ApiError
from app.schemas import CallRequest
from app.tensor_codec import (
    TensorCodecError,
    decode_json_value,
    decode_safetensors,
    encode_json_value,
    encode_safetensors,
    pack_output,
    unpack_call,
)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range for a 64-bit float")
    return value


def _int64(text: str) -> int:
    value = int(text)
    if not -(1 << 63) <= value < (1 << 63):
        raise ValueError(f"integer {text[:40]}{'...' if len(text) > 40 else ''} is out of the 64-bit range")
    return value


def loads_strict(body: bytes) -> Any:
    """JSON without NaN/Infinity and without numbers that overflow a float or an int64."""
    try:
        return json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float, parse_int=_int64)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ApiError(400, f"body is not valid JSON: {exc}") from None


def parse_call_body(kind: str, body: bytes) -> tuple[list, dict]:
    """``(args, kwargs)`` of a call whose body is ``kind`` (JSON or safetensors, checked
    by the route), tensors decoded to torch."""
    if kind == SAFETENSORS:
        try:
            return [], unpack_call(decode_safetensors(body))
        except TensorCodecError as exc:
            raise ApiError(400, f"bad safetensors body: {exc}") from None
    payload = loads_strict(body) if body.strip() else {}
    try:
        request = CallRequest.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise ApiError(422, f"invalid call body at {where}: {first.get('msg')}") from None
    try:
        return decode_json_value(request.args, "args"), decode_json_value(request.kwargs, "kwargs")
    except TensorCodecError as exc:
        raise ApiError(422, str(exc)) from None


def wants_safetensors(accept: str | None) -> bool:
    return SAFETENSORS in (accept or "").lower()


def output_as_json(output: Any) -> Any:
    try:
        return encode_json_value(output)
    except TensorCodecError as exc:
        raise ApiError(500, f"output cannot be encoded as JSON: {exc}") from None


def output_as_safetensors(output: Any) -> bytes:
    try:
        return encode_safetensors(pack_output(output))
    except TensorCodecError as exc:
        raise ApiError(406, f"output cannot be sent as safetensors ({exc}); ask for {JSON}") from None


def json_value_count(value: Any, _depth: int = 0) -> int:
    """How many JSON values encoding ``value`` would make (a tensor's or array's elements
    count one each), without encoding it."""
    if _depth > 100:
        return 1
    numel = getattr(value, "numel", None)
    if callable(numel):
        return int(numel())
    size = getattr(value, "size", None)
    if isinstance(size, int) and hasattr(value, "dtype"):
        return size
    if isinstance(value, dict):
        return 1 + sum(json_value_count(v, _depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return 1 + sum(json_value_count(v, _depth + 1) for v in value)
    return 1


def call_answer_body(output: Any, envelope: dict[str, Any], accept: str | None, max_json_values: int) -> tuple[bytes, str]:
    """The body and media type answering a call: safetensors when asked for, else JSON
    (refused past ``max_json_values`` values, pointing to safetensors)."""
    if wants_safetensors(accept):
        return output_as_safetensors(output), SAFETENSORS
    count = json_value_count(output)
    if count > max_json_values:
        raise ApiError(
            406,
            f"the answer has {count} values, over the {max_json_values} a JSON answer may carry; "
            f"ask for it with 'Accept: {SAFETENSORS}'",
        )
    document = {**envelope, "output": output_as_json(output)}
    return json.dumps(document, separators=(",", ":"), allow_nan=False).encode(), JSON

"""Turning a call's HTTP body into arguments, and a call's output into a body.

JSON bodies are ``{"args": [...], "kwargs": {...}}`` with tensors as OIP tensor
objects; safetensors bodies carry keyword tensors (list items as ``name.0``, ...).
Client bytes are only ever parsed as JSON or safetensors, never unpickled.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from app.errors import ApiError
from app.schemas import CallRequest
from wire.errors import WireError
from wire.json_tensors import decode_json_value, encode_json_value
from wire.safetensors_call import decode_safetensors, encode_safetensors, pack_output, unpack_call
from wire.strict_json import loads_strict

JSON = "application/json"
SAFETENSORS = "application/x-safetensors"


def media_type(header: str | None) -> str:
    return (header or "").split(";", 1)[0].strip().lower()


def parse_call_body(content_type: str | None, body: bytes) -> tuple[list, dict]:
    """``(args, kwargs)`` of a call, tensors decoded to torch."""
    kind = media_type(content_type)
    if kind == SAFETENSORS:
        try:
            return [], unpack_call(decode_safetensors(body))
        except WireError as exc:
            raise ApiError(400, f"bad safetensors body: {exc}") from None
    if kind not in (JSON, "") and not kind.endswith("+json"):
        raise ApiError(415, f"unsupported Content-Type {kind!r}: send {JSON} or {SAFETENSORS}")
    try:
        payload = loads_strict(body) if body.strip() else {}
    except WireError as exc:
        raise ApiError(400, str(exc)) from None
    try:
        request = CallRequest.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise ApiError(422, f"invalid call body at {where}: {first.get('msg')}") from None
    try:
        return decode_json_value(request.args, "args"), decode_json_value(request.kwargs, "kwargs")
    except WireError as exc:
        raise ApiError(422, str(exc)) from None


def wants_safetensors(accept: str | None) -> bool:
    return SAFETENSORS in (accept or "").lower()


def output_as_json(output: Any) -> Any:
    try:
        return encode_json_value(output)
    except WireError as exc:
        raise ApiError(500, f"output cannot be encoded as JSON: {exc}") from None


def output_as_safetensors(output: Any) -> bytes:
    try:
        return encode_safetensors(pack_output(output))
    except WireError as exc:
        raise ApiError(406, f"output cannot be sent as safetensors ({exc}); ask for {JSON}") from None

"""The JSON format of calls and answers (``application/json``).

A call is ``{"args": [...], "kwargs": {...}}`` (either may be left out; an empty body is a
call without arguments), an answer ``{"group", "method", "dispatch_mode", "execute_mode",
"world_size", "output"}``; tensors and batches anywhere in them as
:mod:`~hybridflow_client.wire.json_values` writes them. Bytes are parsed by the strict
loader, counted before parsing: a body that is not JSON, or holds more values than a body
may, is refused with ``unparsed`` set; one whose content does not fit a call without.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.formats import JSON
from hybridflow_client.wire.json_values import decode_json_value, encode_json_value
from hybridflow_client.wire.limits import CLIENT_LIMITS, WireLimits
from hybridflow_client.wire.parts import Builder
from hybridflow_client.wire.strict_json import dumps_compact, loads_strict

__all__ = ["CALL_BODY_KEYS", "FORMAT", "JsonCall"]

#: The keys of a JSON call body, and the JSON type each takes.
CALL_BODY_KEYS = {"args": list, "kwargs": dict}


class JsonCall:
    """The JSON format (:class:`~hybridflow_client.wire.formats.CallFormat`)."""

    media_type = JSON

    def encode_call(self, args: Sequence[Any], kwargs: Mapping[str, Any], limits: WireLimits = CLIENT_LIMITS) -> bytes:
        return dumps_compact({
            "args": encode_json_value(list(args), limits, where="args"),
            "kwargs": encode_json_value(dict(kwargs), limits, where="kwargs"),
        })

    def decode_call(self, body: bytes | bytearray, limits: WireLimits, builder: Builder) -> tuple[list, dict]:
        payload = loads_strict(body, "body", limits) if body and not body.isspace() else {}
        if not isinstance(payload, dict):
            raise WireError(f"invalid call body: an object with {' and '.join(CALL_BODY_KEYS)} is expected")
        for key, value in payload.items():
            expected = CALL_BODY_KEYS.get(key)
            if expected is None:
                raise WireError(f"invalid call body at {key}: not a key of a call body ({', '.join(CALL_BODY_KEYS)})")
            if not isinstance(value, expected):
                raise WireError(
                    f"invalid call body at {key}: a JSON {'array' if expected is list else 'object'} is expected"
                )
        # args and kwargs together: the body's tensors count against one bound
        decoded = decode_json_value(
            {"args": payload.get("args", []), "kwargs": payload.get("kwargs", {})}, "body", limits, builder
        )
        return decoded["args"], decoded["kwargs"]

    def encode_answer(
        self, output: Any, envelope: Mapping[str, Any], limits: WireLimits, loop_bytes: int | None = None
    ) -> bytes:
        encoded = encode_json_value(output, limits, None if loop_bytes is None else loop_bytes // 8)
        return dumps_compact({**envelope, "output": encoded})

    def decode_answer(self, body: bytes | bytearray, limits: WireLimits, builder: Builder) -> dict[str, Any]:
        answer = loads_strict(body, "answer", limits, wide_ints=True)
        if not isinstance(answer, dict) or "output" not in answer:
            raise WireError(f"answer has no 'output': {str(answer)[:200]}")
        answer["output"] = decode_json_value(answer["output"], "output", limits, builder)
        return answer


FORMAT = JsonCall()

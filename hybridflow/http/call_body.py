"""Turning a call's HTTP body into arguments, and a call's output into a body, in the
format the request names: :data:`CALL_BODIES` is the server's table from media type to
format (the shared formats of :mod:`hybridflow_client.wire`, one module each) and the
answers it gives when a body does not decode or an output does not encode. A new format
is its module and a row here (and one in the client's ``CALL_FORMATS``).

Client bytes are only ever parsed as JSON or safetensors, never unpickled, every decoder
works within the service's ``limits``, and tensors are decoded into torch (views of the
body where they can be: :mod:`hybridflow.wire.torch_builder`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridflow.http.body import JSON, SAFETENSORS
from hybridflow.http.errors import ApiError
from hybridflow.wire.torch_builder import TORCH_BUILDER
from hybridflow_client.wire import json_call, safetensors_call
from hybridflow_client.wire.errors import AnswerTooLarge, WireError
from hybridflow_client.wire.formats import CallFormat
from hybridflow_client.wire.limits import DEFAULT_LIMITS, WireLimits

__all__ = ["CALL_BODIES", "CallBody", "call_answer_body", "parse_call_body"]


@dataclass(frozen=True)
class CallBody:
    """One row of :data:`CALL_BODIES`: a format, the answer to a body of it that does not
    decode (``refused``), and to an output that cannot be sent in it (``unsendable``)."""

    format: CallFormat
    refused: Callable[[WireError], ApiError]
    unsendable: Callable[[WireError], ApiError]


def _json_refused(exc: WireError) -> ApiError:
    # bytes that are no JSON a body may hold are malformed; JSON that is no call does not fit the method
    return ApiError(400 if exc.unparsed else 422, str(exc))


def _json_unsendable(exc: WireError) -> ApiError:
    if isinstance(exc, AnswerTooLarge):
        return ApiError(406, str(exc))
    return ApiError(500, f"output cannot be encoded as JSON: {exc}")


#: The call formats by media type; the first is the default answer.
CALL_BODIES: dict[str, CallBody] = {
    JSON: CallBody(json_call.FORMAT, _json_refused, _json_unsendable),
    SAFETENSORS: CallBody(
        safetensors_call.FORMAT,
        lambda exc: ApiError(400, f"bad safetensors body: {exc}"),
        lambda exc: ApiError(406, f"output cannot be sent as safetensors ({exc}); ask for {JSON}"),
    ),
}


def parse_call_body(kind: str, body: bytes | bytearray, limits: WireLimits = DEFAULT_LIMITS) -> tuple[list, dict]:
    """``(args, kwargs)`` of a call whose body is ``kind`` (a media type of
    :data:`CALL_BODIES`, checked by the route; any other is read as the default, JSON),
    tensors decoded to torch: the body parsed once, its shape checked, and its values
    decoded in place."""
    row = CALL_BODIES.get(kind) or next(iter(CALL_BODIES.values()))
    try:
        return row.format.decode_call(body, limits, TORCH_BUILDER)
    except WireError as exc:
        raise row.refused(exc) from None


def answer_format(accept: str | None) -> CallBody:
    """The format an answer goes in: one the Accept header names other than the default,
    else the default (JSON)."""
    accepted = (accept or "").lower()
    default, *others = CALL_BODIES.values()
    return next((row for row in others if row.format.media_type in accepted), default)


def call_answer_body(
    output: Any,
    envelope: dict[str, Any],
    accept: str | None,
    limits: WireLimits = DEFAULT_LIMITS,
    loop_bytes: int | None = None,
) -> tuple[bytes, str]:
    """The body and media type answering a call, in :func:`answer_format` (a JSON answer
    is refused past ``limits.max_json_output_values`` values, pointing to safetensors).
    The output is walked once; ``TooLargeForLoop`` (from ``hybridflow_client.wire.errors``)
    when it holds more than about ``loop_bytes``, before the costly part (the caller, on
    the event loop, runs it again in a thread)."""
    row = answer_format(accept)
    try:
        return row.format.encode_answer(output, envelope, limits, loop_bytes), row.format.media_type
    except WireError as exc:
        raise row.unsendable(exc) from None

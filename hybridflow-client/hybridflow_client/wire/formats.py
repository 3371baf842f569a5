"""What a body format of calls and answers is, and the media types the wire speaks.

A format is one module with one :class:`CallFormat` (``FORMAT``) holding both directions:
a client encodes calls and decodes answers with it, a server decodes calls and encodes
answers. Each side keeps a table from media type to format (the client's
``hybridflow_client.messages.CALL_FORMATS``, the server's ``hybridflow.http.call_body.CALL_BODIES``),
so a new format is its module and one row on each side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from hybridflow_client.wire.limits import WireLimits
from hybridflow_client.wire.parts import Builder

__all__ = ["JSON", "OCTET_STREAM", "SAFETENSORS", "CallFormat"]

JSON = "application/json"
SAFETENSORS = "application/x-safetensors"
#: The Open Inference Protocol's binary tensor data extension (a JSON header, then bytes).
OCTET_STREAM = "application/octet-stream"


class CallFormat(Protocol):
    """A body format of calls (``args`` and ``kwargs``) and their answers (the output, and
    in formats that carry it the call's envelope: group, method, modes, world size)."""

    media_type: str

    def encode_call(self, args: Sequence[Any], kwargs: Mapping[str, Any], limits: WireLimits = ...) -> bytes:
        """A call's body (a :class:`~hybridflow_client.wire.errors.WireError` for arguments
        the format cannot carry)."""

    def decode_call(self, body: bytes | bytearray, limits: WireLimits, builder: Builder) -> tuple[list, dict]:
        """``(args, kwargs)`` of a call's body, within ``limits``, made by ``builder``."""

    def encode_answer(
        self, output: Any, envelope: Mapping[str, Any], limits: WireLimits, loop_bytes: int | None = None
    ) -> bytes:
        """An answer's body; ``TooLargeForLoop`` once the work is past ``loop_bytes``."""

    def decode_answer(self, body: bytes | bytearray, limits: WireLimits, builder: Builder) -> dict[str, Any]:
        """An answer's fields: ``output`` decoded, and what else the format carries."""

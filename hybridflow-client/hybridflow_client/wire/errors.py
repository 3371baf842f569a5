"""The wire's one error type, and the signal that an encoding is too large for an event loop."""

from __future__ import annotations

__all__ = ["AnswerTooLarge", "TooLargeForLoop", "WireError"]


class WireError(ValueError):
    """Bytes or a value that cannot be decoded or encoded, or that pass a limit of
    :class:`~hybridflow_client.wire.limits.WireLimits`. The message names what is wrong and
    where; a server answers it with a 4xx.

    ``unparsed`` is true when the bytes were refused before they were parsed into a
    document: they are not one (not JSON, not UTF-8), or hold more values than a body may.
    """

    def __init__(self, message: str, *, unparsed: bool = False) -> None:
        super().__init__(message)
        self.unparsed = unparsed


class TooLargeForLoop(Exception):
    """An encoder given a share of the event loop (``loop_values``, ``loop_bytes``) found
    the work larger than that share, before doing the costly part: run it in a thread."""


class AnswerTooLarge(WireError):
    """An answer over ``limits.max_json_output_values`` JSON values: it can be asked for
    in a binary form instead."""

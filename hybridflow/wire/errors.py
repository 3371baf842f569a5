"""The one error type of the wire package."""

from __future__ import annotations

__all__ = ["WireError"]


class WireError(ValueError):
    """Bytes or a value that cannot be decoded or encoded, or that pass a limit of
    :class:`wire.limits.WireLimits`. The message names what is wrong and where; a server
    answers it with a 4xx."""

"""How much work decoding or encoding a body is, to decide whether it leaves the event
loop: a large request is decoded in a thread so that it never stalls the others, and a
small one on the loop, where a thread's hand-off would cost more than the work.

Work is counted in parsed bytes (JSON, and the tensors spelled in it). Raw tensor bytes
(the binary data of an OIP body over HTTP) are only viewed or copied, never parsed: each
counts ``1 / RAW_BYTES_PER_PARSED_BYTE`` of a parsed byte. The gRPC front counts a
message's bytes in full.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: Work from which a body is decoded (or an answer encoded) off the event loop.
OFF_LOOP_BYTES = 256 * 1024
#: Raw bytes that cost as much as one parsed byte (a copy against a JSON parse).
RAW_BYTES_PER_PARSED_BYTE = 16


def loop_work(parsed_bytes: int, raw_bytes: int = 0) -> int:
    """The work of ``parsed_bytes`` parsed and ``raw_bytes`` copied, in parsed bytes."""
    return parsed_bytes + raw_bytes // RAW_BYTES_PER_PARSED_BYTE


def leaves_loop(work: int) -> bool:
    """Whether work of this size is done in a thread."""
    return work >= OFF_LOOP_BYTES


async def off_loop(work: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``: in a thread when ``work`` (:func:`loop_work`) leaves the loop, else
    on it."""
    if leaves_loop(work):
        return await asyncio.to_thread(fn, *args)
    return fn(*args)

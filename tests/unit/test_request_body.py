"""hybridflow.http.body.read_body: a request body read within its limit into one writable buffer,
which the tensor decoders then view instead of copying. No server: a Starlette request
over a receive callable that hands out chunks."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from starlette.requests import Request

from hybridflow.http.body import read_body
from hybridflow.http.errors import ApiError
from hybridflow_client.wire.safetensors_call import decode_call_body, encode_call_body


def request_of(chunks: list[bytes], declared: int | None = None) -> tuple[Request, list[int]]:
    """A request whose body arrives as ``chunks``; the list counts the chunks handed out."""
    handed = [0]

    async def receive() -> dict:
        index = handed[0]
        handed[0] += 1
        return {"type": "http.request", "body": chunks[index], "more_body": index + 1 < len(chunks)}

    headers = [] if declared is None else [(b"content-length", str(declared).encode())]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive), handed


def test_the_chunks_arrive_in_one_bytearray_that_decoded_tensors_view():
    x = torch.arange(1 << 16, dtype=torch.float32).reshape(256, 256)
    encoded = encode_call_body({"x": x, "n": [1, 2]})
    chunks = [encoded[i : i + 4096] for i in range(0, len(encoded), 4096)]
    request, handed = request_of(chunks)
    body = asyncio.run(read_body(request, limit=len(encoded)))
    assert isinstance(body, bytearray) and body == encoded and handed[0] == len(chunks)
    kwargs = decode_call_body(body)
    assert torch.equal(kwargs["x"], x) and [int(v) for v in kwargs["n"]] == [1, 2]
    start = np.frombuffer(body, dtype=np.uint8).ctypes.data
    assert start < kwargs["x"].data_ptr() < start + len(body)  # a view of the body, not a copy


def test_a_body_over_the_limit_is_refused_as_soon_as_it_passes_it():
    request, handed = request_of([b"a" * 600, b"b" * 600, b"c" * 600])
    with pytest.raises(ApiError) as refused:
        asyncio.run(read_body(request, limit=1000))
    assert refused.value.status == 413 and "over the limit of 1000 bytes" in refused.value.message
    assert handed[0] == 2  # the third chunk was never read


def test_a_declared_length_over_the_limit_is_refused_before_reading():
    request, handed = request_of([b"x"], declared=10**9)
    with pytest.raises(ApiError) as refused:
        asyncio.run(read_body(request, limit=1000))
    assert refused.value.status == 413 and handed[0] == 0

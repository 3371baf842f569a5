"""Reading request bodies: within the size limit however they arrive (a Content-Length
over the limit is refused before reading; a chunked body is refused as soon as it
passes the limit), and only in the media types a route takes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from fastapi import Request

from hybridflow.http.errors import ApiError
from hybridflow_client.wire.formats import JSON, OCTET_STREAM, SAFETENSORS

__all__ = ["JSON", "OCTET_STREAM", "SAFETENSORS", "body_kind", "fingerprint", "media_type", "read_body"]

#: Structured syntax suffixes (RFC 6839) and the media type a type ending in one counts as.
SUFFIXES = {"+json": JSON}


def media_type(header: str | None) -> str:
    return (header or "").split(";", 1)[0].strip().lower()


def body_kind(request: Request, allowed: Iterable[str]) -> str:
    """The body's media type, one of ``allowed`` (a type with a suffix of
    :data:`SUFFIXES` counts as its type: ``+json`` as JSON); 415 otherwise. A missing
    Content-Type is refused too: a browser's cross-site form or plain fetch cannot send
    JSON or safetensors without one."""
    allowed = tuple(allowed)
    kind = media_type(request.headers.get("content-type"))
    _, plus, suffix = kind.rpartition("+")
    kind = SUFFIXES.get(plus + suffix, kind)
    if kind not in allowed:
        named = f"Content-Type {kind!r}" if kind else "a body without Content-Type"
        raise ApiError(415, f"unsupported media type: {named}; send {' or '.join(allowed)}")
    return kind


async def read_body(request: Request, limit: int) -> bytearray:
    """The body, read into one growing bytearray: memory follows the bytes that arrived,
    never a claimed Content-Length, and the tensors decoded from it can be views of it
    (writable, no second copy of a large body)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"body of {declared} bytes is over the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        if len(body) + len(chunk) > limit:
            raise ApiError(413, f"body is over the limit of {limit} bytes")
        body += chunk
    return body


def fingerprint(kind: str, body: bytes | bytearray) -> str:
    """What identifies a request body for Idempotency-Key repeats."""
    return hashlib.sha256(kind.encode() + b"\0" + body).hexdigest()

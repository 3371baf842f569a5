"""A rank's end of a socket channel: calls from its group's owner over one TCP connection,
each run on a thread of the rank's own, in the order they arrive.

The owner asks a rank for its channel with a Ray call (``Worker._open_step_socket``) that
carries a random token; the rank listens on its node's address, takes the first
connection whose first bytes are that token, stops listening, and serves that connection
until it closes. Anyone else who connects is dropped: the frames that follow are
pickles, and only the owner, who got the token over Ray's own channel, may send them.

A frame is an 8-byte big-endian length and a pickle (protocol 5). The owner sends a
step, ``(method, args, kwargs)``; the rank answers ``(True, value)``, or ``(False,
(exception, traceback text))`` where the method raised (an exception that does not pickle
is sent as a ``RuntimeError`` naming it). The framing lives here so that both ends share
it (``single_controller.ray.socket_channel`` is the owner's end).
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import pickle
import socket
import struct
import threading
import traceback
from collections.abc import Callable
from typing import Any

#: A frame's header: the payload's length in bytes.
HEADER = struct.Struct("!Q")
TOKEN_BYTES = 32
#: Seconds the owner has to connect and send the token before the rank stops listening.
ACCEPT_TIMEOUT_S = 60.0


def frame(payload: Any) -> bytes:
    """``payload`` pickled, behind its length."""
    body = pickle.dumps(payload, protocol=5)
    return HEADER.pack(len(body)) + body


def answer_frame(run: Callable[[], Any]) -> bytes:
    """The frame answering a step: what ``run()`` returned, or what it raised."""
    try:
        value = run()
        if inspect.iscoroutine(value):  # an async method: run to its end on this thread
            value = asyncio.run(value)
        return frame((True, value))
    except Exception as exc:
        text = traceback.format_exc()
        try:
            return frame((False, (exc, text)))
        except Exception:  # an exception that does not pickle: its name and message
            return frame((False, (RuntimeError(f"{type(exc).__name__}: {exc}"), text)))


def _read_exactly(conn: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def serve_steps(
    host: str, token: bytes, execute: Callable[[Any], Any], setup: Callable[[], None] | None = None
) -> int:
    """Listen on ``host`` (an ephemeral port, returned) for the owner's connection and
    serve it on a daemon thread: ``setup()`` first (what the thread needs of the rank's
    main thread), then each step frame is run through ``execute`` and answered, one at a
    time."""
    if len(token) != TOKEN_BYTES:
        raise ValueError(f"a channel token is {TOKEN_BYTES} bytes, got {len(token)}")
    listener = socket.create_server((host, 0))
    listener.settimeout(ACCEPT_TIMEOUT_S)
    port = listener.getsockname()[1]
    threading.Thread(target=_accept_and_serve, args=(listener, token, execute, setup), daemon=True,
                     name="step-socket").start()
    return port


def _accept_and_serve(
    listener: socket.socket, token: bytes, execute: Callable[[Any], Any], setup: Callable[[], None] | None
) -> None:
    if setup is not None:
        setup()
    with listener:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # no owner within the timeout: nothing to serve
                return
            conn.settimeout(ACCEPT_TIMEOUT_S)
            try:
                sent = _read_exactly(conn, TOKEN_BYTES)
            except OSError:
                sent = None
            if sent is not None and hmac.compare_digest(sent, token):
                break
            conn.close()
    conn.settimeout(None)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        _serve(conn, execute)


def _serve(conn: socket.socket, execute: Callable[[Any], Any]) -> None:
    while True:
        try:
            header = _read_exactly(conn, HEADER.size)
            if header is None:
                return
            body = _read_exactly(conn, HEADER.unpack(header)[0])
            if body is None:
                return
            # a step that does not unpickle here is answered as the method's error
            conn.sendall(answer_frame(lambda body=body: execute(pickle.loads(body))))
        except OSError:  # the owner went away
            return

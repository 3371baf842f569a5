"""A group's calls over one TCP connection per rank, for a caller on an asyncio event loop.

``SocketChannel(group)`` connects to every rank (:meth:`open`, blocking: run it in a
thread; each rank's end is ``single_controller.base.step_socket``) and then takes the
group's calls the way its own Ray tasks take them: :meth:`submit` (the method's dispatch
and collect, as ``group.submit``), :meth:`execute_all_async` and
:meth:`execute_rank_zero_async`, each answering asyncio futures of the calling loop, one
per rank. A call is one pickled frame written to each rank's connection and one read
back, on the caller's event loop: no Ray task, no object store, no thread hop. While
idle nothing polls: each rank's thread waits in ``recv``.

Order: a rank runs its connection's calls one at a time, in the order they were sent
(one connection per rank, written by one loop). They run on a thread of the rank's own,
beside the actor's ordinary tasks, so a caller that keeps one order on the ranks sends
every call that reads or changes their state through the channel; pings and identity
queries may stay ordinary tasks.

Failures: a method that raises fails that rank's future with the ``RayTaskError`` Ray
would have raised (an instance of the method's exception too), and the channel goes on.
A connection that ends (a lost rank) fails every call in flight and every later one
with ``ChannelClosed`` until the owner opens a new channel.

Security: a rank takes only the connection that first sends the random token it got
over Ray's own channel (see ``step_socket``); the frames are pickles between the owner
and its ranks, never a client's bytes.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import pickle
import secrets
import socket
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import ray

from single_controller.base.step_socket import HEADER, TOKEN_BYTES, frame
from single_controller.base.worker_methods import user_class
from single_controller.ray.step_channel import Step, StepChannel

logger = logging.getLogger(__name__)

#: Bytes read from a connection at a time (at least).
READ_CHUNK = 1 << 18


class ChannelClosed(ray.exceptions.RayError):
    """The channel's connection to a rank ended (a lost rank), or the owner tore it down:
    like a lost worker, the group needs a new channel."""


class _RankEnd:
    """The owner's side of one rank's connection: what is still to be written, what is
    read so far, and the futures of the calls sent, oldest first."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.unsent: deque[memoryview] = deque()
        self.received = bytearray()
        self.waiting: deque[tuple[asyncio.Future, str]] = deque()


class SocketChannel(StepChannel):
    """``group``'s calls over one connection per rank; ``connect_timeout_s`` bounds
    :meth:`open`."""

    #: A call's arguments are pickled in the thread that makes it (a caller moves a large
    #: call off its loop); a compiled graph's channel pickles in a writer thread of its own.
    pickles_in_caller = True

    def __init__(self, group: Any, connect_timeout_s: float = 60.0) -> None:
        self.group = group
        self.connect_timeout_s = connect_timeout_s
        self._ends: list[_RankEnd] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed: BaseException | None = None
        self._lock = threading.Lock()
        self._signatures: dict[str, inspect.Signature | None] = {}

    def _signature(self, method: str) -> inspect.Signature | None:
        """The worker method's parameters (``self`` left out), as Ray checks a task's
        arguments against them before it sends anything; None where the class does not
        say (the rank answers for itself)."""
        if method not in self._signatures:
            cls = self.group.ray_cls_with_init.cls if self.group.ray_cls_with_init is not None else None
            function = getattr(user_class(cls), method, None) if cls is not None else None
            try:
                signature = inspect.signature(function) if callable(function) else None
            except (TypeError, ValueError):  # a builtin without one
                signature = None
            if signature is not None:
                signature = signature.replace(parameters=list(signature.parameters.values())[1:])
            self._signatures[method] = signature
        return self._signatures[method]

    def open(self) -> SocketChannel:
        """Connect to every rank (blocking). Calls already submitted to the group as
        ordinary tasks finish first."""
        workers = self.group.workers
        # The channel's calls run beside ordinary tasks: a ping queued behind every earlier
        # task on each rank says they are done.
        ray.get([w._ping.remote() for w in workers], timeout=self.connect_timeout_s)
        token = secrets.token_bytes(TOKEN_BYTES)
        addresses = ray.get([w._open_step_socket.remote(token) for w in workers], timeout=self.connect_timeout_s)
        socks: list[socket.socket] = []
        try:
            for host, port in addresses:
                sock = socket.create_connection((host, port), timeout=self.connect_timeout_s)
                socks.append(sock)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(token)
                sock.setblocking(False)
        except BaseException:
            for sock in socks:
                sock.close()
            raise
        self._ends = [_RankEnd(sock) for sock in socks]
        return self

    # -- calls ------------------------------------------------------------------------------
    def _send(self, steps: list[Step]) -> list[asyncio.Future]:
        """Every rank's frame, pickled in the calling thread (raising, with nothing sent,
        where an argument does not pickle), then written on the channel's loop: at once
        from the loop, else in the order the calls were made."""
        loop = self._loop
        if loop is None:
            loop = asyncio.get_running_loop()
            self.attach(loop)
        frames = _frames(steps, self._signature)
        futures = [loop.create_future() for _ in steps]
        if _running_loop() is loop:
            self._post(frames, futures, steps)
        else:
            loop.call_soon_threadsafe(self._post, frames, futures, steps)
        return futures

    def _post(self, frames: list[bytes | None], futures: list[asyncio.Future], steps: list[Step]) -> None:
        ends = self._ends
        for rank, (data, future, step) in enumerate(zip(frames, futures, steps, strict=True)):
            if data is None:
                future.set_result(None)
            elif self._closed is not None:  # closed, maybe by a write to an earlier rank
                future.set_exception(self._closed_error())
            else:
                ends[rank].waiting.append((future, step[0]))
                self._write(rank, ends[rank], data)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve ``loop`` (call it on that loop): every call's futures are its, and calls
        made from other threads are written from it. The first call attaches the loop it
        is made on."""
        if self._loop is loop:
            return
        if self._loop is not None:
            raise RuntimeError("a socket channel serves the one event loop it was attached to")
        if not self._ends:
            raise RuntimeError("the socket channel is not open: call open() first")
        self._loop = loop
        for rank, end in enumerate(self._ends):
            loop.add_reader(end.sock.fileno(), self._readable, rank)

    # -- the connections, on the caller's loop ---------------------------------------------
    def _write(self, rank: int, end: _RankEnd, data: bytes) -> None:
        if not end.unsent:
            try:
                sent = end.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                self._close(ChannelClosed(f"rank {rank}'s connection failed: {exc}"))
                return
            if sent == len(data):
                return
            assert self._loop is not None
            self._loop.add_writer(end.sock.fileno(), self._writable, rank)
            data = memoryview(data)[sent:]
        end.unsent.append(memoryview(data))

    def _writable(self, rank: int) -> None:
        if self._closed is not None:  # closed earlier in this turn of the loop
            return
        end = self._ends[rank]
        while end.unsent:
            try:
                sent = end.sock.send(end.unsent[0])
            except BlockingIOError:
                return
            except OSError as exc:
                self._close(ChannelClosed(f"rank {rank}'s connection failed: {exc}"))
                return
            if sent < len(end.unsent[0]):
                end.unsent[0] = end.unsent[0][sent:]
                return
            end.unsent.popleft()
        assert self._loop is not None
        self._loop.remove_writer(end.sock.fileno())

    def _readable(self, rank: int) -> None:
        if self._closed is not None:  # closed earlier in this turn of the loop
            return
        end = self._ends[rank]
        try:
            data = end.sock.recv(max(READ_CHUNK, _still_needed(end.received)))
        except BlockingIOError:
            return
        except OSError as exc:
            self._close(ChannelClosed(f"rank {rank}'s connection failed: {exc}"))
            return
        if not data:
            self._close(ChannelClosed(f"rank {rank}'s connection closed (the rank is gone)"))
            return
        end.received += data
        while len(end.received) >= HEADER.size:
            size = HEADER.unpack_from(end.received)[0]
            if len(end.received) < HEADER.size + size:
                break
            with memoryview(end.received) as view:  # released before the bytes go
                ok, value = _answer(view[HEADER.size:HEADER.size + size])
            del end.received[:HEADER.size + size]
            future, method = end.waiting.popleft()
            if future.done():  # its caller gave up on it
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(_raised(method, *value))

    # -- closing ---------------------------------------------------------------------------
    def _closed_error(self) -> ChannelClosed:
        why = f": {self._closed}" if self._closed is not None else ""
        return ChannelClosed(f"the socket channel of this group is closed{why}")

    def _close(self, why: BaseException) -> None:
        """On the loop: stop watching the connections, close them, and fail every call
        in flight."""
        with self._lock:
            if self._closed is not None and not self._ends:
                return
            if self._closed is None:
                self._closed = why
                logger.warning("socket channel closed: %s", why)
            ends, self._ends = self._ends, []
        for end in ends:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(end.sock.fileno())
                self._loop.remove_writer(end.sock.fileno())
            end.sock.close()
            while end.waiting:
                future, _ = end.waiting.popleft()
                if not future.done():
                    future.set_exception(self._closed_error())

    def teardown(self) -> None:
        """Close the connections (the workers stay; each rank's thread ends): calls in
        flight fail, later ones fail at once. From any thread."""
        why = ChannelClosed("torn down")
        loop = self._loop
        if loop is None or loop.is_closed():
            self._close(why)
            return
        if _running_loop() is loop:
            self._close(why)
            return
        try:
            loop.call_soon_threadsafe(self._close, why)
        except RuntimeError:  # the loop closed meanwhile
            self._close(why)


def _frames(steps: list[Step], signature: Callable[[str], inspect.Signature | None]) -> list[bytes | None]:
    """Each rank's frame, its arguments first checked against ``signature(method)`` (a
    ``TypeError`` naming the mismatch, with nothing sent); ranks given the very same
    arguments (a broadcast) share one check and one pickling."""
    made: dict[tuple, bytes] = {}
    frames: list[bytes | None] = []
    for step in steps:
        if step is None:
            frames.append(None)
            continue
        method, args, kwargs = step
        key = (method, tuple(map(id, args)), tuple((name, id(value)) for name, value in kwargs.items()))
        if key not in made:
            parameters = signature(method)
            if parameters is not None:
                parameters.bind(*args, **kwargs)
            made[key] = frame(step)
        frames.append(made[key])
    return frames


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _still_needed(received: bytearray) -> int:
    """Bytes the frame being read still lacks (0 before its header is in)."""
    if len(received) < HEADER.size:
        return 0
    return HEADER.size + HEADER.unpack_from(received)[0] - len(received)


def _answer(payload: memoryview) -> tuple[bool, Any]:
    """A rank's answer frame: ``(True, value)`` or ``(False, (exception, traceback))``; one
    that does not unpickle here (a class this process cannot import) is the method's error."""
    try:
        return pickle.loads(payload)
    except Exception as exc:
        return False, (RuntimeError(f"the rank's answer does not unpickle here: {type(exc).__name__}: {exc}"), "")


def _raised(method: str, exc: BaseException, text: str) -> BaseException:
    """A rank's exception as Ray raises a method's: a ``RayTaskError`` that is also an
    instance of the method's exception."""
    return ray.exceptions.RayTaskError(method, text, exc).as_instanceof_cause()

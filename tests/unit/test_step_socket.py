"""A rank's end of a socket channel (single_controller.base.step_socket), without Ray: the
token gate, steps answered in order, a method's exception and its traceback, and the end
of the connection; and the owner's frames. tests/ray/test_transports.py drives the
owner's end (single_controller.ray.socket_channel) on real ranks."""

from __future__ import annotations

import pickle
import socket
import threading

import pytest

from single_controller.base.step_socket import HEADER, TOKEN_BYTES, frame, serve_steps
from single_controller.ray.socket_channel import _answer, _frames

TOKEN = bytes(range(TOKEN_BYTES))


class Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("this exception does not pickle")


class Rank:
    """What a Worker's ``_execute_compiled`` runs, with a record of the thread it ran on."""

    def __init__(self) -> None:
        self.seen: list = []
        self.threads: set[str] = set()

    def execute(self, step):
        if step is None:
            return None
        method, args, kwargs = step
        self.threads.add(threading.current_thread().name)
        return getattr(self, method)(*args, **kwargs)

    def add(self, x):
        self.seen.append(x)
        return sum(self.seen)

    def fail(self):
        raise KeyError("no such thing")

    def fail_oddly(self):
        raise Unpicklable("odd")

    async def later(self, x):
        return x * 2


def connect(port: int, token: bytes = TOKEN) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(token)
    return sock


def read_frame(sock: socket.socket):
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            assert chunk, "the rank closed the connection"
            data += chunk
        return data

    return pickle.loads(exactly(HEADER.unpack(exactly(HEADER.size))[0]))


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:  # closed with our frame unread
        return True


def call(sock: socket.socket, method: str, *args):
    sock.sendall(frame((method, args, {})))
    return read_frame(sock)


def test_steps_run_in_order_on_the_ranks_own_thread_after_its_setup():
    rank = Rank()
    set_up: list[str] = []
    sock = connect(serve_steps("127.0.0.1", TOKEN, rank.execute, lambda: set_up.append(threading.current_thread().name)))
    with sock:
        for x in (3, 4, 5):  # sent back to back, answered in order
            sock.sendall(frame(("add", (x,), {})))
        assert [read_frame(sock) for _ in range(3)] == [(True, 3), (True, 7), (True, 12)]
        assert call(sock, "later", 21) == (True, 42)  # an async method runs to its end
    assert rank.seen == [3, 4, 5]
    assert rank.threads == {"step-socket"} and set_up == ["step-socket"]


def test_a_method_that_raises_answers_its_exception_and_traceback_and_the_channel_goes_on():
    sock = connect(serve_steps("127.0.0.1", TOKEN, Rank().execute))
    with sock:
        ok, (exc, text) = call(sock, "fail")
        assert not ok and isinstance(exc, KeyError) and "no such thing" in text and "def fail" not in text
        assert "in fail" in text
        ok, (exc, text) = call(sock, "fail_oddly")
        assert not ok and type(exc) is RuntimeError and str(exc) == "Unpicklable: odd"
        assert call(sock, "add", 1) == (True, 1)


def test_only_the_connection_with_the_token_is_served():
    rank = Rank()
    port = serve_steps("127.0.0.1", TOKEN, rank.execute)
    with connect(port, bytes(TOKEN_BYTES)) as stranger:
        stranger.sendall(frame(("add", (100,), {})))
        assert closed_by_peer(stranger), "a connection without the token was served"
    with connect(port) as owner:
        assert call(owner, "add", 1) == (True, 1)
        # the rank stopped listening once its owner was in
        with pytest.raises(OSError):
            connect(port).recv(1)
    assert rank.seen == [1]


def test_a_token_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match=f"a channel token is {TOKEN_BYTES} bytes, got 3"):
        serve_steps("127.0.0.1", b"abc", Rank().execute)


def test_ranks_given_the_same_arguments_share_one_pickling_and_others_get_their_own():
    big, other = list(range(1000)), list(range(1000))
    broadcast = [("add", (big,), {"scale": 2})] * 2 + [("add", (big,), {"scale": 2}), None, ("add", (other,), {})]
    frames = _frames(broadcast, lambda method: None)
    assert frames[0] is frames[1] is frames[2] and frames[3] is None
    assert frames[4] is not frames[0] and frames[4] == frame(("add", (other,), {}))
    assert pickle.loads(frames[0][HEADER.size:]) == ("add", (big,), {"scale": 2})


def test_arguments_that_do_not_fit_the_method_are_refused_before_anything_is_pickled():
    import inspect

    def add(x, scale=1):
        return x * scale

    signature = inspect.signature(add)
    assert _frames([("add", (1,), {"scale": 2})] * 2, lambda method: signature)[0] is not None
    with pytest.raises(TypeError, match="blocking"):
        _frames([("add", (1,), {"blocking": False})], lambda method: signature)


def test_a_step_that_does_not_unpickle_on_the_rank_is_answered_as_its_error():
    sock = connect(serve_steps("127.0.0.1", TOKEN, Rank().execute))
    with sock:
        body = pickle.dumps(("add", (1,), {}))
        broken = body.replace(b"builtins", b"nowhere_", 1) if b"builtins" in body else b"\x80\x05not a pickle."
        sock.sendall(HEADER.pack(len(broken)) + broken)
        ok, (exc, _text) = read_frame(sock)
        assert not ok and isinstance(exc, Exception)
        assert call(sock, "add", 2) == (True, 2)  # the connection goes on


def test_an_answer_that_does_not_unpickle_here_is_the_methods_error():
    ok, (exc, text) = _answer(memoryview(b"\x80\x05garbage"))
    assert not ok and isinstance(exc, RuntimeError) and "does not unpickle here" in str(exc) and text == ""

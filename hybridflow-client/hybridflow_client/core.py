"""The clients' one core: every operation written once, without I/O.

Each public operation is a generator that yields what it needs done, a :class:`Request`
to send or a :class:`Pause` to wait, is sent back the ``httpx.Response`` (or the
``httpx.TransportError`` it raised, thrown in), and returns the result. :class:`ClientAPI`
defines every public method once on top of these; the blocking and the async client
(:mod:`hybridflow_client.python_client`) only say how a request is sent and a pause is
waited. The requests and answers themselves are made in :mod:`hybridflow_client.messages`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import httpx

from hybridflow_client.messages import (
    JSON_TYPE,
    OCTET_STREAM_TYPE,
    SAFETENSORS_TYPE,
    InferResult,
    Request,
    ServiceError,
    call_answer,
    call_request,
    infer_request,
    infer_result,
    json_answer,
    one_output,
    ready_answer,
    segment,
)
from hybridflow_client.version import __version__
from hybridflow_client.wire.dataproto import is_dataproto
from hybridflow_client.wire.tensordicts import is_tensordict

if TYPE_CHECKING:
    from hybridflow_client.wire.tensors import Tensor

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_URL",
    "JSON_TYPE",
    "OCTET_STREAM_TYPE",
    "SAFETENSORS_TYPE",
    "ClientAPI",
    "Done",
    "GroupProxy",
    "InferResult",
    "Operation",
    "Pause",
    "Request",
    "ServiceError",
    "advance",
]

T = TypeVar("T")

DEFAULT_URL = "http://127.0.0.1:8000"
#: Read timeout of a request: the tutorial's full MLP layer takes minutes on a small CPU machine.
DEFAULT_TIMEOUT_S = 600.0


@dataclass
class Pause:
    """Wait this many seconds before the next step."""

    seconds: float


@dataclass
class Done:
    """An operation's result."""

    value: Any


#: What an operation yields, is sent, and returns.
Operation = Generator[Request | Pause, httpx.Response | None, T]


def advance(operation: Operation, reply: httpx.Response | BaseException | None = None) -> Request | Pause | Done:
    """Give the operation the last step's reply (an exception is thrown into it) and get
    its next step, or :class:`Done` with its result. Start it with no reply."""
    try:
        if isinstance(reply, BaseException):
            return operation.throw(reply)
        return operation.send(reply)
    except StopIteration as stop:
        return Done(stop.value)


# -- operations --------------------------------------------------------------------------


def _exchange(request: Request, parse: Callable[[httpx.Response], T]) -> Operation[T]:
    """One request, its answer parsed."""
    response = yield request
    return parse(response)


def _get_json(path: str) -> Operation[Any]:
    return _exchange(Request("GET", path), json_answer)


def _wait_ready(timeout: float, interval: float) -> Operation[bool]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ready_answer((yield Request("GET", "/readyz"))):
                return True
        except httpx.TransportError:
            pass
        if time.monotonic() >= deadline:
            return False
        yield Pause(min(interval, max(0.0, deadline - time.monotonic())))


def _full_or_output(answer: dict[str, Any], full: bool) -> Any:
    return answer if full else answer["output"]


def _job_result(job_id: str, binary: bool, full: bool) -> Operation[Any]:
    status = json_answer((yield Request("GET", f"/v1/jobs/{segment(job_id)}")))
    headers = {"Accept": SAFETENSORS_TYPE} if binary else {}
    response = yield Request("GET", f"/v1/jobs/{segment(job_id)}/result", headers=headers)
    return _full_or_output(call_answer(status["group"], status["method"], response), full)


def _wait_job(
    job_id: str, on_progress: Callable[[dict[str, Any]], None] | None, interval: float
) -> Operation[dict[str, Any]]:
    while True:
        status = json_answer((yield Request("GET", f"/v1/jobs/{segment(job_id)}")))
        if on_progress is not None:
            on_progress(status)
        if status["status"] not in ("queued", "running"):
            return status
        yield Pause(interval)


# -- the API -----------------------------------------------------------------------------


def _client_options(
    url: str, token: str | None, timeout: float | httpx.Timeout | None, headers: Mapping[str, str] | None
) -> dict[str, Any]:
    all_headers = {"User-Agent": f"hybridflow-client/{__version__}", **(headers or {})}
    if token:
        all_headers["Authorization"] = f"Bearer {token}"
    if timeout is not None and not isinstance(timeout, httpx.Timeout):
        timeout = httpx.Timeout(timeout, connect=min(10.0, timeout))
    return {"base_url": url.rstrip("/"), "headers": all_headers, "timeout": timeout}


class ClientAPI:
    """Every method of the clients, written once. A subclass names its httpx client class
    (``http_client``) and runs operations (``_drive``): the blocking client returns each
    method's result, the async one a coroutine of it.

    ``url``: the service, like ``http://127.0.0.1:8000``; ``token``: sent as
    ``Authorization: Bearer <token>``; ``timeout``: default seconds to wait for an answer
    (None: forever); ``headers``: extra headers on every request; ``transport``: an httpx
    transport to use instead of the network (``httpx.MockTransport``,
    ``httpx.ASGITransport`` in tests).

    Tensors go in as torch tensors or numpy arrays (numbers and lists of numbers too) and
    come back as torch tensors where torch is installed, else as numpy arrays.
    """

    http_client: ClassVar[type[httpx.Client] | type[httpx.AsyncClient]]

    def __init__(
        self,
        url: str = DEFAULT_URL,
        token: str | None = None,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT_S,
        headers: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
    ) -> None:
        options = _client_options(url, token, timeout, headers)
        self.url: str = options["base_url"]
        self._http = self.http_client(transport=transport, **options)

    def _drive(self, operation: Operation[T]) -> Any:
        raise NotImplementedError

    # -- health and groups ---------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """``GET /healthz``'s answer; raises :class:`ServiceError` when not live."""
        return self._drive(_get_json("/healthz"))

    def healthy(self) -> bool:
        """True when ``GET /healthz`` answers 200."""
        return self._drive(_exchange(Request("GET", "/healthz"), lambda response: response.status_code == 200))

    def ready(self) -> bool:
        """``GET /readyz``: True when every group is ready, False on 503."""
        return self._drive(_exchange(Request("GET", "/readyz"), ready_answer))

    def wait_ready(self, timeout: float = 300.0, interval: float = 1.0) -> bool:
        """Poll :meth:`ready` (a connection error counts as not ready) until it is True or
        ``timeout`` seconds pass; returns whether the service became ready."""
        return self._drive(_wait_ready(timeout, interval))

    def groups(self) -> list[dict[str, Any]]:
        """``GET /v1/groups``: every group's summary."""
        return self._drive(_exchange(Request("GET", "/v1/groups"), lambda response: json_answer(response)["groups"]))

    def group(self, name: str) -> dict[str, Any]:
        """``GET /v1/groups/{name}``: one group with per-rank details."""
        return self._drive(_get_json(f"/v1/groups/{segment(name)}"))

    # -- calls ---------------------------------------------------------------------------
    def call(
        self,
        group: str,
        method: str,
        *args: Any,
        binary: bool = False,
        binary_output: bool | None = None,
        full: bool = False,
        idempotency_key: str | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> Any:
        """``POST /v1/groups/{group}/{method}`` with ``args`` and ``kwargs`` (tensors, numpy
        arrays and JSON values); returns the collected output (``full=True``: the whole
        answer, a dict with group, method, dispatch_mode, execute_mode, world_size and
        output).

        ``binary``: send the keyword arguments as safetensors (tensors, numbers and lists of
        them) and ask for the output as safetensors (``binary_output`` overrides the
        latter). ``idempotency_key`` is sent as ``Idempotency-Key``; ``timeout`` overrides
        the client's for this call. A method keyword argument with one of these names
        must go through :meth:`call_with`."""
        return self.call_with(
            group, method, args, kwargs, binary=binary, binary_output=binary_output, full=full,
            idempotency_key=idempotency_key, timeout=timeout,
        )

    def call_with(
        self,
        group: str,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        binary: bool = False,
        binary_output: bool | None = None,
        full: bool = False,
        idempotency_key: str | None = None,
        timeout: float | None = None,
    ) -> Any:
        """:meth:`call` with the method's arguments given as a sequence and a mapping. A
        DataProto or TensorDict argument (verl's batch types; by keyword) always travels as
        safetensors, and a DataProto or TensorDict answer comes back as one (see
        :mod:`hybridflow_client.wire.dataproto`, :mod:`hybridflow_client.wire.tensordicts`)."""
        kwargs = kwargs or {}
        dataprotos = [type(value) for value in (*args, *kwargs.values()) if is_dataproto(value)]
        if any(is_dataproto(value) or is_tensordict(value) for value in kwargs.values()):
            binary = True
        request = call_request(
            f"/v1/groups/{segment(group)}/{segment(method)}", args, kwargs, binary,
            binary if binary_output is None else binary_output, idempotency_key, timeout,
        )
        like = dataprotos[0] if dataprotos else None
        return self._drive(
            _exchange(request, lambda response: _full_or_output(call_answer(group, method, response, like), full))
        )

    def group_proxy(self, group: str) -> GroupProxy:
        """``client.group_proxy("gpu_accumulator").add(x=[1, 1, 1, 1])``: the tutorial's
        ``worker_group.add(...)``, over HTTP; returns the output (awaitable with the async
        client)."""
        return GroupProxy(self, group)

    # -- jobs: long calls that answer at once ----------------------------------------------
    def submit_job(
        self,
        group: str,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        binary: bool = False,
        split: int = 1,
    ) -> dict[str, Any]:
        """``POST /v1/jobs/{group}/{method}``: the job's status (with its ``id``)."""
        path = f"/v1/jobs/{segment(group)}/{segment(method)}?split={int(split)}"
        return self._drive(_exchange(call_request(path, args, kwargs or {}, binary, False), json_answer))

    def job(self, job_id: str) -> dict[str, Any]:
        """``GET /v1/jobs/{id}``: status, progress (0..1), elapsed seconds."""
        return self._drive(_get_json(f"/v1/jobs/{segment(job_id)}"))

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        """``DELETE /v1/jobs/{id}``: no further pieces start; the job's status."""
        return self._drive(_exchange(Request("DELETE", f"/v1/jobs/{segment(job_id)}"), json_answer))

    def job_result(self, job_id: str, binary: bool = False, full: bool = False) -> Any:
        """A finished job's output (``full=True``: the whole answer); 409 while it runs."""
        return self._drive(_job_result(job_id, binary, full))

    def wait_job(
        self, job_id: str, on_progress: Callable[[dict[str, Any]], None] | None = None, interval: float = 0.5
    ) -> dict[str, Any]:
        """Poll until the job finishes; ``on_progress`` sees every status."""
        return self._drive(_wait_job(job_id, on_progress, interval))

    # -- Open Inference Protocol -----------------------------------------------------------
    def server_metadata(self) -> dict[str, Any]:
        """``GET /v2``."""
        return self._drive(_get_json("/v2"))

    def model_metadata(self, model: str) -> dict[str, Any]:
        """``GET /v2/models/{model}``."""
        return self._drive(_get_json(f"/v2/models/{segment(model)}"))

    def infer(
        self,
        model: str,
        x: Any,
        input_name: str = "x",
        output_name: str = "y",
        *,
        binary: bool = True,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> Tensor:
        """One input, one output: ``x`` (tensor or numpy array) in as ``input_name``, the
        ``output_name`` tensor back; binary tensor data both ways unless ``binary`` is False."""
        request = infer_request(
            f"/v2/models/{segment(model)}/infer", {input_name: x}, [output_name], binary, binary, request_id,
            None, timeout,
        )
        return self._drive(_exchange(request, lambda response: one_output(infer_result(response), output_name)))

    def infer_tensors(
        self,
        model: str,
        inputs: Mapping[str, Any],
        outputs: Sequence[str] | None = None,
        *,
        binary_inputs: bool = True,
        binary_outputs: bool = True,
        request_id: str | None = None,
        parameters: Mapping[str, Any] | None = None,
        version: str | None = None,
        timeout: float | None = None,
    ) -> InferResult:
        """``POST /v2/models/{model}/infer`` with several inputs; ``outputs`` names the ones
        to return (None: all of them)."""
        path = f"/v2/models/{segment(model)}"
        if version:
            path += f"/versions/{segment(version)}"
        request = infer_request(
            path + "/infer", inputs, outputs, binary_inputs, binary_outputs, request_id, parameters, timeout
        )
        return self._drive(_exchange(request, infer_result))


class GroupProxy:
    """Attribute access gives a method caller that returns the output (a coroutine with
    the async client)."""

    def __init__(self, client: ClientAPI, group: str) -> None:
        self._client = client
        self._group = group

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):
            raise AttributeError(method)
        client, group = self._client, self._group

        def call(*args: Any, **kwargs: Any) -> Any:
            return client.call_with(group, method, args, kwargs)

        return call

    def __repr__(self) -> str:
        return f"<group {self._group!r} at {self._client.url}>"

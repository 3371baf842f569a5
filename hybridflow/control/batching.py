"""Dynamic batching of inference requests on the controller's event loop (Triton's
dynamic batcher, for a model with one instance).

Concurrent requests to one model wait in a queue per (shape, dtype): requests of
different shapes or dtypes never share a batch. One batch of a model runs on its group at
a time; a batch leaves when the group is free and either ``max_batch_size`` requests of
one kind wait or the oldest of them has waited ``max_delay_s`` (at most: less by up to
the loop's timer resolution, ``TIMER_SLACK_S``, rather than more). While a batch runs, the
requests that arrive form the next one. With ``wait_when_idle=False`` a request that finds
no batch of its model running leaves at once instead of waiting for others: a lone
request costs no delay, and under load batches still form while a batch runs. A batch is
the requests' tensors concatenated along ``batch_dim``, sent as one call; the output is
split back along the same dimension, each request getting a tensor of its own (a copy,
not a view of the batch's output). A batch of ``OFF_LOOP_BYTES`` or more is concatenated
and split in a thread, so a large copy never holds the event loop.

Only for row-wise methods: a method whose output rows along ``batch_dim`` depend on the
matching input rows alone (an MLP layer, echo), so that each answer is the one the
request would have got alone, bit for bit. For a tensor-parallel layer that takes more:
its all-reduce cuts the flattened output into ``tp`` equal parts and adds the ranks'
partial sums in an order that depends on the part, so a value must stay in its part.
Concatenating along ``batch_dim`` keeps it there exactly when the product of the sizes
before ``batch_dim`` (the sequence length for ``[seq, batch, hidden]``) is a multiple of
``tp`` (``row_multiple``); a request for which it is not runs alone.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

#: How late a timer of the event loop can fire: its selector (epoll) sleeps in whole
#: milliseconds, rounded up. A batch due within this is sent now, so the delay a config
#: sets is the most a request waits, not that plus the rounding.
TIMER_SLACK_S = 1e-3
#: Bytes of a batch's inputs (or of its output) from which they are concatenated (split)
#: in a thread rather than on the event loop; below it the hop costs more than the copy.
OFF_LOOP_BYTES = 1 << 20


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


async def _off_loop_when_large(nbytes: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, in a thread when ``nbytes`` reach ``OFF_LOOP_BYTES`` (torch copies
    release the GIL, so the loop runs meanwhile)."""
    if nbytes >= OFF_LOOP_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


@dataclass(frozen=True)
class Ran:
    """A group call's output with the version of the weights it ran on (a group whose
    worker declares weights: ``hybridflow.control.weights``)."""

    output: torch.Tensor
    weights_version: int | None = None


#: Runs one batch on the group: the concatenated input in, the concatenated output out
#: (or a :class:`Ran`). An exception it raises reaches every request of the batch.
RunBatch = Callable[[torch.Tensor], Awaitable[torch.Tensor | Ran]]


@dataclass
class Batched:
    """One request's share of a batch, with what statistics need."""

    output: torch.Tensor
    #: Seconds from arrival until its batch started, and the batch's group call.
    queue_s: float
    compute_s: float
    batch_size: int
    #: The weights version the batch ran on (None: a group without weights).
    weights_version: int | None = None


def _ran(answer: torch.Tensor | Ran) -> Ran:
    return answer if isinstance(answer, Ran) else Ran(answer)


@dataclass(eq=False)  # identity: a request is itself, whatever its tensor
class _Waiting:
    x: torch.Tensor
    future: asyncio.Future
    arrived: float = field(default_factory=time.perf_counter)


class Batcher:
    """The queue of one model. ``submit(x)`` returns ``x``'s output once its batch ran."""

    def __init__(
        self,
        run: RunBatch,
        max_batch_size: int,
        max_delay_s: float,
        batch_dim: int = 0,
        row_multiple: int = 1,
        max_in_flight: int = 1,
        wait_when_idle: bool = True,
    ) -> None:
        if min(max_batch_size, row_multiple, max_in_flight) < 1 or max_delay_s < 0 or batch_dim < 0:
            raise ValueError(
                f"max_batch_size, row_multiple and max_in_flight must be >= 1, max_delay_s and batch_dim >= 0; "
                f"got {max_batch_size}, {row_multiple}, {max_in_flight}, {max_delay_s}, {batch_dim}"
            )
        self.run = run
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_s
        self.batch_dim = batch_dim
        self.row_multiple = row_multiple
        self.max_in_flight = max_in_flight
        self.wait_when_idle = wait_when_idle
        self._queues: dict[tuple, list[_Waiting]] = {}
        self._in_flight = 0
        self._wake = asyncio.Event()  # a request arrived or a batch finished
        self._scheduler: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()  # the loop keeps only weak references
        #: Batches run and requests answered through them (so their ratio is the mean size).
        self.batches = 0
        self.requests = 0

    def waiting(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    async def submit(self, x: torch.Tensor) -> Batched:
        if x.dim() <= self.batch_dim:
            raise ValueError(f"a batched input needs dimension {self.batch_dim}, got shape {list(x.shape)}")
        if math.prod(x.shape[: self.batch_dim]) % self.row_multiple:
            return await run_alone(self.run, x)  # batched, its values would be summed in another order
        loop = asyncio.get_running_loop()
        waiting = _Waiting(x, loop.create_future())
        key = (tuple(x.shape), x.dtype)
        self._queues.setdefault(key, []).append(waiting)
        self._wake.set()
        if self._scheduler is None or self._scheduler.done():
            self._scheduler = loop.create_task(self._schedule())
        try:
            return await waiting.future
        except asyncio.CancelledError:
            self._forget(key, waiting)  # the caller went away: drop it unless its batch already left
            raise

    def _forget(self, key: tuple, waiting: _Waiting) -> None:
        queue = self._queues.get(key, [])
        if waiting in queue:
            queue.remove(waiting)
            if not queue:
                del self._queues[key]

    def _next(self, now: float) -> tuple[tuple | None, float | None]:
        """The kind whose batch should leave now (full, or its oldest waited long
        enough, or nothing runs and idle groups do not wait; the oldest first), else the
        earliest time one will be due."""
        due_key, due_at, wake_at = None, None, None
        leave_now = not self.wait_when_idle and self._in_flight == 0
        for key, queue in self._queues.items():
            oldest = queue[0].arrived
            # due a timer's rounding early, so that the wait never runs past the delay
            deadline = oldest + self.max_delay_s - TIMER_SLACK_S
            if leave_now or len(queue) >= self.max_batch_size or deadline <= now:
                if due_at is None or oldest < due_at:
                    due_key, due_at = key, oldest
            elif wake_at is None or deadline < wake_at:
                wake_at = deadline
        return due_key, wake_at

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queues:
            self._wake.clear()
            deadline: asyncio.TimerHandle | None = None
            if self._in_flight < self.max_in_flight:
                key, wake_at = self._next(time.perf_counter())
                if key is not None:
                    queue = self._queues[key]
                    batch, queue[:] = queue[: self.max_batch_size], queue[self.max_batch_size:]
                    if not queue:
                        del self._queues[key]
                    self._in_flight += 1
                    task = loop.create_task(self._run(batch))
                    self._running.add(task)
                    task.add_done_callback(self._running.discard)
                    continue
                if wake_at is not None:
                    deadline = loop.call_later(max(0.0, wake_at - time.perf_counter()), self._wake.set)
            # Wait for a new request, a finished batch, or the next deadline. A timer that
            # sets the event, not wait_for: that wraps the wait in a task of its own and, at
            # the deadline, spends loop turns cancelling it while the lone request waits.
            try:
                await self._wake.wait()
            finally:
                if deadline is not None:
                    deadline.cancel()

    async def _run(self, batch: list[_Waiting]) -> None:
        started = time.perf_counter()
        outputs: list[torch.Tensor] | BaseException
        version = None
        try:
            inputs = [w.x for w in batch]
            if len(inputs) == 1:
                x = inputs[0]
            else:
                x = await _off_loop_when_large(_nbytes(inputs), torch.cat, inputs, self.batch_dim)
            ran = _ran(await self.run(x))
            version = ran.weights_version
            sizes = [w.x.shape[self.batch_dim] for w in batch]
            outputs = await _off_loop_when_large(_nbytes([ran.output]), self._split, ran.output, sizes)
        except BaseException as exc:  # every request of the batch gets it
            outputs = exc
        finally:
            self._in_flight -= 1
            self._wake.set()
        compute_s = time.perf_counter() - started
        self.batches += 1
        self.requests += len(batch)
        for index, waiting in enumerate(batch):
            if waiting.future.done():
                continue
            if isinstance(outputs, asyncio.CancelledError):
                waiting.future.cancel()
            elif isinstance(outputs, BaseException):
                waiting.future.set_exception(outputs)
            else:
                waiting.future.set_result(
                    Batched(outputs[index], started - waiting.arrived, compute_s, len(batch), version)
                )
        if isinstance(outputs, asyncio.CancelledError):
            raise outputs

    def _split(self, y: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        if len(sizes) == 1:
            return [y]
        if not isinstance(y, torch.Tensor) or y.dim() <= self.batch_dim or y.shape[self.batch_dim] != sum(sizes):
            shape = list(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise ValueError(
                f"the batched output {shape} does not have the {sum(sizes)} rows of its input along "
                f"dimension {self.batch_dim}: the method is not row-wise"
            )
        # Copies: a view would keep (and, pickled, send) the whole batch's output.
        return [part.clone() for part in torch.split(y, sizes, dim=self.batch_dim)]


async def run_alone(run: RunBatch, x: torch.Tensor) -> Batched:
    """A request of a model that does not batch: its own group call, timed alike."""
    started = time.perf_counter()
    ran = _ran(await run(x))
    return Batched(ran.output, 0.0, time.perf_counter() - started, 1, ran.weights_version)

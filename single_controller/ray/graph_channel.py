"""A group's calls through one Ray Compiled Graph, for a caller on an asyncio event loop.

``GraphChannel(group)`` compiles a graph over the group's processes (:meth:`compile`,
blocking: run it in a thread) and then takes the group's calls the way its own Ray
tasks take them: :meth:`submit` (the method's dispatch and collect, as
``group.submit``), :meth:`execute_all_async` and :meth:`execute_rank_zero_async`, each
answering asyncio futures of the calling loop, one per rank. A call is one write of
every rank's arguments into the graph's shared input and one read per rank, instead of
one Ray task submission per rank.

Order: calls enter the graph in the order they were made (one writer thread, first in
first out), and each rank runs the graph's steps in that order. The graph runs on each
rank beside the actor's ordinary tasks (Ray gives it a thread of its own), so a caller
that keeps one order on the ranks sends every call that reads or changes their state
through the channel; pings and identity queries may stay ordinary tasks.

Failures: a method that raises fails that call's futures with its ``RayTaskError`` and
the graph stays usable. A lost rank, a read past ``read_timeout_s`` or a write that
fails leave the graph out of step: every call in flight and every later call fails
(``GraphClosed`` for the later ones) until the owner builds a new channel.

Cost: while the graph exists every rank polls its input, idle or not (see
``single_controller.ray.compiled``), so a channel suits groups on cores of their own.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from ray.experimental.channel.common import CompiledDAGArgs

from single_controller.ray.step_channel import Step, StepChannel

logger = logging.getLogger(__name__)



class GraphClosed(ray.exceptions.RayError):
    """The channel's graph was torn down, or failed and went out of step: like a lost
    worker, the group needs a new one."""


class GraphChannel(StepChannel):
    """``group``'s calls over one compiled graph; ``max_inflight`` calls at once (later
    ones wait for a slot, in order)."""

    #: The graph's writer thread pickles a call's arguments, not the caller's thread.
    pickles_in_caller = False

    def __init__(self, group: Any, max_inflight: int = 16, read_timeout_s: float | None = None) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1, got {max_inflight}")
        self.group = group
        self.max_inflight = max_inflight
        #: Seconds a rank's answer may take (None: as long as it takes); past it the graph
        #: is out of step and closes.
        self.read_timeout_s = read_timeout_s
        self._graph: Any = None
        self._closed: BaseException | None = None
        self._slots = threading.Semaphore(max_inflight)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="graph-write")
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="graph-read")

    @property
    def compiled(self) -> bool:
        return self._graph is not None and self._closed is None

    def compile(self) -> GraphChannel:
        """Build the graph over the group's processes (blocking: seconds). Calls already
        submitted to the group as ordinary tasks finish first."""
        from ray.dag import InputNode, MultiOutputNode

        workers = self.group.workers
        # The graph's steps run beside ordinary tasks: a ping queued behind every earlier
        # task on each rank says they are done.
        ray.get([w._ping.remote() for w in workers], timeout=self.read_timeout_s)
        with InputNode() as steps:
            dag = MultiOutputNode([w._execute_compiled.bind(steps[rank]) for rank, w in enumerate(workers)])
        self._graph = dag.experimental_compile(_max_inflight_executions=self.max_inflight)
        return self

    # -- calls ------------------------------------------------------------------------------
    def _send(self, steps: list[Step]) -> list[asyncio.Future]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in steps]
        if not self.compiled:
            _settle(futures, [(False, self._closed_error())] * len(steps))
            return futures
        self._writer.submit(self._write, loop, steps, futures)
        return futures

    # -- the writer and reader threads ---------------------------------------------------------
    def _write(self, loop: asyncio.AbstractEventLoop, steps: list[Step], futures: list[asyncio.Future]) -> None:
        self._slots.acquire()
        try:
            if not self.compiled:
                raise self._closed_error()
            _write_step(self._graph, steps)
        except BaseException as exc:
            self._slots.release()
            self._close(exc)
            loop.call_soon_threadsafe(_settle, futures, [(False, exc)] * len(steps))
            return
        self._reader.submit(self._read, loop, futures)

    def _read(self, loop: asyncio.AbstractEventLoop, futures: list[asyncio.Future]) -> None:
        try:
            values = _read_step(self._graph, -1 if self.read_timeout_s is None else self.read_timeout_s)
            outcomes = [(not isinstance(v, ray.exceptions.RayTaskError), v) for v in values]
            if any(not ok and not _method_raised(v) for ok, v in outcomes):
                self._close(next(v for ok, v in outcomes if not ok))  # a lost peer: out of step
        except BaseException as exc:  # a lost rank, a closed channel, a timeout: out of step
            self._close(exc)
            outcomes = [(False, exc)] * len(futures)
        finally:
            self._slots.release()
        loop.call_soon_threadsafe(_settle, futures, outcomes)

    # -- closing ---------------------------------------------------------------------------
    def _closed_error(self) -> GraphClosed:
        why = f": {type(self._closed).__name__}" if self._closed is not None else ""
        return GraphClosed(f"the compiled graph of this group is closed{why}")

    def _close(self, why: BaseException) -> None:
        if self._closed is None:
            self._closed = why
            logger.warning("compiled graph closed: %s", why)

    def teardown(self) -> None:
        """Release the graph (the workers stay): calls in flight and calls waiting to be
        written fail, later ones fail at once. Blocking; the owner calls it before it
        shuts the group down."""
        self._close(GraphClosed("torn down"))
        graph, self._graph = self._graph, None
        if graph is not None:
            try:
                graph.teardown()
            except Exception as exc:  # its actors may be gone already
                logger.info("compiled graph teardown: %s", exc)
        # The writes still queued run and fail at once (each settles its futures); the
        # reads end with the graph's channels.
        self._writer.shutdown(wait=False)
        self._reader.shutdown(wait=False)


# The graph's input writer and output reader, each used from one thread of its own: the
# graph's execute() and a result's get() each touch both sides and are not thread-safe
# against each other, while its writer and reader are (Ray's asyncio mode runs them in
# two threads the same way). Ray is pinned, so these attributes are known.
def _write_step(graph: Any, steps: list[Step]) -> None:
    graph._dag_submitter.write(CompiledDAGArgs(args=tuple(steps), kwargs={}), graph._submit_timeout)


def _read_step(graph: Any, timeout_s: float) -> list[Any]:
    """Every rank's answer to the oldest step not read yet (a rank's exception as a value)."""
    return graph._dag_output_fetcher.read(timeout_s)


def _method_raised(exc: BaseException) -> bool:
    """Whether a rank's answer is its method's own exception (the graph goes on), not a
    lost rank or channel reported as a task's error."""
    if not isinstance(exc, ray.exceptions.RayTaskError) or isinstance(exc, ray.exceptions.RayActorError):
        return False
    cause = getattr(exc, "cause", None)
    return not isinstance(cause, ray.exceptions.RayError)


def _settle(futures: list[asyncio.Future], outcomes: list[tuple[bool, Any]]) -> None:
    for future, (ok, value) in zip(futures, outcomes, strict=True):
        if future.done():
            continue
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

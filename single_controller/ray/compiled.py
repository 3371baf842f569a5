"""A worker group's methods run through one Ray Compiled Graph (``ray.dag``).

``wg.compile()`` returns a :class:`CompiledWorkerGroup`: the same registered methods,
the same dispatch and collect, and ``execute_all_sync`` / ``execute_rank_zero_sync``,
but each call is one ``execute`` of a graph compiled once for the group, over shared
memory channels instead of a Ray task per rank. What stays the same as a plain call:

- Order: a compiled call starts after every plain call already submitted to the group
  has finished, and ends before any later call is submitted (they share the group's
  lock), so each rank sees plain and compiled calls in the one order they were made.
- Errors: a method that raises raises the same ``RayTaskError`` here, after every rank
  answered; the graph stays usable for the next call.
- The workers stay reachable: plain calls (and other roles' calls) keep working while
  the graph exists.

What differs: calls are always blocking (``blocking=False`` has no futures to give);
a call's whole input is written once and read by every rank, so a DP-split batch is
read by all ranks (each keeps its own part). Timeouts and lost workers tear the graph
down (it is rebuilt on the next call), and the error is raised.

What it costs: while the graph exists each rank's process keeps polling its input
channel, idle or not, so an idle graph costs CPU time; nothing polls before the graph is
built or after ``teardown()``. So it suits a burst of small calls on cores of their own,
followed by ``teardown()``; not a service that idles between calls on shared cores.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayTaskError

from single_controller.base.decorator import MethodSpec
from single_controller.base.modes import Execute
from single_controller.base.worker_group import dispatch_arguments, split_per_rank, unpad_output

Call = tuple[str, tuple, dict] | None


class CompiledWorkerGroup:
    """``wg.compile()``: the methods of ``wg``, each call one compiled-graph execution."""

    def __init__(self, group: Any) -> None:
        self.group = group
        for name, spec in group.method_specs.items():
            setattr(self, name, self._make_method(name, spec))

    @property
    def world_size(self) -> int:
        return self.group.world_size

    # -- the graph --------------------------------------------------------------------
    def _graph(self) -> Any:
        shared = self.group._shared
        if shared["compiled"] is None:
            from ray.dag import InputNode, MultiOutputNode

            # Plain calls made before the graph existed were not tracked: a ping queued
            # behind them on every rank tells when they are all done.
            ray.get([w._ping.remote() for w in self.group.workers], timeout=self.group.get_timeout_s)

            with InputNode() as calls:
                dag = MultiOutputNode(
                    [w._execute_compiled.bind(calls[rank]) for rank, w in enumerate(self.group.workers)]
                )
            shared["compiled"] = dag.experimental_compile()
            shared["pending"] = {}
        return shared["compiled"]

    def teardown(self) -> None:
        """Release the graph (the workers stay); the next call compiles it again."""
        self.group._teardown_compiled()

    def _run(self, calls: list[Call]) -> list[Any]:
        """Execute one step: ``calls[r]`` on rank ``r``. Values in rank order."""
        group = self.group
        with group._submit_lock:
            graph = self._graph()
            pending = list(group._shared["pending"].values())
            if pending:  # plain calls submitted before this one finish first
                ray.wait(pending, num_returns=len(pending), timeout=group.get_timeout_s, fetch_local=False)
                group._shared["pending"] = {}
            try:
                refs = graph.execute(*calls)
                values, first_error = [], None
                for ref in refs:  # every rank's answer is read, so the graph stays in step
                    try:
                        values.append(ray.get(ref, timeout=group.get_timeout_s))
                    except RayTaskError as exc:
                        values.append(None)
                        first_error = first_error or exc
            except Exception:  # a timeout or a lost worker: the channels are out of step
                self.teardown()
                raise
        if first_error is not None:
            raise first_error
        return values

    # -- calls --------------------------------------------------------------------------
    def _prefixed(self, method: str) -> str:
        return self.group._method_prefix + method

    def execute_all_sync(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Every rank, verl's execute_all rule for lists of world_size items."""
        name = self._prefixed(method_name)
        return self._run([(name, a, k) for a, k in split_per_rank(method_name, self.world_size, args, kwargs)])

    def execute_rank_zero_sync(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        calls: list[Call] = [None] * self.world_size
        calls[0] = (self._prefixed(method_name), args, kwargs)
        return self._run(calls)[0]

    def call_method(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        spec = self.group.method_specs.get(method_name)
        if spec is None:
            return self.execute_all_sync(method_name, *args, **kwargs)
        return self._call_registered(method_name, spec, args, kwargs)

    def _call_registered(self, name: str, spec: MethodSpec, args: tuple, kwargs: dict) -> Any:
        d_args, d_kwargs, padding = dispatch_arguments(self.group, name, spec, args, kwargs)
        if spec.execute_mode == Execute.RANK_ZERO:
            outputs: Any = self.execute_rank_zero_sync(name, *d_args, **d_kwargs)
        else:
            outputs = self.execute_all_sync(name, *d_args, **d_kwargs)
        return unpad_output(spec.dispatch_spec.collect_fn(self.group, outputs), padding)

    def _make_method(self, name: str, spec: MethodSpec) -> Callable[..., Any]:
        def compiled_method(*args: Any, **kwargs: Any) -> Any:
            return self._call_registered(name, spec, args, kwargs)

        compiled_method.__name__ = name
        return compiled_method

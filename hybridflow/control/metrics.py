"""The service's own Prometheus metrics, recorded with Ray Serve's metrics API.

Ray exports them on every node's metrics endpoint (the port ``ray.nodes()`` lists as
``MetricsExportPort``, the one Ray's Prometheus service discovery already scrapes), next
to Serve's own metrics: no port of ours. Ray prefixes every name with ``ray_`` and a
counter with the suffix ``_total``; in a Serve replica, ``ray.serve.metrics`` adds the
``deployment``, ``replica`` and ``application`` labels.

=========================================================  =====================================
exported name                                               labels
=========================================================  =====================================
``ray_hybridflow_calls_total``                              group, method, kind, code
``ray_hybridflow_call_duration_seconds`` (histogram)        group, method
``ray_hybridflow_calls_in_flight``                          group, method
``ray_hybridflow_group_rebuilds_total``                     group
``ray_hybridflow_group_replayed_calls_total``               group
``ray_hybridflow_group_journal_length``                     group
``ray_hybridflow_group_snapshot_age_seconds``               group
``ray_hybridflow_group_snapshot_failures_total``            group
``ray_hybridflow_group_restarts_total``                     group
``ray_hybridflow_group_replaced_ranks_total``               group
``ray_hybridflow_group_halts_total``                        group
``ray_hybridflow_group_unready_seconds_total``              group
``ray_hybridflow_model_inferences_total``                   model, kind, code
``ray_hybridflow_model_batch_size`` (histogram)             model
``ray_hybridflow_model_queue_duration_seconds`` (hist.)     model
``ray_hybridflow_model_compute_duration_seconds`` (hist.)   model
=========================================================  =====================================

Calls are counted in the controller, the one place every call passes (the call route,
jobs, and the group calls of OIP models). The controller knows no HTTP: ``kind`` is the
call's ``ErrorKind`` value (``ok`` when none) and ``code`` the status the ingress answers
for that kind, read from a table that the composition root (``hybridflow.serve.application``)
hands every controller replica from ``hybridflow.http.errors.STATUS_OF`` (:func:`use_status_codes`).
A method or model name the controller does not serve is labelled ``(unknown)``, so a
client cannot grow the number of series.

Where the recording happens (each a one-line hook):

- :func:`observed_call` decorates ``GroupController.call``;
- :func:`unit_rebuilt` is the ``Supervisor``'s ``on_rebuilt`` callback;
- :func:`calls_replayed` wraps the count ``Supervisor.replay`` returns;
- :func:`observed_inference` decorates ``ModelServer.infer`` (and keeps Triton's
  statistics, ``hybridflow.control.model_statistics``);
- :func:`sample_groups` runs at every Serve health check (journal length, snapshot age);
- :func:`group_restarted`, :func:`rank_replaced`, :func:`group_halted` and
  :func:`group_unready` are the supervisor's (``hybridflow.control.supervisor``);
- :func:`snapshot_taken` and :func:`snapshot_failed` are for the snapshots
  (``hybridflow.control.snapshots``) to call when a group's snapshot is stored, or fails.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ray.serve import metrics as serve_metrics

from hybridflow.control import model_statistics
from hybridflow.control.contract import CallRequest, CallResult, ControllerError, InferResult

PREFIX = "hybridflow_"
#: The label of a group, method or model that the controller does not serve.
UNKNOWN = "(unknown)"
OK = "ok"
#: The caller stopped waiting (its client went away); the call itself still settles.
CANCELLED = "cancelled"
#: The controller raised instead of answering a result (the ingress answers 500).
EXCEPTION = "exception"

#: Seconds: from a no-op call (about a millisecond) to the default request timeout.
DURATION_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]
BATCH_SIZE_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]

_CALL = ("group", "method")
_GROUP = ("group",)
_MODEL = ("model",)
_OUTCOME = ("kind", "code")


class _Instruments:
    """Every metric, made on first use: in a Serve replica that is inside the replica's
    context, so Serve's labels are added."""

    def __init__(self) -> None:
        m = serve_metrics
        self.calls = m.Counter(PREFIX + "calls", "Calls on group methods, by outcome.", _CALL + _OUTCOME)
        self.call_duration = m.Histogram(
            PREFIX + "call_duration_seconds", "Seconds from a call reaching the controller to its answer.",
            DURATION_BUCKETS_S, _CALL,
        )
        self.in_flight = m.Gauge(PREFIX + "calls_in_flight", "Calls the controller is running now.", _CALL)
        self.rebuilds = m.Counter(PREFIX + "group_rebuilds", "Completed rebuilds of the group's workers.", _GROUP)
        self.replayed = m.Counter(PREFIX + "group_replayed_calls", "Journaled calls replayed on fresh workers.", _GROUP)
        self.journal = m.Gauge(PREFIX + "group_journal_length", "Journaled calls a rebuild would replay.", _GROUP)
        self.snapshot_age = m.Gauge(PREFIX + "group_snapshot_age_seconds", "Seconds since the last stored snapshot.",
                                    _GROUP)
        self.snapshot_failures = m.Counter(PREFIX + "group_snapshot_failures",
                                           "Snapshots that failed (the journal keeps every call).", _GROUP)
        self.restarts = m.Counter(PREFIX + "group_restarts", "Restarts of the group: after a lost rank, or a failed "
                                  "start.", _GROUP)
        self.replaced = m.Counter(PREFIX + "group_replaced_ranks", "Ranks replaced alone (on_rank_lost: replace_rank).",
                                  _GROUP)
        self.halts = m.Counter(PREFIX + "group_halts", "Times the group halted (failed until an operator acts).", _GROUP)
        self.unready = m.Counter(PREFIX + "group_unready_seconds", "Seconds the group was not ready.", _GROUP)
        self.inferences = m.Counter(PREFIX + "model_inferences", "OIP inference requests, by outcome.", _MODEL + _OUTCOME)
        self.batch_size = m.Histogram(
            PREFIX + "model_batch_size", "Size of the batch each successful request ran in.", BATCH_SIZE_BUCKETS, _MODEL
        )
        self.queue = m.Histogram(PREFIX + "model_queue_duration_seconds", "Seconds a request waited for a batch.",
                                 DURATION_BUCKETS_S, _MODEL)
        self.compute = m.Histogram(PREFIX + "model_compute_duration_seconds", "Seconds of the model's group call.",
                                   DURATION_BUCKETS_S, _MODEL)
        self.running: dict[tuple[str, str], int] = {}
        #: group -> wall-clock time of its latest stored snapshot.
        self.snapshots: dict[str, float] = {}

    def change_in_flight(self, labels: dict[str, str], delta: int) -> None:
        key = (labels["group"], labels["method"])
        self.running[key] = self.running.get(key, 0) + delta
        self.in_flight.set(self.running[key], tags=labels)


_instruments: _Instruments | None = None
_status_codes: dict[str, int] = {}


def _metrics() -> _Instruments:
    global _instruments
    if _instruments is None:
        _instruments = _Instruments()
    return _instruments


def use_status_codes(codes: Mapping[str, int]) -> None:
    """The HTTP status the ingress answers for each error kind (by its value)."""
    _status_codes.clear()
    _status_codes.update(codes)


def outcome(error: ControllerError | None) -> dict[str, str]:
    """The ``kind`` and ``code`` labels of an answer (``code`` empty where no table was given)."""
    if error is None:
        return {"kind": OK, "code": "200"}
    return {"kind": error.kind.value, "code": str(_status_codes.get(error.kind.value, ""))}


def _failure(exc: BaseException) -> dict[str, str]:
    if isinstance(exc, asyncio.CancelledError):
        return {"kind": CANCELLED, "code": "499"}  # nginx's "client closed request"
    return {"kind": EXCEPTION, "code": "500"}


def call_labels(controller: Any, request: CallRequest) -> dict[str, str]:
    """``group`` and ``method`` as served, or ``(unknown)``."""
    state = controller.groups.get(request.group)
    if state is None:
        return {"group": UNKNOWN, "method": UNKNOWN}
    return {"group": request.group, "method": request.method if request.method in state.methods else UNKNOWN}


async def _settled(answer: Awaitable[Any], record: Callable[[Any, dict[str, str], float], None]) -> Any:
    """Await ``answer`` (a ``CallResult`` or ``InferResult``), then give ``record`` the
    answer (None when it raised), its outcome labels and its seconds, however it ended."""
    started, result, ended = time.perf_counter(), None, {}
    try:
        result = await answer
        ended = outcome(result.error)
        return result
    except BaseException as exc:
        ended = _failure(exc)
        raise
    finally:
        record(result, ended, time.perf_counter() - started)


def _journal_length(state: Any) -> None:
    _metrics().journal.set(len(state.journal), tags={"group": state.name})


def observed_call(call: Callable[[Any, CallRequest], Awaitable[CallResult]]) -> Callable[..., Awaitable[CallResult]]:
    """Decorates ``GroupController.call``: in flight while it runs, then counted by
    outcome, its duration observed and the group's journal length set."""

    @functools.wraps(call)
    async def observed(controller: Any, request: CallRequest) -> CallResult:
        metrics, labels = _metrics(), call_labels(controller, request)
        metrics.change_in_flight(labels, 1)

        def record(result: CallResult | None, ended: dict[str, str], seconds: float) -> None:
            metrics.change_in_flight(labels, -1)
            metrics.calls.inc(tags={**labels, **ended})
            metrics.call_duration.observe(seconds, tags=labels)
            state = controller.groups.get(request.group)
            if state is not None:
                _journal_length(state)

        return await _settled(call(controller, request), record)

    return observed


def unit_rebuilt(unit: Any, replayed: int) -> None:
    """The supervisor's ``on_rebuilt``: each group of the unit was rebuilt once."""
    for member in unit.members:
        _metrics().rebuilds.inc(tags={"group": member.name})
        _journal_length(member)


def calls_replayed(group: str, count: int) -> int:
    """Count ``count`` calls replayed on ``group``'s fresh workers; returns ``count``."""
    if count > 0:
        _metrics().replayed.inc(count, tags={"group": group})
    return count


def snapshot_taken(group: str, taken_at: float | None = None) -> None:
    """``group``'s snapshot was stored at ``taken_at`` (wall clock, now by default): its
    age is exported from then on, refreshed at every health check."""
    metrics = _metrics()
    metrics.snapshots[group] = time.time() if taken_at is None else taken_at
    metrics.snapshot_age.set(max(time.time() - metrics.snapshots[group], 0.0), tags={"group": group})


def snapshot_failed(group: str) -> None:
    """A snapshot of ``group`` failed (it is tried again later)."""
    _metrics().snapshot_failures.inc(tags={"group": group})


def group_restarted(group: str) -> None:
    _metrics().restarts.inc(tags={"group": group})


def rank_replaced(group: str) -> None:
    _metrics().replaced.inc(tags={"group": group})


def group_halted(group: str) -> None:
    _metrics().halts.inc(tags={"group": group})


def group_unready(group: str, seconds: float) -> None:
    """``group`` was not ready for another ``seconds``."""
    if seconds > 0:
        _metrics().unready.inc(seconds, tags={"group": group})


def sample_groups(controller: Any) -> None:
    """Gauges that follow the groups' state (run at every health check)."""
    metrics, now = _metrics(), time.time()
    for name, state in controller.groups.items():
        _journal_length(state)
        if name in metrics.snapshots:
            metrics.snapshot_age.set(max(now - metrics.snapshots[name], 0.0), tags={"group": name})


def observed_inference(
    infer: Callable[[Any, str, dict[str, Any]], Awaitable[InferResult]],
) -> Callable[..., Awaitable[InferResult]]:
    """Decorates ``ModelServer.infer``: counts the request by outcome, observes a
    successful one's batch size, queue and compute time, and adds it to the model's
    Triton statistics."""

    @functools.wraps(infer)
    async def observed(server: Any, name: str, inputs: dict[str, Any]) -> InferResult:
        metrics = _metrics()
        model = name if name in server.models else UNKNOWN
        statistics = model_statistics.of(model) if model != UNKNOWN else None

        def record(result: InferResult | None, ended: dict[str, str], seconds: float) -> None:
            metrics.inferences.inc(tags={"model": model, **ended})
            if result is not None and result.ok:
                labels = {"model": model}
                metrics.batch_size.observe(result.batch_size, tags=labels)
                metrics.queue.observe(result.queue_s, tags=labels)
                metrics.compute.observe(result.compute_s, tags=labels)
                if statistics is not None:
                    statistics.succeeded(seconds, result.queue_s, result.compute_s, result.batch_size)
            elif statistics is not None:
                statistics.failed(seconds)

        return await _settled(infer(server, name, inputs), record)

    return observed

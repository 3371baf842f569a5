"""The typed messages between the ingress and the controllers (through Serve handles).

The controller answers with these objects and never with HTTP statuses: what went wrong
is an :class:`ErrorKind`, and the HTTP layer (``hybridflow.http.errors``) owns the table from kind to
status code. Plain dataclasses: they pickle cheaply through Ray and need nothing from
FastAPI or Ray to import.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


def first_line(exc: BaseException) -> str:
    """What an error message carries of an exception: the last line of its text (never a
    traceback), or its type's name when it has no text."""
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


class ErrorKind(enum.Enum):
    """Why a call got no output."""

    UNKNOWN_GROUP = "unknown_group"
    UNKNOWN_METHOD = "unknown_method"
    UNKNOWN_MODEL = "unknown_model"
    #: Arguments that do not fit the method or its dispatch mode (checked before any rank ran).
    BAD_ARGUMENTS = "bad_arguments"
    #: Inference inputs that do not fit the model's declared inputs.
    BAD_INPUT = "bad_input"
    #: The worker method raised (on some or every rank): the caller's arguments or state.
    METHOD_RAISED = "method_raised"
    #: The group is starting, rebuilding or failed: retry after ``retry_after_s``.
    UNAVAILABLE = "unavailable"
    #: The call ran past the request timeout.
    TIMEOUT = "timeout"
    #: The same Idempotency-Key came with a different body.
    IDEMPOTENCY_CONFLICT = "idempotency_conflict"
    #: A bound of the service (queue, jobs, sizes) refuses the request.
    OVER_LIMIT = "over_limit"
    #: The output cannot be sent in the form asked for.
    NOT_ENCODABLE = "not_encodable"
    #: A mutating call was applied on every rank and journaled, but its collect function
    #: failed: it counts, and has no output to give.
    COLLECT_FAILED = "collect_failed"


@dataclass(frozen=True)
class ControllerError:
    kind: ErrorKind
    message: str
    retry_after_s: float | None = None


#: The service's own operations on a group (``CallRequest.operation``): a weight sync into
#: it (``kwargs``: ``{"from": <source group>}``; journaled) and its weights' layout.
#: Never a Python method's name, so never a worker method's.
WEIGHTS_SYNC, WEIGHTS_LAYOUT = "weights.sync", "weights.layout"


@dataclass
class CallRequest:
    """One call of ``method`` on ``group``. ``fingerprint`` identifies the body for
    Idempotency-Key repeats (the same key with another fingerprint is refused).
    ``operation``: ``method`` names one of the service's own operations on the group
    (``WEIGHTS_SYNC``, ``WEIGHTS_LAYOUT``), not a worker method; only the routes of those
    operations set it."""

    group: str
    method: str
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    idempotency_key: str | None = None
    fingerprint: str | None = None
    operation: bool = False


@dataclass
class CallResult:
    """What a call produced: ``output`` when ``error`` is None."""

    output: Any = None
    error: ControllerError | None = None
    dispatch_mode: str = ""
    execute_mode: str = ""
    world_size: int = 0
    #: The version of the weights the call ran on, for a group whose worker declares
    #: weights (``hybridflow.control.weights``); None otherwise.
    weights_version: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class InferResult:
    """An inference call's outputs by name, or an error; durations for statistics."""

    outputs: dict[str, Any] = field(default_factory=dict)
    error: ControllerError | None = None
    #: Seconds spent waiting for a batch, and running the group call.
    queue_s: float = 0.0
    compute_s: float = 0.0
    batch_size: int = 1
    #: The version of the weights that computed the outputs (a group declaring weights).
    weights_version: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def answer_parameters(self) -> dict[str, Any]:
        """The ``parameters`` of the answer, the same over HTTP and gRPC: how many requests
        shared the group call, when more than one did, and the weights version of a group
        whose worker declares weights."""
        parameters: dict[str, Any] = {"batch_size": self.batch_size} if self.batch_size > 1 else {}
        if self.weights_version is not None:
            parameters["weights_version"] = self.weights_version
        return parameters


@dataclass
class MethodSummary:
    name: str
    dispatch_mode: str
    execute_mode: str
    registered: bool
    read_only: bool


@dataclass
class GroupSummary:
    """A served group, as ``GET /v1/groups`` lists it (``ranks`` only for one group)."""

    name: str
    deployment: str
    world_size: int | None
    resource_pool: str
    worker_class: str
    status: str
    last_error: str | None
    rebuilds: int
    replayed_calls: int
    journal_length: int
    methods: list[MethodSummary]
    #: Restarts after lost ranks or failed starts, ranks replaced alone, and what a lost
    #: rank does to the group (its ``supervision``).
    restarts: int = 0
    replaced_ranks: int = 0
    on_rank_lost: str = "rebuild_group"
    colocated_with: list[str] = field(default_factory=list)
    #: How its calls reach its ranks: ``tasks`` or ``compiled`` (hybridflow.control.transport).
    transport: str = "tasks"
    #: Why the group's latest snapshot failed (None once one is stored); the journal
    #: keeps every call meanwhile, and the snapshot is retried.
    snapshot_error: str | None = None
    #: tp/dp/pp sizes of a Megatron group.
    layout: dict[str, int] | None = None
    #: A group whose worker declares weights: their version (0 until a sync), and why
    #: its latest weight sync failed (None once one succeeds).
    weights_version: int | None = None
    weights_error: str | None = None
    ranks: list[dict[str, Any]] | None = None
    #: One group's named meshes, when its workers declared any (``Worker.
    #: _register_dispatch_collect_info``; a Megatron group's under its mesh name): each
    #: mesh's dp size and its collecting ranks in dp order, ``{"dp_size", "collect_ranks"}``.
    meshes: dict[str, dict[str, Any]] | None = None
    namespace: str | None = None

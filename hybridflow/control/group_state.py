"""What the controller knows of its groups and units, and how it reads a failure of the
ranks: the shared vocabulary of the supervisor (``hybridflow.control.supervisor``), the
controller, the durability layer and the weight syncs.

A *unit* is what starts as one (a group, or colocated groups on shared processes); its
status is every member's. Statuses: ``starting`` (its first start), ``ready``,
``rebuilding`` (on fresh workers), ``restoring`` (in place, on its own processes, after a
client's call left the ranks off the journal), ``replacing`` (new workers for lost ranks,
the other ranks keep theirs) and ``failed`` (``halted`` when only an operator can bring
it back). Calls run only on a ready group.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import RayActorError, RayError, RayTaskError

from hybridflow.config import GroupConfig
from hybridflow.control.builder import Unit
from hybridflow.control.catalogue import MethodInfo
from hybridflow.control.contract import first_line
from hybridflow.control.fence import Fence
from hybridflow.control.restarts import Supervision
from hybridflow.control.submissions import Submissions
from hybridflow.control.transport import TASKS
from hybridflow.state.codec import StateCodecError
from hybridflow.state.journal import Journal
from hybridflow.state.store import StateMismatchError
from single_controller.ray.graph_channel import GraphClosed

STARTING, READY, REBUILDING, RESTORING, REPLACING, FAILED = (
    "starting", "ready", "rebuilding", "restoring", "replacing", "failed")
#: What a ready group reads while its ranks are pinged after a call found a worker gone
#: (its calls answer 503 meanwhile); what follows is a recovery's status.
CHECKING = "checking"
#: What a node is called when a rank's is not known (a plain actor's).
UNKNOWN_NODE = "unknown"


class RestoreRefused(ValueError):
    """Stored state that must not be applied (e.g. a journal entry naming a method that
    is not in the group's catalogue)."""


def hopeless(exc: BaseException) -> bool:
    """Whether a start or restore that raised ``exc`` would fail the same way again: a
    method raised (a replayed call, an init call), the replay deadline passed, or the
    stored state cannot be applied. A lost worker, a store that cannot be reached or
    resources not there yet may pass."""
    if isinstance(exc, (TimeoutError, StateCodecError, StateMismatchError, RestoreRefused)):
        return True
    return isinstance(exc, RayTaskError) and not isinstance(exc, RayActorError)


def as_asyncio(refs: list[Any]) -> list[asyncio.Future]:
    """Ray futures as asyncio futures of the running loop (a channel answers asyncio
    futures already)."""
    return [ref if isinstance(ref, asyncio.Future) else asyncio.wrap_future(ref.future()) for ref in refs]


def failure_of(exc: BaseException) -> tuple[bool, str]:
    """``(worker_lost, message)`` for an exception a Ray future raised: a method that
    raised is the caller's matter (its message's last line, never a traceback); any
    other Ray error, also one a task reports as its cause (a compiled graph's rank whose
    peer died, its channel closed), or a closed graph, means a worker or its objects are
    gone."""
    if isinstance(exc, RayTaskError) and not isinstance(exc, RayActorError):
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        if isinstance(cause, RayError) and cause is not exc:  # a compiled graph's rank whose peer died
            return True, type(cause).__name__
        return False, f"{type(cause).__name__}: {first_line(cause)}"
    if isinstance(exc, (RayError, GraphClosed)):  # a closed graph: a rank behind it went away
        return True, type(exc).__name__
    return False, f"{type(exc).__name__}: {first_line(exc)}"


@dataclass
class GroupState:
    """One served group: its declaration, methods, journal and the running group."""

    config: GroupConfig
    methods: dict[str, MethodInfo]
    worker_class: str
    resource_pool: str
    journal: Journal = field(default_factory=Journal)
    #: The group's scope in the state store (hybridflow.control.durability.GroupDurability).
    durability: Any = None
    group: Any = None
    unit: UnitState | None = None
    #: Calls of ours running on the workers (read-only ones too): a busy group.
    running: int = 0
    #: Acknowledged mutating calls since start: what an io spec cache is keyed by.
    state_version: int = 0
    #: Holds new calls back while an operation must see none (a weight sync's commit).
    fence: Fence = field(default_factory=Fence)
    #: How calls reach the ranks (hybridflow.control.transport): tasks, or compiled.
    transport: str = TASKS
    #: The running group's compiled graph, for a compiled transport.
    channel: Any = None
    #: A mutating call reached the ranks and was not acknowledged since the last restore:
    #: they may hold changes the journal does not.
    diverged: bool = False
    #: Hands the group's calls to its ranks in journal order (hybridflow.control.submissions).
    submissions: Submissions = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.submissions is None:
            self.submissions = Submissions(self.config.name)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def caller(self) -> Any:
        """What takes the running group's calls that read or change its ranks' state: its
        channel (a socket channel or a compiled graph's), or the group itself (a Ray task
        per rank)."""
        return self.channel if self.channel is not None else self.group

    @property
    def status(self) -> str:
        return self.unit.status if self.unit else STARTING

    @property
    def reported_status(self) -> str:
        """The status a client reads: ``status``, or ``checking`` while a ready group's
        ranks are looked at after a worker was reported lost."""
        if self.status == READY and self.unit is not None and self.unit.examining:
            return CHECKING
        return self.status

    @property
    def serving(self) -> bool:
        """Whether a call may be submitted now: ready, running, and not being looked at
        after a worker was reported lost."""
        return self.reported_status == READY and self.group is not None


@dataclass
class UnitState:
    unit: Unit
    members: list[GroupState]
    status: str = STARTING
    last_error: str | None = None
    rebuilds: int = 0
    replayed: int = 0
    #: Failed so that retrying cannot help: nothing restarts it until an operator does.
    halted: bool = False
    #: Bumped on every (re)start or restore: calls and caches of an older generation are stale.
    generation: int = 0
    pings: list[asyncio.Future] | None = None
    task: asyncio.Task | None = None
    #: Whether it came up once in this controller (what readiness reports).
    came_up: bool = False
    #: A worker was reported lost and the ranks are being looked at: no call is submitted.
    examining: bool = False
    #: Each rank's node (IP, else id) as the group's rank details show it.
    nodes: list[str] = field(default_factory=list)
    #: What the latest failed start, rebuild, restore or replacement said.
    last_failure: str | None = None
    #: Ranks whose replacement failed and is tried again.
    replacing: list[int] = field(default_factory=list)
    #: The next try after a failed start (a timer), if one is due.
    retry: asyncio.TimerHandle | None = None
    #: Restarts and backoff under the group's ``supervision``.
    supervision: Supervision | None = None
    replaced_ranks: int = 0
    restarts: int = 0
    #: The discards of the operators' resets that the coming rebuild makes (None: no reset
    #: is waiting for its rebuild).
    discards: list[Callable[[], Awaitable[None]]] | None = None
    #: Monotonic time up to which its not-ready time is counted (None while ready).
    unready_since: float | None = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.supervision is None:
            self.supervision = Supervision(self.members[0].config.supervision)

    @property
    def busy(self) -> bool:
        return any(member.running for member in self.members)

    @property
    def recovering(self) -> bool:
        """A start, rebuild, restore, replacement or look at the ranks is running."""
        return self.task is not None and not self.task.done()

    def workers(self) -> list[Any]:
        group = self.members[0].group
        return list(group.workers) if group is not None else []

    def node(self, rank: int) -> str:
        return self.nodes[rank] if 0 <= rank < len(self.nodes) else UNKNOWN_NODE

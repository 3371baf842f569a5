"""The controller side of a deployment: named worker groups, calls, health, recovery.

A :class:`GroupController` owns groups built by :class:`GroupSpec` builders. A call
returns a :class:`CallOutcome` (never raises), so the ingress can map every failure to
an HTTP status. Every acknowledged call of a mutating method is journaled; when a
worker dies the group is rebuilt from its builder and the journal replayed, so each
rank ends with exactly the state of the calls that were acknowledged.
"""

from __future__ import annotations

import copy
import inspect
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from single_controller.base import Worker
from single_controller.base.dispatch import DispatchError
from single_controller.base.worker_group import registered_methods, user_class

logger = logging.getLogger(__name__)

#: How a call on a method with no ``@register`` is described (verl's execute_all).
EXECUTE_ALL = "EXECUTE_ALL"
#: Answers kept for Idempotency-Key repeats (oldest dropped first).
IDEMPOTENCY_CACHE_SIZE = 10_000


@dataclass
class CallOutcome:
    """What a call produced: ``output`` on success, else an HTTP-like status and message."""

    status: int = 200
    output: Any = None
    error: str | None = None
    retry_after_s: float | None = None
    dispatch_mode: str = ""
    execute_mode: str = ""
    world_size: int = 0


@dataclass
class MethodInfo:
    name: str
    dispatch_mode: str
    execute_mode: str
    registered: bool
    mutating: bool

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dispatch_mode": self.dispatch_mode,
            "execute_mode": self.execute_mode,
            "registered": self.registered,
        }


class SingleActor:
    """A plain Ray actor (the tutorial's Accumulator) presented as a group of one: its
    calls return the actor's value itself."""

    def __init__(self, actor_cls: Any, options: dict[str, Any] | None = None) -> None:
        self.actor_cls = actor_cls
        self.actor = actor_cls.options(**(options or {})).remote()
        ray.get(self.actor.__ray_ready__.remote())
        self.get_timeout_s: float | None = None

    world_size = 1

    @property
    def workers(self) -> list[Any]:
        return [self.actor]

    def call_method(self, method: str, *args: Any, blocking: bool = True, **kwargs: Any) -> Any:
        future = getattr(self.actor, method).remote(*args, **kwargs)
        return ray.get(future, timeout=self.get_timeout_s) if blocking else future

    def rank_info(self) -> list[dict[str, Any]]:
        return [{"rank": 0, "local_rank": 0, "world_size": 1}]

    def check_health(self, timeout_s: float) -> None:
        ray.get(self.actor.__ray_ready__.remote(), timeout=timeout_s)

    def shutdown(self) -> None:
        ray.kill(self.actor)


def public_methods(cls: Any) -> dict[str, MethodInfo]:
    """Methods a client may call: public, defined by the worker class itself (not by
    ``Worker``, its Megatron subclass, or ``object``)."""
    plain = user_class(cls)
    specs = registered_methods(cls)
    base_names = {name for base in (Worker, object) for name in dir(base)}
    infra_bases = tuple(b for b in inspect.getmro(plain) if b.__module__.startswith("single_controller.megatron"))
    for base in infra_bases:
        base_names |= set(vars(base))
    methods = {}
    for name, _member in inspect.getmembers(plain, predicate=inspect.isfunction):
        if name.startswith("_") or name in base_names:
            continue
        spec = specs.get(name)
        methods[name] = MethodInfo(
            name=name,
            dispatch_mode=spec.dispatch_name if spec else EXECUTE_ALL,
            execute_mode=spec.execute_mode.name if spec else "ALL",
            registered=spec is not None,
            mutating=True,
        )
    return methods


@dataclass(frozen=True)
class Colocation:
    """Groups whose workers share processes (one process per bundle holding every
    role): ``build`` starts them all at once and returns each group by name. They share
    their fate, so they are also rebuilt together."""

    name: str
    build: Callable[[], dict[str, Any]]


@dataclass
class GroupSpec:
    """How to build one named group, and which of its methods only read state. A
    colocated group is built by its :class:`Colocation` (``build`` is then unused)."""

    name: str
    build: Callable[[], Any] | None
    worker_cls: Any
    resource_pool: str
    read_only: frozenset[str] = frozenset()
    extra_info: Callable[[Any], dict[str, Any]] | None = None
    colocation: Colocation | None = None


@dataclass
class GroupState:
    spec: GroupSpec
    group: Any = None
    methods: dict[str, MethodInfo] = field(default_factory=dict)
    journal: list[tuple[str, tuple, dict]] = field(default_factory=list)
    status: str = "starting"  # starting | ready | rebuilding | failed
    last_error: str | None = None
    rebuilds: int = 0
    #: Held while a mutating call is submitted (journal order = submission order) and
    #: through a rebuild (no call starts on a group being replaced).
    lock: threading.RLock = field(default_factory=threading.RLock)
    #: Mutating calls submitted and not yet settled; ``settled`` guards the journal.
    inflight: int = 0
    settled: threading.Condition = field(default_factory=threading.Condition)


class GroupController:
    """Owns named worker groups; the Serve deployments subclass it."""

    def __init__(self, specs: list[GroupSpec], request_timeout_s: float = 120.0, health_timeout_s: float = 10.0):
        self.request_timeout_s = request_timeout_s
        self.health_timeout_s = health_timeout_s
        self._groups: dict[str, GroupState] = {}
        self._status_lock = threading.Lock()
        self._idempotency_lock = threading.Lock()
        self._idempotency_locks: dict[tuple, threading.Lock] = {}
        self._answers: OrderedDict[tuple, CallOutcome] = OrderedDict()
        for spec in specs:
            state = GroupState(spec=spec, methods=public_methods(spec.worker_cls))
            for name in spec.read_only:
                if name in state.methods:
                    state.methods[name].mutating = False
            self._groups[spec.name] = state
        # A unit is what starts and fails as one: a group, or the groups of a colocation.
        self._units: dict[str, list[GroupState]] = {}
        for state in self._groups.values():
            key = f"colocation:{state.spec.colocation.name}" if state.spec.colocation else state.spec.name
            self._units.setdefault(key, []).append(state)
        # Units start concurrently: each waits seconds for its worker processes.
        with ThreadPoolExecutor(max_workers=len(self._units) or 1) as pool:
            for future in [pool.submit(self._start, unit) for unit in self._units.values()]:
                future.result()

    # -- lifecycle ------------------------------------------------------------------
    def _unit_of(self, state: GroupState) -> list[GroupState]:
        colocation = state.spec.colocation
        return self._units[f"colocation:{colocation.name}" if colocation else state.spec.name]

    def _start(self, unit: list[GroupState]) -> None:
        colocation = unit[0].spec.colocation
        if colocation is not None:
            groups = colocation.build()
        else:
            groups = {unit[0].spec.name: unit[0].spec.build()}
        for state in unit:
            group = groups[state.spec.name]
            group.get_timeout_s = self.request_timeout_s
            state.group = group
            if state.status == "starting":
                state.status = "ready"

    def _rebuild(self, unit: list[GroupState]) -> None:
        """Replace a group (or colocated groups) that lost a worker, and replay each
        journal on the new workers. Holding the groups' locks keeps new mutating calls
        out until the replay is done."""
        names = ", ".join(state.spec.name for state in unit)
        locks = [state.lock for state in sorted(unit, key=lambda s: s.spec.name)]
        for lock in locks:
            lock.acquire()
        started = time.monotonic()
        try:
            for state in unit:  # colocated groups share processes: shutting one down ends all
                if state.group is not None:
                    state.group.shutdown()
                state.group = None
            for state in unit:  # calls in flight on the old workers settle (fail) first
                with state.settled:
                    state.settled.wait_for(lambda state=state: state.inflight == 0, timeout=self.request_timeout_s + 10)
            self._start(unit)
            replayed = 0
            for state in unit:
                for method, args, kwargs in state.journal:
                    state.group.call_method(method, *args, **kwargs)
                replayed += len(state.journal)
            with self._status_lock:
                for state in unit:
                    state.rebuilds += 1
                    state.last_error = None
                    state.status = "ready"
            logger.warning("groups %s rebuilt in %.1f s, %d calls replayed", names, time.monotonic() - started, replayed)
        except Exception as exc:  # keep the controller up; the next health check retries
            with self._status_lock:
                for state in unit:
                    state.last_error = f"{type(exc).__name__}: {exc}"
                    state.status = "failed"
            logger.exception("rebuilding groups %s failed", names)
        finally:
            for lock in reversed(locks):
                lock.release()

    def _alive(self, state: GroupState) -> bool:
        try:
            state.group.check_health(timeout_s=self.health_timeout_s)
            return True
        except Exception:
            return False

    def _recover_in_background(self, state: GroupState) -> None:
        unit = self._unit_of(state)
        with self._status_lock:
            if any(member.status == "rebuilding" for member in unit):
                return
            for member in unit:
                member.status = "rebuilding"
        threading.Thread(target=self._rebuild, args=(unit,), daemon=True).start()

    def shutdown(self) -> None:
        for state in self._groups.values():
            if state.group is not None:
                try:
                    state.group.shutdown()
                except Exception:
                    pass

    # -- health ---------------------------------------------------------------------
    def check_groups(self) -> dict[str, str]:
        """Ping every worker; start recovering any group that does not answer."""
        for state in self._groups.values():
            if state.status == "ready" and not self._alive(state):
                self._recover_in_background(state)
            elif state.status == "failed":
                self._recover_in_background(state)
        return {name: state.status for name, state in self._groups.items()}

    def ready(self) -> dict[str, bool]:
        return {name: state.status == "ready" for name, state in self._groups.items()}

    # -- description ----------------------------------------------------------------
    def describe(self) -> list[dict[str, Any]]:
        return [self._summary(state) for state in self._groups.values()]

    def _summary(self, state: GroupState) -> dict[str, Any]:
        group = state.group
        summary = {
            "name": state.spec.name,
            "world_size": group.world_size if group is not None else None,
            "resource_pool": state.spec.resource_pool,
            "worker_class": user_class(state.spec.worker_cls).__name__,
            "status": state.status,
            "methods": [m.as_dict() for m in state.methods.values()],
        }
        siblings = [other.spec.name for other in self._unit_of(state) if other is not state]
        if siblings:  # these groups' ranks are the same processes
            summary["colocated_with"] = siblings
        if group is not None and state.spec.extra_info is not None:
            summary.update(state.spec.extra_info(group))
        return summary

    def describe_group(self, name: str) -> dict[str, Any] | None:
        state = self._groups.get(name)
        if state is None:
            return None
        summary = self._summary(state)
        if state.status == "ready":
            try:
                ranks = state.group.rank_info()
            except Exception as exc:
                ranks = []
                summary["error"] = f"rank details unavailable: {exc}"
            if hasattr(state.group, "get_megatron_rank_info"):
                for entry in ranks:
                    coords = state.group.get_megatron_rank_info(entry["rank"])
                    entry.update(
                        tp_rank=coords.tp_rank, dp_rank=coords.dp_rank, pp_rank=coords.pp_rank,
                        cp_rank=getattr(coords, "cp_rank", 0),
                    )
            summary["ranks"] = ranks
        context = ray.get_runtime_context()
        # Where the workers live, for operators (e.g. to inspect or kill one with Ray's API).
        summary["cluster"] = {"gcs_address": context.gcs_address, "namespace": context.namespace}
        return summary

    def group_names(self) -> list[str]:
        return list(self._groups)

    def method_info(self, group: str, method: str) -> MethodInfo | None:
        state = self._groups.get(group)
        return None if state is None else state.methods.get(method)

    # -- calls ----------------------------------------------------------------------
    def call(
        self,
        group: str,
        method: str,
        args: tuple = (),
        kwargs: dict | None = None,
        idempotency_key: str | None = None,
    ) -> CallOutcome:
        """Run one call. With an ``idempotency_key``, a repeat of a call that got a final
        answer (not 503/504) returns that first answer and is not applied again."""
        if idempotency_key is None:
            return self._call(group, method, args, kwargs or {})
        key = (group, method, idempotency_key)
        with self._idempotency_lock:
            key_lock = self._idempotency_locks.setdefault(key, threading.Lock())
        with key_lock:  # a concurrent duplicate waits for the first and reuses its answer
            cached = self._answers.get(key)
            if cached is not None:
                self._answers.move_to_end(key)
                return cached
            outcome = self._call(group, method, args, kwargs or {})
            if outcome.status not in (503, 504):
                self._answers[key] = outcome
                while len(self._answers) > IDEMPOTENCY_CACHE_SIZE:
                    old, _ = self._answers.popitem(last=False)
                    self._idempotency_locks.pop(old, None)
            return outcome

    def _call(self, group: str, method: str, args: tuple, kwargs: dict) -> CallOutcome:
        state = self._groups.get(group)
        if state is None:
            return CallOutcome(404, error=f"unknown group {group!r}; groups: {', '.join(self._groups)}")
        info = state.methods.get(method)
        if info is None:
            return CallOutcome(
                404,
                error=f"group {group!r} has no callable method {method!r}; methods: {', '.join(state.methods)}",
            )
        outcome = CallOutcome(dispatch_mode=info.dispatch_mode, execute_mode=info.execute_mode)
        if state.status != "ready":
            outcome.status, outcome.retry_after_s = 503, 5.0
            outcome.error = f"group {group!r} is {state.status}; retry shortly"
            return outcome
        group_obj = state.group
        if group_obj is None:  # a rebuild began after the status check
            outcome.status, outcome.retry_after_s = 503, 5.0
            outcome.error = f"group {group!r} is rebuilding; retry shortly"
            return outcome
        outcome.world_size = group_obj.world_size
        if not info.registered:
            problem = self._per_rank_problem(method, group_obj.world_size, args, kwargs)
            if problem:
                outcome.status, outcome.error = 422, problem
                return outcome
        try:
            if info.mutating:
                # Submitted and journaled under the lock, so the journal's order is the
                # order every rank runs them in; awaited outside it, so calls pipeline.
                with state.lock:
                    if state.status != "ready":
                        outcome.status, outcome.retry_after_s = 503, 5.0
                        outcome.error = f"group {group!r} is {state.status}; retry shortly"
                        return outcome
                    group_obj = state.group
                    # A copy, because a custom dispatch function may append to the lists.
                    entry = (method, copy.deepcopy(args), copy.deepcopy(kwargs))
                    futures = group_obj.call_method(method, *args, blocking=False, **kwargs)
                    with state.settled:
                        state.journal.append(entry)
                        state.inflight += 1
                outcome.output = self._settle_mutating(state, entry, method, futures)
            else:
                outcome.output = group_obj.call_method(method, *args, **kwargs)
        except DispatchError as exc:
            outcome.status, outcome.error = 422, str(exc)
        except (ValueError, TypeError) as exc:
            outcome.status, outcome.error = 422, f"{method}: {exc}"
        except GetTimeoutError:
            outcome.status = 504
            outcome.error = f"{group}.{method} did not finish within {self.request_timeout_s:g} s"
        except RayActorError as exc:
            self._recover_in_background(state)
            outcome.status, outcome.retry_after_s = 503, 5.0
            outcome.error = f"a worker of group {group!r} died ({type(exc).__name__}); the group is being rebuilt"
        except RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            outcome.status = 422
            outcome.error = f"{group}.{method} raised {type(cause).__name__}: {_first_line(cause)}"
        return outcome

    def _settle_mutating(self, state: GroupState, entry: tuple, method: str, futures: Any) -> Any:
        """Wait for a submitted mutating call on every rank. Only a call every rank
        applied stays in the journal. When some ranks applied it and others failed, or
        it ran past the timeout (and may still apply), the workers no longer match the
        journal: the group is restored from the journal in the background, so the state
        is again exactly that of the acknowledged calls."""
        acknowledged = False
        try:
            refs = futures if isinstance(futures, list) else [futures]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.request_timeout_s)
            if len(ready) < len(refs):
                self._recover_in_background(state)
                raise GetTimeoutError(f"{method} timed out")
            try:
                values = ray.get(refs)
            except RayTaskError as first:
                failed = 0
                for ref in refs:
                    try:
                        ray.get(ref)
                    except RayTaskError:
                        failed += 1
                if failed < len(refs):
                    logger.warning("%s.%s failed on some ranks only; restoring the group", state.spec.name, method)
                    self._recover_in_background(state)
                raise first from None
            acknowledged = True
            return values if isinstance(futures, list) else values[0]
        finally:
            with state.settled:
                if not acknowledged:
                    for i in range(len(state.journal) - 1, -1, -1):
                        if state.journal[i] is entry:
                            del state.journal[i]
                            break
                state.inflight -= 1
                state.settled.notify_all()

    @staticmethod
    def _per_rank_problem(method: str, world_size: int, args: tuple, kwargs: dict) -> str | None:
        """Over HTTP a list argument of an unregistered method is a per-rank list: it must
        have one item per rank."""
        labelled = [(f"positional argument {i}", v) for i, v in enumerate(args)]
        labelled += [(f"argument {k!r}", v) for k, v in kwargs.items()]
        for label, value in labelled:
            if isinstance(value, list) and len(value) != world_size:
                return (
                    f"{method}: {label} is a per-rank list of the wrong length: "
                    f"expected {world_size} (one per rank), got {len(value)}"
                )
        return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__

"""The single controller of one deployment: its groups, their calls, health and recovery.

A call never raises to the caller: it answers a :class:`CallResult` whose ``error`` says
what went wrong (``hybridflow.control.contract.ErrorKind``); the HTTP layer picks the status.
Calls run on the replica's event loop: submitting a call to every rank happens without
an ``await`` in between, so the loop itself keeps one order on every rank; the wait for
the outputs is an ``await``, so calls pipeline and the health check never queues behind
them. A mutating call is journaled in that order and acknowledged only when every rank
applied it and the state store recorded it (``hybridflow.control.durability``); its wait runs
as a task of its own, so a client that goes away cannot leave it applied but unjournaled.

A mutating call that fails anywhere (raised on some ranks or all of them, a lost worker,
a timeout) may have changed the ranks it ran on, so the group is restored from its
journal in the background (in place where its workers allow: a client's error stays that
client's; a lost worker goes to the group's supervision, ``hybridflow.control.supervisor``);
its caller gets the error. Store I/O runs in the store's own threads
(``hybridflow.state.async_store``): a store that waits never stalls the loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from hybridflow.config import DeploymentConfig, LimitsConfig, StateConfig, import_worker
from hybridflow.control import metrics
from hybridflow.control.builder import Unit
from hybridflow.control.catalogue import catalogue, per_rank_problem
from hybridflow.control.contract import (
    CallRequest,
    CallResult,
    ControllerError,
    ErrorKind,
    GroupSummary,
    MethodSummary,
)
from hybridflow.control.durability import GroupDurability, PendingRecord, fresh_token
from hybridflow.control.events import EventBus
from hybridflow.control.group_state import CHECKING
from hybridflow.control.models import ModelServer
from hybridflow.control.placement import DeploymentPlan
from hybridflow.control.rank_answers import rank_outcomes
from hybridflow.control.submissions import large
from hybridflow.control.supervisor import (
    READY,
    GroupState,
    Supervisor,
    UnitState,
    failure_of,
    first_line,
)
from hybridflow.control.transport import resolve_transports
from hybridflow.control.weights import WeightSyncs
from hybridflow.state.async_store import AsyncStore
from hybridflow.state.codec import StateCodecError
from hybridflow.state.idempotency import IdempotencyCache, IdempotencyConflict
from hybridflow.state.store import StateStore
from single_controller.base.dispatch import DispatchError
from single_controller.base.worker_group import SubmitError
from single_controller.base.worker_methods import user_class

#: Seconds a client is told to wait before retrying a group that is not ready.
RETRY_AFTER_S = 5.0
#: Errors after which a retry may succeed: their answers are not kept for Idempotency-Key.
TRANSIENT = frozenset({ErrorKind.UNAVAILABLE, ErrorKind.TIMEOUT})


def _error(kind: ErrorKind, message: str, retry_after_s: float | None = None) -> ControllerError:
    return ControllerError(kind, message, retry_after_s)


class GroupController:
    def __init__(
        self,
        deployment: DeploymentConfig,
        plan: DeploymentPlan,
        units: list[Unit],
        request_timeout_s: float = 120.0,
        health_timeout_s: float = 10.0,
        limits: LimitsConfig | None = None,
        state: StateConfig | None = None,
        transports: dict[str, str] | None = None,
        events: EventBus | None = None,
    ) -> None:
        """``state``: where the groups' state is kept (resolved: an absolute path); None
        keeps it in memory. ``transports``: each group's, resolved
        (``hybridflow.control.transport``); by default resolved for this deployment alone.
        ``events``: where the groups' events go (the process's bus; one of its own by default)."""
        self.deployment = deployment
        self.events = events if events is not None else EventBus((limits or LimitsConfig()).events_kept)
        self.plan = plan
        self.request_timeout_s = request_timeout_s
        self.state = state or StateConfig(path=None)
        #: The groups' store, opened (off the loop) by :meth:`open`.
        self.store_io = AsyncStore(self.state.open)
        self._opened = False
        limits = limits or LimitsConfig()
        self.groups: dict[str, GroupState] = {}
        for config in deployment.groups:
            worker = import_worker(config.worker)
            self.groups[config.name] = GroupState(
                config=config,
                methods=catalogue(worker, config.read_only),
                worker_class=user_class(worker).__name__,
                resource_pool=plan.describe_pool(config.name),
                durability=GroupDurability(
                    self.store_io, deployment.name, config, plan.world_size(config.name), worker,
                    self.state.snapshot_every, request_timeout_s,
                ),
            )
        if transports is None:
            transports = resolve_transports([deployment])
        for name, group_state in self.groups.items():
            group_state.transport = transports[name]
            group_state.durability.snapshots.events = self.events
        self.units: list[UnitState] = []
        for unit in units:
            state = UnitState(unit, [self.groups[name] for name in unit.members])
            for member in state.members:
                member.unit = state
            self.units.append(state)
        self.supervisor = Supervisor(self.units, request_timeout_s, health_timeout_s, on_rebuilt=metrics.unit_rebuilt,
                                     replay_timeout_s=self.state.replay_timeout_s, events=self.events)
        self.answers: IdempotencyCache[CallResult] = IdempotencyCache(limits.idempotency_keys, limits.idempotency_bytes)
        #: Weight syncs into the groups whose worker declares weights (hybridflow.control.weights).
        self.weights = WeightSyncs(self, self._unavailable, self.state.weights_directory(), request_timeout_s,
                                   queued=limits.weight_syncs_queued, kept=self.state.weights_kept)
        #: The deployment's OIP models, each one of its groups' methods.
        self.models = ModelServer(deployment.models, self)

    async def open(self) -> None:
        """Claim every group's scope in the store (a fresh start discards it first);
        StateMismatchError, naming the group and the fix, when stored state no longer fits."""
        token = fresh_token() if self.state.fresh else None
        await self.store_io.open()
        await asyncio.gather(*(state.durability.open(self.state, token) for state in self.groups.values()))
        self._opened = True

    @property
    def store(self) -> StateStore:
        return self.store_io.store

    async def start(self) -> None:
        """Start every group with its stored state (opening the store first if
        :meth:`open` was not called)."""
        if not self._opened:
            await self.open()
        self.weights.start()  # each weights_from group synced once, when both groups are ready
        await self.supervisor.start_all()

    # -- calls -------------------------------------------------------------------------
    @metrics.observed_call
    async def call(self, request: CallRequest) -> CallResult:
        """Run one call, counted in the call metrics (:meth:`run`)."""
        return await self.run(request)

    async def run(self, request: CallRequest) -> CallResult:
        """Run one call. With an Idempotency-Key, a repeat of a call that got a final
        answer gets that answer and is not applied again; the same key with another
        body is refused. Not counted as a call: a model's group call runs here, and its
        inference is what the metrics count."""
        if request.idempotency_key is None:
            return await self._call(request)
        key = (request.group, request.method, request.idempotency_key)
        try:
            state = self.groups.get(request.group)
            if state is not None and self.answers.lookup(key, request.fingerprint) is None:
                # Not answered by this replica: maybe by an earlier one, or an earlier run.
                try:
                    stored = await state.durability.stored_answer(request)
                except IdempotencyConflict:
                    raise
                except Exception as exc:  # unknown whether the key was answered: do not run it
                    why = f"the state store could not be read ({type(exc).__name__})"
                    return CallResult(error=self._unavailable(state, why))
                if stored is not None:
                    self.answers.store(key, *stored)
                    return stored[1]
            return await self.answers.run(
                key, request.fingerprint, lambda: self._call(request), keep=lambda r: _kept(r)
            )
        except IdempotencyConflict as exc:
            return CallResult(error=_error(ErrorKind.IDEMPOTENCY_CONFLICT, str(exc)))

    def _unknown_group(self, name: str) -> ControllerError:
        return _error(ErrorKind.UNKNOWN_GROUP, f"unknown group {name!r}; groups: {', '.join(self.groups)}")

    async def _call(self, request: CallRequest) -> CallResult:
        state = self.groups.get(request.group)
        if state is None:
            return CallResult(error=self._unknown_group(request.group))
        if request.operation:  # the service's own operation on the group, not a worker method
            return await self.weights.run(state, request)
        info = state.methods.get(request.method)
        if info is None:
            return CallResult(error=_error(
                ErrorKind.UNKNOWN_METHOD,
                f"group {request.group!r} has no callable method {request.method!r}; "
                f"methods: {', '.join(state.methods)}",
            ))
        result = CallResult(dispatch_mode=info.dispatch_mode, execute_mode=info.execute_mode)
        group = state.group
        if not state.serving:
            result.error = self._unavailable(state)
            return result
        result.world_size = group.world_size
        args, kwargs = list(request.args), dict(request.kwargs)
        if not info.registered:
            problem = per_rank_problem(request.method, group.world_size, args, kwargs)
            if problem:
                result.error = _error(ErrorKind.BAD_ARGUMENTS, problem)
                return result
        if info.mesh is not None and info.mesh not in group.meshes(cached=True):
            try:  # a mesh's first call asks every rank its place: off the loop, before anything is sent
                await asyncio.wait_for(asyncio.to_thread(group.mesh_layout, info.mesh), self.request_timeout_s)
            except Exception as exc:
                result.error = self._submit_failed(state, request.method, exc)
                return result
        entry = record = None
        if info.mutating:
            try:  # encoded now, before any dispatch function sees the arguments
                call = await state.durability.encode(request.method, args, kwargs)
            except StateCodecError as exc:
                result.error = _error(ErrorKind.BAD_ARGUMENTS, f"{request.method}: the state store cannot keep {exc}")
                return result
        try:  # calls wait while a weight sync commits (hybridflow.control.fence), within the deadline
            if state.fence.closed:
                await asyncio.wait_for(state.fence.passed(), self.request_timeout_s)
        except TimeoutError:
            result.error = _error(ErrorKind.TIMEOUT, (
                f"{request.group}.{request.method} waited {self.request_timeout_s:g} s for a weight sync "
                "into the group to finish, and was not run"))
            return result
        group = state.group
        if not state.serving:  # it may have changed while encoding or waiting
            result.error = self._unavailable(state)
            return result
        if info.mutating:
            # No await from here to the submission: the journal's order is the ranks' order.
            entry = state.journal.begin(request.method)
            record = state.durability.pending(entry, call, request)
        version = self.weights.before_submission(state, group)
        # Large arguments are split and pickled in the group's thread, in journal order
        # (hybridflow.control.submissions); a compiled graph's writer thread pickles them
        # anyway, and a group whose weights version is followed asks for it right after.
        pickled_here = state.channel is None or state.channel.pickles_in_caller
        off_loop = pickled_here and version is None and large((args, kwargs))
        try:
            pending = state.submissions.submit(lambda: state.caller.submit(request.method, args, kwargs), off_loop)
        except Exception as exc:
            if entry is not None:
                state.journal.abort(entry)
            result.error = self._submit_failed(state, request.method, exc)
            return result
        if info.mutating:  # it may change the weights version of the calls after it
            self.weights.after_mutating(state, group)
        settle = asyncio.ensure_future(self._settle(state, entry, record, pending, result, version))
        # A client that goes away cancels this await, never the settling of the call.
        return await asyncio.shield(settle)

    async def _settle(
        self, state: GroupState, entry: Any, record: PendingRecord | None, pending: Any, result: CallResult,
        version: Any = None,
    ) -> CallResult:
        unit = state.unit
        generation = unit.generation
        acknowledged = False
        state.running += 1
        try:
            if isinstance(pending, asyncio.Future):  # submitted in the group's thread
                try:
                    pending = await pending
                except Exception as exc:
                    result.error = self._submit_failed(state, entry.method if entry else "call", exc)
                    return result
            outcomes = await rank_outcomes(pending.futures, self.request_timeout_s)
            if outcomes is None:
                # The workers are stuck behind this call (and a mutating one may still apply):
                # rebuild the group from the journal (unless it was rebuilt meanwhile).
                if generation == unit.generation:
                    self.supervisor.restart(unit, f"{state.name}.{entry.method if entry else 'call'} timed out")
                result.error = _error(
                    ErrorKind.TIMEOUT, f"{state.name} did not finish within {self.request_timeout_s:g} s"
                )
                return result
            failures = [failure_of(o.error) for o in outcomes if o.error is not None]
            if failures:
                lost = [message for worker_lost, message in failures if worker_lost]
                if generation != unit.generation:
                    pass  # workers of an earlier generation: what became of them was acted on
                elif lost:
                    self.supervisor.worker_lost(unit, f"{state.name}: a worker was lost ({lost[0]})")
                elif entry is not None:
                    # A mutating call failed: whether it raised on some ranks or on all of
                    # them, it may have changed them before it raised, and the ranks no
                    # longer match the journal.
                    state.diverged = True
                    self.supervisor.restore(unit, f"{state.name}: {failures[0][1]}")
                if lost:
                    result.error = self._unavailable(state, f"a worker of group {state.name!r} was lost ({lost[0]})")
                else:
                    undone = "; the group is restored to its acknowledged state" if entry is not None else ""
                    result.error = _error(ErrorKind.METHOD_RAISED, f"{state.name} raised {failures[0][1]}{undone}")
                return result
            result.weights_version = await self.weights.resolve(version)
            values = [o.value for o in outcomes]
            try:
                result.output = await asyncio.to_thread(pending.collect, values) if large(values) else (
                    pending.collect(values))
            except Exception as exc:  # a collect function's own error: the call itself ran
                why = failure_of(exc)[1]
                if entry is None:
                    result.error = _error(ErrorKind.METHOD_RAISED, f"collecting the outputs failed: {why}")
                else:  # it counts: recorded below like any applied call
                    result.error = _error(ErrorKind.COLLECT_FAILED, (
                        f"{state.name}.{entry.method} was applied on every rank and journaled, but collecting "
                        f"its outputs failed ({why}): it counts, and has no output"))
            if entry is not None:
                try:  # a 2xx means durable: recorded before it is acknowledged
                    await state.durability.record(record, result)
                except Exception as exc:
                    # The ranks applied a call the store may not hold: restore them from the store.
                    state.diverged = True
                    self.supervisor.restore(unit, f"{state.name}: the state store did not take {entry.method} "
                                                  f"({failure_of(exc)[1]})")
                    result.output = None
                    result.error = self._unavailable(
                        state, f"the state store could not record {state.name}.{entry.method} ({type(exc).__name__})"
                    )
                    return result
                state.journal.acknowledge(entry)
                state.state_version += 1
                acknowledged = True
                state.durability.acknowledged(state)
            return result
        finally:
            state.running -= 1
            if entry is not None and not acknowledged:
                state.journal.abort(entry)
                state.diverged = True  # it reached the ranks: some may have applied it

    def _submit_failed(self, state: GroupState, method: str, exc: Exception) -> ControllerError:
        if isinstance(exc, SubmitError):
            # Some ranks got the call and others did not: their state (and the order of any
            # collective they run) no longer match, so the group is restored from the journal.
            state.diverged = True
            self.supervisor.restore(state.unit, f"{state.name}.{method} reached some ranks only: {first_line(exc)}")
            return self._unavailable(state, f"submitting {method} to group {state.name!r} failed part way")
        # Nothing was sent.
        if isinstance(exc, DispatchError):
            return _error(ErrorKind.BAD_ARGUMENTS, str(exc))
        if isinstance(exc, (TypeError, ValueError)):  # a signature or serialisation mismatch
            return _error(ErrorKind.BAD_ARGUMENTS, f"{method}: {failure_of(exc)[1]}")
        return self._unavailable(state, f"{method} could not be submitted ({type(exc).__name__})")

    def _unavailable(self, state: GroupState, why: str | None = None) -> ControllerError:
        if why is None and state.unit is not None and state.unit.halted:
            # retrying does not help until an operator acts: no Retry-After
            return _error(ErrorKind.UNAVAILABLE, f"group {state.name!r} is failed: {state.unit.last_error}")
        status = "checking its workers" if state.reported_status == CHECKING else state.status
        message = why or f"group {state.name!r} is {status}"
        return _error(ErrorKind.UNAVAILABLE, f"{message}; retry shortly", RETRY_AFTER_S)

    # -- operators ------------------------------------------------------------------------
    def reset_group(self, name: str) -> GroupSummary | ControllerError:
        """Discard the group's stored state (journal, snapshot, answers, the answers this
        controller keeps in memory) and rebuild its unit fresh, in the background; other
        members of a colocated unit restore their own state. Works on a ready group and
        on a failed one (the way out of a restore that cannot succeed)."""
        state = self.groups.get(name)
        if state is None or state.unit is None:
            return self._unknown_group(name)

        async def discard() -> None:
            await state.durability.reset()
            self.answers.forget(lambda key: key[0] == name)

        self.supervisor.reset(state.unit, discard, f"{name}: reset by an operator")
        return self._summary(state)

    def restart_group(self, name: str) -> GroupSummary | ControllerError:
        """Rebuild the group's unit on fresh workers with its stored state, in the
        background: the way back for a halted group (``supervision``), and a fresh start
        for any other; its restart count starts again."""
        state = self.groups.get(name)
        if state is None or state.unit is None:
            return self._unknown_group(name)
        self.supervisor.restart_by_operator(state.unit, f"{name}: restarted by an operator")
        return self._summary(state)

    # -- health and description -------------------------------------------------------------
    async def check_health(self) -> dict[str, str]:
        return await self.supervisor.check()

    def ready(self) -> dict[str, bool]:
        """Readiness: whether each group came up since this controller started. Later, a
        group that rebuilds, restores or halts says so in its own status and its calls'
        503s: one group's trouble (one client's bad call above all) takes no other out of
        service."""
        return {name: bool(state.unit and state.unit.came_up) for name, state in self.groups.items()}

    def describe(self) -> list[GroupSummary]:
        return [self._summary(state) for state in self.groups.values()]

    def _summary(self, state: GroupState) -> GroupSummary:
        group = state.group
        layout = None
        if group is not None and hasattr(group, "get_megatron_rank_info"):
            layout = {"tp_size": group.tp_size, "dp_size": group.dp_size, "pp_size": group.pp_size}
        weights_version, weights_error = self.weights.status(state)
        return GroupSummary(
            name=state.name,
            deployment=self.deployment.name,
            world_size=group.world_size if group is not None else None,
            resource_pool=state.resource_pool,
            worker_class=state.worker_class,
            status=state.reported_status,
            last_error=state.unit.last_error if state.unit else None,
            rebuilds=state.unit.rebuilds if state.unit else 0,
            restarts=state.unit.restarts if state.unit else 0,
            replaced_ranks=state.unit.replaced_ranks if state.unit else 0,
            on_rank_lost=state.config.supervision.on_rank_lost,
            replayed_calls=state.unit.replayed if state.unit else 0,
            journal_length=len(state.journal),
            snapshot_error=state.durability.snapshots.error,
            methods=[MethodSummary(**info.describe()) for info in state.methods.values()],
            colocated_with=[m.name for m in state.unit.members if m is not state] if state.unit else [],
            transport=state.transport,
            layout=layout,
            weights_version=weights_version,
            weights_error=weights_error,
        )

    async def describe_group(self, name: str) -> GroupSummary | ControllerError:
        state = self.groups.get(name)
        if state is None:
            return self._unknown_group(name)
        summary = self._summary(state)
        group = state.group
        if state.status == READY and group is not None:
            try:
                ranks = await asyncio.wait_for(asyncio.to_thread(group.rank_info), self.request_timeout_s)
            except Exception as exc:
                ranks, summary.last_error = [], f"rank details unavailable: {failure_of(exc)[1]}"
            if hasattr(group, "get_megatron_rank_info"):
                for entry in ranks:
                    coords = group.get_megatron_rank_info(entry["rank"])
                    entry.update(tp_rank=coords.tp_rank, dp_rank=coords.dp_rank, pp_rank=coords.pp_rank,
                                 cp_rank=getattr(coords, "cp_rank", 0))
            summary.ranks = [dict(r) for r in ranks]
            try:  # the meshes the ranks declared (a Megatron group's too): one call per rank
                ask = getattr(group, "meshes", dict)  # a plain actor declares none
                meshes = await asyncio.wait_for(asyncio.to_thread(ask), self.request_timeout_s)
                summary.meshes = {name: {"dp_size": mesh.dp_size, "collect_ranks": mesh.collect_ranks}
                                  for name, mesh in meshes.items()} or None
            except Exception as exc:
                summary.last_error = summary.last_error or f"meshes unavailable: {failure_of(exc)[1]}"
            if summary.weights_version is not None:
                summary.weights_version = await self.weights.current(state)
        # Where the workers' actors are named, for operators (e.g. to inspect one with Ray's API).
        summary.namespace = ray.get_runtime_context().namespace
        return summary

    def shutdown(self) -> None:
        self.weights.shutdown()
        self.supervisor.shutdown()
        for state in self.groups.values():
            state.submissions.shutdown()
        for unit in self.units:
            group = unit.members[0].group
            if group is not None:
                try:
                    group.shutdown()
                except Exception:  # already gone with the replica
                    pass
        self.store_io.close()


def _kept(result: CallResult) -> bool:
    return result.error is None or result.error.kind not in TRANSIENT

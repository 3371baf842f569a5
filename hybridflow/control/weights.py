"""Weight syncs as the service's own operation on a group (docs/weight-sync.md): a
destination group takes a source group's weights, resharded, under a new version, and
keeps them, so that a rebuild brings back exactly those weights.

A sync (``WEIGHTS_SYNC`` on the destination, ``{"from": <source>}``) runs one at a time
per destination:

1. Stage: the source's slices move into a staged copy on every destination rank
   (``single_controller.weights.stage_weights``) while calls on both groups go on; they
   see the old weights.
2. Commit, fenced: the destination's fence closes (``hybridflow.control.fence``), so no
   call is submitted to it; the commit reaches every rank after every call submitted
   before, and every rank swaps the staged weights in. Still fenced, the shards are read
   back one rank at a time (``read_rank_weights``), written to files
   (``hybridflow.state.shard_files``), and the sync is recorded in the group's journal
   with the files' digests, as a mutating call is; then the fence opens. No call sees
   weights that are not on every rank, or not durable.
3. A sync that fails before its commit, or whose commit reached no rank, leaves the old
   weights and version. A commit that reached some ranks only, or weights that could not
   be kept, restore the group from its journal: its previous weights and version.

Syncs into one group run one at a time; a bounded number wait (``limits.weight_syncs_queued``,
then OVER_LIMIT with a retry time), and waiting syncs from the same source run once for
all of them (``hybridflow.control.sync_queue``).

A restore replays a sync in its place in the journal, or from the group's restore point
(``GroupDurability.operations``): the kept shards are loaded (``load_weights``) after the
calls before it and before the calls after it, so an ``init_model`` after a sync is
replayed as it ran. Files missing or changed fail the restore, with the reason in the
group's status, rather than load other weights. Which files stay: ``hybridflow.control.kept_weights``.

Every error message of a sync is one line (``single_controller.weights.reasons``): no
traceback, path, process id or address reaches a client or the group's status; the full
error goes to the log.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from ray.exceptions import RayActorError, RayError, RayTaskError

from hybridflow.config import import_worker
from hybridflow.control.contract import (
    WEIGHTS_LAYOUT,
    WEIGHTS_SYNC,
    CallRequest,
    CallResult,
    ControllerError,
    ErrorKind,
)
from hybridflow.control.durability import PendingRecord
from hybridflow.control.group_state import READY, GroupState, as_asyncio
from hybridflow.control.kept_weights import GroupSyncs, KeptWeights, directory_of
from hybridflow.control.sync_queue import SyncQueue
from hybridflow.control.weights_version import VersionRef, WeightsVersion
from hybridflow.state.codec import encode_call
from hybridflow.state.shard_files import GroupShardFiles
from single_controller.base.worker_methods import user_class
from single_controller.weights.layout import WeightLayout
from single_controller.weights.reasons import reason_of, scrub
from single_controller.weights.sync import (
    StagedSync,
    WeightSyncError,
    abort_weights,
    commit_weights,
    stage_weights,
)
from single_controller.weights.worker import WeightSyncWorker

logger = logging.getLogger(__name__)

#: Tries of a sync at start that found a group unavailable (a rebuild raced it).
START_ATTEMPTS = 3
#: Seconds between looks at whether both groups of a sync at start are ready.
READY_POLL_S = 0.5


def declares_weights(worker_cls: Any) -> bool:
    """Whether a worker class takes part in weight syncs (mixes in ``WeightSyncWorker``)."""
    plain = user_class(worker_cls)
    return isinstance(plain, type) and issubclass(plain, WeightSyncWorker)


def _error(kind: ErrorKind, message: str, retry_after_s: float | None = None) -> CallResult:
    return CallResult(error=ControllerError(kind, message, retry_after_s))


def _lost_or_raised(exc: BaseException) -> tuple[bool, str]:
    """``(worker_lost, one line)`` for a failure of the workers (see ``reasons``)."""
    lost = isinstance(exc, RayError) and not (isinstance(exc, RayTaskError) and not isinstance(exc, RayActorError))
    return lost, reason_of(exc)


class WeightSyncs:
    """The weight syncs of one controller's groups (see the module docstring)."""

    def __init__(
        self,
        controller: Any,
        unavailable: Callable[..., ControllerError],
        directory: str | None,
        timeout_s: float,
        queued: int = 4,
        kept: int = 2,
    ) -> None:
        """``controller``: the GroupController (its groups, units, supervisor and calls);
        ``unavailable``: its error for a group that is not ready; ``directory``: where
        synced shards are kept (None: a temporary directory, removed at shutdown);
        ``queued``: syncs that may wait per group (``limits.weight_syncs_queued``);
        ``kept``: the latest syncs whose files stay (``state.weights_kept``)."""
        self.controller = controller
        self.unavailable = unavailable
        self.timeout_s = timeout_s
        self.kept = KeptWeights(kept, timeout_s)
        self._temporary: str | None = None
        #: Whether each group's worker declares weights.
        self.declared = {s.name: declares_weights(import_worker(s.config.worker)) for s in controller.groups.values()}
        eligible = [s for s in controller.groups.values()
                    if self.declared[s.name] and not s.config.plain_actor and s.unit is not None
                    and len(s.unit.members) == 1]
        if eligible and directory is None:
            directory = self._temporary = tempfile.mkdtemp(prefix="hybridflow-weights-")
        self.groups: dict[str, GroupSyncs] = {}
        for state in eligible:
            files = GroupShardFiles(directory_of(directory, controller.deployment.name, state.name))
            self.groups[state.name] = GroupSyncs(files, state.config.weights_from, SyncQueue(queued))
            state.durability.operations[WEIGHTS_SYNC] = self._replay
        self._tasks: list[asyncio.Task] = []

    # -- the version calls run on ----------------------------------------------------------
    def before_submission(self, state: GroupState, group: Any) -> VersionRef | None:
        kept = self.groups.get(state.name)
        return None if kept is None else kept.version.before_submission(state, group)

    def after_mutating(self, state: GroupState, group: Any) -> None:
        kept = self.groups.get(state.name)
        if kept is not None:
            kept.version.ask(group)

    @staticmethod
    async def resolve(version: VersionRef | None) -> int | None:
        return None if version is None else await WeightsVersion.resolve(version)

    def status(self, state: GroupState) -> tuple[int | None, str | None]:
        """The group's weights version (the latest known for certain) and latest sync
        error, as its summary shows them. After a (re)start, rank 0 is asked, so the next
        summary shows the restored version."""
        kept = self.groups.get(state.name)
        if kept is None:
            return None, None
        if state.status == READY and state.group is not None:
            kept.version.before_submission(state, state.group)
        return kept.version.known, kept.error

    async def current(self, state: GroupState) -> int | None:
        """The version the group's next call runs on (after a sync being committed)."""
        kept = self.groups.get(state.name)
        if kept is None:
            return None
        await state.fence.passed()
        if state.status != READY or state.group is None:
            return kept.version.known
        return await WeightsVersion.resolve(kept.version.before_submission(state, state.group))

    # -- operations ------------------------------------------------------------------------
    async def run(self, state: GroupState, request: CallRequest) -> CallResult:
        """One of the service's own operations on ``state``'s group."""
        if request.method == WEIGHTS_SYNC:
            problem = self._sync_problem(state, request)
            if problem is not None:
                return problem
            source = self.controller.groups[request.kwargs["from"]]
            kept = self.groups[state.name]
            # waiting requests from one source share a run, unless a key makes one the request's own;
            # a run goes on whoever stops waiting for it: it must not stop half way
            shared = source.name if request.idempotency_key is None else None
            answer = kept.queue.submit(shared, lambda: self._sync_alone(state, source, request))
            if answer is None:
                wait = max(1.0, round(kept.seconds))
                return _error(ErrorKind.OVER_LIMIT, (
                    f"a weight sync into {state.name!r} is running and {kept.queue.waiting} wait for it, the limit "
                    f"(limits.weight_syncs_queued); retry in {wait:g} s"), wait)
            return await answer
        if request.method == WEIGHTS_LAYOUT:
            return await self._layout(state)
        return _error(ErrorKind.UNKNOWN_METHOD, f"unknown operation {request.method!r}")

    def _no_weights(self, state: GroupState) -> str:
        if state.name in self.groups:
            return ""
        if self.declared[state.name]:
            return f"group {state.name!r} shares its processes with another group: weight syncs need its own"
        return (f"group {state.name!r} declares no weights: its worker {state.worker_class} does not mix in "
                "single_controller.weights.WeightSyncWorker")

    def _sync_problem(self, dst: GroupState, request: CallRequest) -> CallResult | None:
        source = request.kwargs.get("from")
        if request.args or set(request.kwargs) != {"from"} or not isinstance(source, str):
            return _error(ErrorKind.BAD_ARGUMENTS, 'a weight sync takes {"from": "<source group>"}')
        src = self.controller.groups.get(source)
        deployment = self.controller.deployment.name
        if src is None:
            return _error(ErrorKind.BAD_ARGUMENTS, (
                f"{source!r} is not a group of deployment {deployment!r}: a weight sync runs between groups of one "
                f"deployment ({', '.join(self.controller.groups)})"))
        if src is dst:
            return _error(ErrorKind.BAD_ARGUMENTS, f"group {dst.name!r} cannot take its weights from itself")
        for state in (dst, src):
            if self._no_weights(state):
                return _error(ErrorKind.BAD_ARGUMENTS, self._no_weights(state))
        for state in (dst, src):
            if state.status != READY or state.group is None:
                return CallResult(error=self.unavailable(state))
        return None

    async def _layout(self, state: GroupState) -> CallResult:
        if self._no_weights(state):
            return _error(ErrorKind.UNKNOWN_METHOD, self._no_weights(state))
        await state.fence.passed()
        group = state.group
        if state.status != READY or group is None:
            return CallResult(error=self.unavailable(state))
        kept = self.groups[state.name]
        version = kept.version.before_submission(state, group)
        state.running += 1
        try:
            ranks = await asyncio.wait_for(
                asyncio.gather(*as_asyncio(group.execute_all_async("_weight_layout"))), self.timeout_s
            )
            layout = WeightLayout(tuple(ranks))
        except Exception as exc:
            lost, why = _lost_or_raised(exc)
            logger.warning("%s: the weights layout could not be read", state.name, exc_info=exc)
            kind = ErrorKind.UNAVAILABLE if lost or isinstance(exc, TimeoutError) else ErrorKind.METHOD_RAISED
            return _error(kind, f"the layout of {state.name!r} could not be read: {why}")
        finally:
            state.running -= 1
        number = await kept.version.resolve(version)
        try:
            disk = await self.kept.disk_use(kept, state)
        except OSError as exc:
            logger.warning("%s: the kept weights' disk use could not be read", state.name, exc_info=exc)
            disk = None
        output = {"group": state.name, "weights_version": number, "layout": layout.to_dict(), "kept": disk}
        return CallResult(output=output, world_size=group.world_size, weights_version=number)

    # -- a sync ------------------------------------------------------------------------------
    async def _sync_alone(self, dst: GroupState, src: GroupState, request: CallRequest) -> CallResult:
        """One sync (the queue runs one at a time per destination)."""
        kept = self.groups[dst.name]
        started = asyncio.get_running_loop().time()
        if dst.status != READY or src.status != READY or dst.group is None or src.group is None:
            result = CallResult(error=self.unavailable(dst if dst.status != READY else src))
        else:
            dst.running += 1
            src.running += 1  # both groups' ranks are busy with it: not hung
            try:
                result = await self._sync(kept, dst, src, request)
            except Exception as exc:  # a fault of the service: still one line to the client
                logger.error("%s: the sync from %s failed", dst.name, src.name, exc_info=exc)
                result = _error(ErrorKind.UNAVAILABLE, f"the sync failed ({reason_of(exc)}); retry shortly", 5.0)
            finally:
                dst.running -= 1
                src.running -= 1
        kept.seconds = asyncio.get_running_loop().time() - started
        if result.error is None:
            kept.error = None
            await self.kept.settle(kept, dst)
        else:
            kept.error = f"the sync from {src.name} failed: {scrub(result.error.message)}"
            logger.warning("%s: %s", dst.name, kept.error)
        return result

    async def _sync(self, kept: GroupSyncs, dst: GroupState, src: GroupState, request: CallRequest) -> CallResult:
        dst_group, src_group, unit = dst.group, src.group, dst.unit
        generation = unit.generation
        current = await kept.version.resolve(kept.version.before_submission(dst, dst_group))
        if current is None:
            return CallResult(error=self.unavailable(dst, f"{dst.name}'s weights version is unknown"))
        version = max(kept.issued, current) + 1
        try:
            staged = await asyncio.to_thread(stage_weights, src_group, dst_group, version, "auto", self.timeout_s)
        except WeightSyncError as exc:
            return self._not_staged(dst, current, exc.__cause__ or exc)
        except ValueError as exc:  # the layouts do not fit: nothing moved
            if not _is_local(exc):  # a rank raised it reading its layout
                return self._not_staged(dst, current, exc)
            return _error(ErrorKind.BAD_ARGUMENTS, f"{src.name} -> {dst.name}: {scrub(str(exc))}")
        except Exception as exc:
            return self._not_staged(dst, current, exc)
        async with dst.fence.held():
            if dst.group is not dst_group or unit.generation != generation or dst.status != READY:
                await asyncio.to_thread(_drop, dst_group, staged)
                return CallResult(error=self.unavailable(dst, f"{dst.name} was rebuilt during the sync"))
            return await self._commit(kept, dst, src, staged, current, request)

    def _not_staged(self, dst: GroupState, current: int, exc: BaseException) -> CallResult:
        lost, why = _lost_or_raised(exc)
        logger.warning("%s: the weights were not staged", dst.name, exc_info=exc)
        message = f"the weights were not staged ({why}); {dst.name} keeps its weights, version {current}"
        if lost or isinstance(exc, TimeoutError):
            return CallResult(error=self.unavailable(dst, message))
        return _error(ErrorKind.METHOD_RAISED, message)

    async def _commit(
        self, kept: GroupSyncs, dst: GroupState, src: GroupState, staged: StagedSync, current: int,
        request: CallRequest,
    ) -> CallResult:
        """Under the destination's fence: commit, keep the shards, record the sync."""
        group, unit = dst.group, dst.unit
        entry = dst.journal.begin(WEIGHTS_SYNC)
        kept.version.set(staged.version)
        try:
            report = await asyncio.to_thread(commit_weights, group, staged, self.timeout_s)
        except WeightSyncError as exc:
            dst.journal.abort(entry)
            logger.warning("%s: the commit of sync %s failed", dst.name, staged.version, exc_info=exc)
            if exc.mixed:
                dst.diverged = True
                self.controller.supervisor.restore(unit, f"{dst.name}: a weight sync's commit reached some ranks only")
                return CallResult(error=self.unavailable(
                    dst, f"the commit reached some ranks of {dst.name} only ({scrub(str(exc))}); it is restored to its previous "
                    f"weights, version {current}"))
            kept.version.set(current)
            return _error(ErrorKind.METHOD_RAISED, f"{scrub(str(exc))}; {dst.name} keeps its weights, version {current}")
        sync_dir = None
        try:
            sync_dir = await asyncio.to_thread(kept.files.new_sync, staged.version, staged.sync_id)
            files = await self.kept.keep(kept, group, sync_dir, staged.version)
            call = await asyncio.to_thread(encode_call, WEIGHTS_SYNC, (), {
                "version": staged.version, "from": src.name, "files": [f.to_record() for f in files]})
            answer = {"group": dst.name, "from": src.name, **report.to_dict()}
            result = CallResult(output=answer, world_size=group.world_size, weights_version=staged.version)
            record = PendingRecord(entry.seq, WEIGHTS_SYNC, call, request.idempotency_key, request.fingerprint)
            await dst.durability.record(record, result)
        except Exception as exc:
            dst.journal.abort(entry)
            logger.warning("%s: the weights of sync %s were not kept", dst.name, staged.version, exc_info=exc)
            if sync_dir is not None:
                await asyncio.to_thread(kept.files.remove, sync_dir)
            why = reason_of(exc)
            dst.diverged = True
            self.controller.supervisor.restore(unit, f"{dst.name}: the weights of sync {staged.version} were not kept")
            return CallResult(error=self.unavailable(
                dst, f"the synced weights could not be kept ({why}); {dst.name} is restored to its previous weights, "
                f"version {current}"))
        dst.journal.acknowledge(entry)
        dst.state_version += 1
        dst.durability.acknowledged(dst)
        kept.version.known = staged.version
        kept.syncs[entry.seq] = sync_dir
        kept.latest = (entry.seq, call)
        kept.issued = max(kept.issued, staged.version)
        self.controller.events.publish("weights_synced", dst.name, source=src.name, version=staged.version)
        return result

    # -- restore -------------------------------------------------------------------------------
    async def _replay(self, member: GroupState, seq: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Load a recorded sync's kept shards on a restoring group (GroupDurability.operations)."""
        await self.kept.replay(self.groups[member.name], member, seq, args, kwargs)

    # -- at start --------------------------------------------------------------------------------
    def start(self) -> None:
        """Sync each group with ``weights_from`` once, when both groups are ready."""
        loop = asyncio.get_running_loop()
        for name, kept in self.groups.items():
            if kept.source is not None:
                self._tasks.append(loop.create_task(self._sync_at_start(name, kept.source)))

    async def _sync_at_start(self, dst: str, src: str) -> None:
        groups = self.controller.groups
        for _ in range(START_ATTEMPTS):
            while groups[dst].status != READY or groups[src].status != READY:
                await asyncio.sleep(READY_POLL_S)
            request = CallRequest(dst, WEIGHTS_SYNC, kwargs={"from": src}, operation=True)
            result = await self.controller.call(request)
            if result.error is None:
                logger.info("%s took %s's weights at start: version %s", dst, src, result.weights_version)
                return
            if result.error.kind not in (ErrorKind.UNAVAILABLE, ErrorKind.TIMEOUT, ErrorKind.OVER_LIMIT):
                return  # the reason is in the group's status (weights_error)
            await asyncio.sleep(result.error.retry_after_s or READY_POLL_S)

    def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)


def _is_local(exc: BaseException) -> bool:
    """Whether ``exc`` was raised in this process (not a rank's error, which Ray wraps)."""
    return not isinstance(exc, RayError)


def _drop(group: Any, staged: StagedSync) -> None:
    try:
        abort_weights(group, staged)
    except Exception:  # a rank that is gone has nothing staged
        pass

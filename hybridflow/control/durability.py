"""Durable state of a served group: its scope in the state store, what is recorded when,
and how fresh workers get its state back (when it is snapshotted:
``hybridflow.control.snapshots``).

One :class:`GroupDurability` per group, used from the controller replica's event loop;
every store call runs in the store's own threads (``hybridflow.state.async_store``), so
a store that waits (a SQLite write lock another process holds, a slow Redis) never holds
up the loop. The store (``hybridflow.state.store``) keeps, per group, the journal of
acknowledged mutating calls, the latest snapshot and the idempotency answers; values are
bytes from ``hybridflow.state.codec`` (no pickle).

What is recorded when
    A mutating call is encoded before it is submitted (off the loop when large;
    arguments the store cannot keep are refused before any rank runs the call). When
    every rank applied it, the call (and, when the request had an Idempotency-Key, its
    answer) is written in one transaction, and only then acknowledged: journaled in
    memory, counted, answered 2xx. A write that fails answers 503 with Retry-After, does
    not acknowledge the call, and restores the group from the store (its workers applied
    a call the store may not hold). Read-only calls and answers that are not a mutating
    call's never reach the store.

Restore (at start, after a replica restart or a new ``serve run``, and on every rebuild)
    The stored state is read and decoded first, and every journaled call must name a
    method of the group's catalogue (anything else is refused, never run). Then the
    group's fresh workers get ``load_state_dict`` with their rank's part of the snapshot,
    and the journal after it is replayed in sequence order; the group is ready when every
    rank ran all of it. An entry of one of the service's own operations (a weight sync:
    ``hybridflow.control.weights``) is replayed by that operation, in its place; one
    directly followed by another of the same operation is skipped, since the later one
    replaces all it did. Later calls are numbered after the stored ones. The supervisor
    bounds a restore by ``state.replay_timeout_s``.

Restore in place, and one rank (the supervisor picks: ``hybridflow.control.recovery``)
    A group whose worker has ``state_dict`` and ``load_state_dict`` can be restored on its
    own processes: every rank loads its part of the snapshot, or, before the first one is
    stored, the state it came up with (each rank's ``state_dict`` taken at its start,
    held as object refs until a snapshot is stored), and the journal after it is replayed.
    A replaced rank alone gets its part of the same and its share of each journaled call.

Restore points (a group without snapshots)
    A group that takes no snapshots would replay its journal from its first call. One of
    the service's own operations (a weight sync) may instead become its restore point
    (:meth:`GroupDurability.store_restore_point`): its record is stored in the snapshot's
    place and the journal up to it deleted. A restore then runs that operation first (the
    synced weights) and the calls after it; what calls before it left in the workers
    beyond that is not restored.

Opening a scope (before any worker starts)
    The scope's metadata (world size, worker class, and the group's init arguments, init
    calls and Megatron layout) is stored on first use and compared on every later one. A
    difference is never replayed: with ``on_mismatch: error`` (the default) the replica
    refuses to start with a :class:`StateMismatchError` naming the group, what changed
    and the fixes; with ``on_mismatch: reset`` that group's stored state is discarded and
    it starts clean. ``fresh`` discards every group's stored state once per Ray session
    (``serve run`` starts one), so a replica that Serve restarts later in the same run
    restores what was acknowledged since. An operator's reset (:meth:`GroupDurability.reset`)
    discards one group's.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridflow.config import GroupConfig, StateConfig
from hybridflow.control.catalogue import LOAD_STATE_DICT, STATE_DICT
from hybridflow.control.contract import CallRequest, CallResult, ControllerError, ErrorKind
from hybridflow.control.group_state import RestoreRefused, as_asyncio
from hybridflow.control.snapshots import Snapshots
from hybridflow.control.submissions import large
from hybridflow.state.async_store import AsyncStore
from hybridflow.state.codec import (
    StateCodecError,
    decode_answer,
    decode_call,
    decode_snapshot,
    encode_answer,
    encode_call,
)
from hybridflow.state.idempotency import IdempotencyConflict
from hybridflow.state.journal import Entry
from hybridflow.state.store import (
    ScopeMeta,
    ScopeState,
    StateMismatchError,
    StateStore,
    StoredAnswer,
    scope_name,
)
from single_controller.base.worker_methods import user_class

if TYPE_CHECKING:
    from hybridflow.control.group_state import GroupState

logger = logging.getLogger(__name__)

#: What a group's stored state depends on beyond its world size and worker class.
FINGERPRINT_FIELDS = ("plain_actor", "init_args", "init_kwargs", "init_calls", "megatron")
#: How a restore replays one of the service's own operations: ``(member, seq, args, kwargs)``.
Operation = Callable[[Any, int, tuple[Any, ...], dict[str, Any]], Awaitable[None]]


class NothingToStartFrom(RuntimeError):
    """A restore in place needs a state to start from: a stored snapshot, or the state the
    ranks had when they came up; this group has neither (a rebuild will do instead)."""


def supports_snapshots(worker_cls: Any) -> bool:
    """Whether a worker class has both methods of the snapshot protocol."""
    plain = user_class(worker_cls)
    return callable(getattr(plain, STATE_DICT, None)) and callable(getattr(plain, LOAD_STATE_DICT, None))


def group_meta(config: GroupConfig, world_size: int) -> ScopeMeta:
    """What a group's stored state was written for. The fingerprint is readable JSON,
    so a mismatch can say which setting changed."""
    settings = config.model_dump(mode="json", include=set(FINGERPRINT_FIELDS))
    return ScopeMeta(world_size, config.worker, json.dumps(settings, sort_keys=True, separators=(",", ":")))


def describe_changes(stored: ScopeMeta, configured: ScopeMeta) -> list[str]:
    """Each difference between what a scope was written for and the group now."""
    changes = []
    if stored.world_size != configured.world_size:
        changes.append(f"world size: stored {stored.world_size}, configured {configured.world_size}")
    if stored.worker_class != configured.worker_class:
        changes.append(f"worker: stored {stored.worker_class!r}, configured {configured.worker_class!r}")
    if stored.config_fingerprint != configured.config_fingerprint:
        try:
            before = json.loads(stored.config_fingerprint)
        except ValueError:
            before = {}
        after = json.loads(configured.config_fingerprint)
        changed = [key for key in sorted({*before, *after}) if before.get(key) != after.get(key)]
        changes += [f"{key}: stored {before.get(key)!r}, configured {after.get(key)!r}" for key in changed]
    return changes


def fresh_token() -> str:
    """What a fresh start is done once per: the Ray session (one per ``serve run``)."""
    import ray

    return ray.get_runtime_context().get_session_name()


def encode_result(result: CallResult) -> bytes | None:
    """A call's answer as the store keeps it for Idempotency-Key repeats; None when the
    codec cannot keep its output (the call still counts; a repeat is told so)."""
    error = None if result.error is None else [result.error.kind.value, result.error.message]
    try:
        return encode_answer({
            "output": result.output, "error": error, "dispatch_mode": result.dispatch_mode,
            "execute_mode": result.execute_mode, "world_size": result.world_size,
        })
    except StateCodecError:
        return None


def decode_result(data: bytes) -> CallResult:
    stored = decode_answer(data)
    error = stored["error"]
    return CallResult(
        output=stored["output"],
        error=None if error is None else ControllerError(ErrorKind(error[0]), error[1]),
        dispatch_mode=stored["dispatch_mode"], execute_mode=stored["execute_mode"], world_size=stored["world_size"],
    )


@dataclass(frozen=True)
class PendingRecord:
    """A mutating call encoded at submission, written when every rank applied it."""

    seq: int
    method: str
    call: bytes
    idempotency_key: str | None
    fingerprint: str | None


async def _run_on_every_rank(futures: list[Any]) -> list[Any]:
    return list(await asyncio.gather(*as_asyncio(futures)))


class GroupDurability:
    """One group's scope in the store (see the module docstring)."""

    def __init__(
        self,
        store: StateStore | AsyncStore,
        deployment: str,
        config: GroupConfig,
        world_size: int,
        worker_cls: Any,
        snapshot_every: int,
        request_timeout_s: float,
    ) -> None:
        """``store``: the store, or the controller's :class:`AsyncStore` that its groups share."""
        self.io = store if isinstance(store, AsyncStore) else AsyncStore(store)
        self.group = config.name
        self.deployment = deployment
        self.scope = scope_name(deployment, config.name)
        self.meta = group_meta(config, world_size)
        self.request_timeout_s = request_timeout_s
        self.has_state_methods = supports_snapshots(worker_cls)
        every = snapshot_every if self.has_state_methods else 0
        self.snapshots = Snapshots(self.io, self.scope, config.name, every, request_timeout_s)
        self.snapshots.on_stored = self._drop_base
        self._opened: ScopeState | None = None
        #: The service's own operations the journal may hold, by name (see "Restore").
        self.operations: dict[str, Operation] = {}
        #: Each rank's ``state_dict`` as it came up, as Ray object refs (in the object
        #: store, not this process), while no snapshot is stored: what a restore in place
        #: starts from (see "Restore in place").
        self.base: list[Any] | None = None

    @property
    def store(self) -> StateStore:
        return self.io.store

    @property
    def snapshot_seq(self) -> int:
        """The latest stored snapshot's sequence number (0: none yet)."""
        return self.snapshots.seq

    # -- opening ---------------------------------------------------------------------
    async def open(self, state: StateConfig, token: str | None) -> None:
        """Claim the scope before the group's workers start (see "Opening a scope")."""
        await self.io.open()
        await self.io.run(self._open, state, token)

    def _open(self, state: StateConfig, token: str | None) -> None:
        if state.fresh and token is not None and self.store.reset(self.scope, once_per=token):
            logger.warning("%s: fresh start, the stored state of this group was discarded", self.scope)
        try:
            self._opened = self.store.open_scope(self.scope, self.meta)
        except StateMismatchError:
            stored = self.store.meta(self.scope)
            changes = describe_changes(stored, self.meta) if stored is not None else ["unknown"]
            if state.on_mismatch != "reset":
                raise StateMismatchError(self._mismatch_message(state, changes)) from None
            logger.warning("%s: stored state discarded (on_mismatch: reset): %s", self.scope, "; ".join(changes))
            self.store.reset(self.scope)
            self._opened = self.store.open_scope(self.scope, self.meta)
        self.snapshots.seq = self._opened.snapshot_seq

    def _mismatch_message(self, state: StateConfig, changes: list[str]) -> str:
        return (
            f"group {self.group!r} of deployment {self.deployment!r}: the stored state in {state.location} was "
            f"written for another shape of this group ({'; '.join(changes)}), and replaying it would rebuild the "
            "wrong state. Put the config back as it was, or discard the stored state: start with `make "
            "serve-fresh` (HYBRIDFLOW_STATE_FRESH=1) or `state: {fresh: true}` for every group, or set "
            "`state: {on_mismatch: reset}` for the groups that no longer fit"
        )

    async def reset(self) -> None:
        """Discard the scope's stored state (journal, snapshot, answers) and claim it anew:
        an operator's reset of this group. Call it with the group's workers gone."""
        try:  # a snapshot being stored now would land in the emptied scope
            await self.snapshots.settled()
        except Exception:
            pass
        await self.io.call("reset", self.scope)
        self._opened = await self.io.call("open_scope", self.scope, self.meta)
        self.snapshots.restored(0, 0)
        self.snapshots.error = None
        logger.warning("%s: the stored state of this group was discarded by an operator's reset", self.scope)

    # -- restore ---------------------------------------------------------------------
    @property
    def in_place(self) -> bool:
        """Whether the group can be restored on its own processes (see "Restore in
        place"): its worker has ``state_dict`` and ``load_state_dict``, and its journal
        holds none of the service's own operations."""
        return self.has_state_methods and not self.operations

    def _drop_base(self) -> None:
        self.base = None

    async def _read(self, member: GroupState, opened: bool = False) -> tuple[ScopeState, list[Any]]:
        """The stored state and its journal's calls, decoded, each checked against the
        group's catalogue. ``opened``: use what opening the scope read, once."""
        stored = None
        if opened:
            stored, self._opened = self._opened, None
        if stored is None:
            stored = await self.io.call("load", self.scope)
        # each call decoded into objects of its own: a dispatch function may change them
        calls = await asyncio.to_thread(lambda: [decode_call(data) for _, data in stored.entries])
        foreign = sorted({m for m, _, _ in calls if m not in member.methods and m not in self.operations})
        if foreign:
            raise RestoreRefused(
                f"{self.scope}: the stored journal names {', '.join(map(repr, foreign))}, which the group's worker "
                f"class does not serve; refusing to replay it"
            )
        return stored, calls

    async def _snapshot_ranks(self, member: GroupState, stored: ScopeState) -> list[Any] | None:
        """The stored snapshot's parts by rank (None: none stored). A restore point is run
        here instead (None then too)."""
        if stored.snapshot is None:
            return None
        ranks, point = await asyncio.to_thread(_snapshot_or_restore_point, stored.snapshot)
        if point is not None:  # an operation's restore point: it runs first, alone
            method, args, kwargs = point
            if method not in self.operations:
                raise RestoreRefused(f"{self.scope}: the stored restore point is a {method!r}, which this "
                                     "service does not run; refusing to restore from it")
            await self.operations[method](member, stored.snapshot_seq, args, kwargs)
            return None
        if len(ranks) != member.group.world_size:
            raise StateMismatchError(
                f"{self.scope}: the stored snapshot has {len(ranks)} ranks, the group {member.group.world_size}"
            )
        return ranks

    async def restore(self, member: GroupState) -> int:
        """Give the member's fresh workers the stored state (see "Restore"); returns how
        many journaled calls were replayed. RestoreRefused (before any rank ran anything)
        for a journal entry that names a method outside the group's catalogue."""
        stored, calls = await self._read(member, opened=True)
        group = member.group
        ranks = await self._snapshot_ranks(member, stored)
        if ranks is not None:
            self.base = None
            await _run_on_every_rank(group.execute_all_async(LOAD_STATE_DICT, ranks))
        elif stored.snapshot is None and self.in_place:
            # submitted before the replay: each rank answers its state as it came up
            self.base = list(group.execute_all_async(STATE_DICT))
        del ranks
        return await self._replay(member, stored, calls)

    async def restore_in_place(self, member: GroupState) -> int:
        """The acknowledged state on the member's own processes (see "Restore in place");
        returns how many journaled calls were replayed. NothingToStartFrom when there is
        neither a stored snapshot nor the state the ranks came up with."""
        stored, calls = await self._read(member)
        ranks = await self._snapshot_ranks(member, stored)
        ranks = self.base if ranks is None else ranks
        if ranks is None:
            raise NothingToStartFrom(f"{self.scope}: no snapshot, and no state from the ranks' start")
        await _run_on_every_rank(member.group.execute_all_async(LOAD_STATE_DICT, ranks))
        del ranks
        return await self._replay(member, stored, calls)

    async def restore_ranks(self, member: GroupState, ranks: list[int]) -> int:
        """Bring the new workers of ``ranks`` to where the member's other ranks are: each
        its part of the snapshot (or of the state the ranks came up with), then its share
        of every journaled call after it, as the group's dispatch gave it. Returns how many
        journaled calls were replayed."""
        stored, calls = await self._read(member)
        if any(method in self.operations for method, _, _ in calls):
            raise RestoreRefused(f"{self.scope}: the journal holds one of the service's own operations, which "
                                 "replays on every rank; one rank cannot be restored alone")
        group = member.group
        parts = await self._snapshot_ranks(member, stored)
        parts = self.base if parts is None else parts
        futures: list[Any] = []
        for rank in ranks:
            if parts is not None:
                futures.append(group.submit_rank(rank, LOAD_STATE_DICT, (parts,)))
            for method, args, kwargs in calls:
                future = group.submit_rank(rank, method, args, kwargs)
                if future is not None:
                    futures.append(future)
        del parts
        await _run_on_every_rank(futures)
        return len(calls)

    async def _replay(self, member: GroupState, stored: ScopeState, calls: list[Any]) -> int:
        """The journal after the snapshot, on every rank, in order; the member's journal
        in memory set to what is stored."""
        group = member.group
        seqs = [seq for seq, _ in stored.entries]
        member.journal.reload(seqs, stored.last_seq + 1)
        self.snapshots.restored(stored.snapshot_seq, len(calls))
        futures: list[Any] = []
        for index, (method, args, kwargs) in enumerate(calls):
            operation = self.operations.get(method)
            if operation is None:
                futures += group.submit(method, args, kwargs).futures
            elif index + 1 == len(calls) or calls[index + 1][0] != method:
                await _run_on_every_rank(futures)  # the calls before it, first
                futures = []
                await operation(member, seqs[index], args, kwargs)
        await _run_on_every_rank(futures)
        return len(calls)

    # -- recording -------------------------------------------------------------------
    async def encode(self, method: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bytes:
        """A mutating call as the journal keeps it, encoded before it is submitted, so that
        what is replayed is what the caller sent, whatever a dispatch function does to its
        arguments afterwards; large arguments are encoded off the loop (StateCodecError:
        arguments the store cannot keep)."""
        if not large((args, kwargs)):
            return encode_call(method, args, kwargs)
        return await asyncio.to_thread(encode_call, method, args, kwargs)

    @staticmethod
    def pending(entry: Entry, call: bytes, request: CallRequest) -> PendingRecord:
        """The record of a submitted call, written once every rank applied it."""
        return PendingRecord(entry.seq, entry.method, call, request.idempotency_key, request.fingerprint)

    async def record(self, record: PendingRecord, result: CallResult) -> None:
        """Write an applied call (and its answer, under its Idempotency-Key) before it is
        acknowledged. Raises whatever the store raised: the call is then not durable."""
        await self.io.run(self._record, record, result)

    def _record(self, record: PendingRecord, result: CallResult) -> None:
        answer = None
        if record.idempotency_key is not None:
            key = _answer_key(record.method, record.idempotency_key)
            answer = StoredAnswer(key, record.fingerprint or "", encode_result(result))
        self.store.record_call(self.scope, record.seq, record.call, answer)

    async def stored_answer(self, request: CallRequest) -> tuple[str | None, CallResult] | None:
        """The answer a call under this Idempotency-Key got before (in an earlier replica
        or run): its fingerprint and result, or None. IdempotencyConflict when the key came
        with another body."""
        return await self.io.run(self._stored_answer, request)

    def _stored_answer(self, request: CallRequest) -> tuple[str | None, CallResult] | None:
        stored = self.store.get_answer(self.scope, _answer_key(request.method, request.idempotency_key))
        if stored is None:
            return None
        fingerprint = stored.fingerprint or None
        if fingerprint is not None and request.fingerprint is not None and fingerprint != request.fingerprint:
            raise IdempotencyConflict(
                f"Idempotency-Key {request.idempotency_key!r} was used with a different request body"
            )
        if stored.answer is None:
            return fingerprint, CallResult(error=ControllerError(
                ErrorKind.NOT_ENCODABLE,
                f"the call under Idempotency-Key {request.idempotency_key!r} was applied, but its answer was too "
                "large (or of a kind) to keep, so it cannot be repeated",
            ))
        return fingerprint, decode_result(stored.answer)

    # -- restore points -----------------------------------------------------------------
    @property
    def restore_points(self) -> bool:
        """Whether an operation may become the group's restore point: it takes no
        snapshots (its worker has no ``state_dict``, or ``snapshot_every`` is 0)."""
        return not self.snapshots.every

    async def store_restore_point(self, member: GroupState, seq: int, call: bytes) -> None:
        """Make the acknowledged operation ``call`` at ``seq`` the group's restore point
        (see "Restore points"): stored in the snapshot's place, the journal up to it
        deleted, in one transaction. Raises whatever the store raised; the journal then
        still holds every call. Call it when no call numbered ``<= seq`` is in flight."""
        await self.io.call("store_snapshot", self.scope, seq, call)
        self.snapshots.seq = seq
        member.journal.truncate(seq)

    # -- snapshots (hybridflow.control.snapshots) -------------------------------------------
    def acknowledged(self, member: GroupState) -> None:
        """Count an acknowledged call; every ``snapshot_every`` of them, take a snapshot."""
        self.snapshots.acknowledged(member)



def _snapshot_or_restore_point(data: bytes) -> tuple[list[Any] | None, tuple[str, tuple, dict] | None]:
    """What the scope's snapshot place holds: ``(ranks, None)`` for a snapshot, or
    ``(None, (method, args, kwargs))`` for an operation's restore point (a call record)."""
    try:
        return decode_snapshot(data), None
    except StateCodecError as not_snapshot:
        try:
            return None, decode_call(data)
        except StateCodecError:
            raise not_snapshot from None


def _answer_key(method: str, key: str) -> str:
    """An Idempotency-Key in a group's scope (the in-memory cache keys by method too)."""
    return f"{method}/{key}"

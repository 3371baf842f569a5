"""Weights from one worker group to another, resharded, versioned and fenced: the
controller's side of a sync.

``sync_weights(src, dst)`` plans which slices of which source ranks every destination
rank needs (:func:`plan_resharding`), moves only those (:mod:`.transport` picks the way)
into a staged copy on each destination rank, then commits: every destination rank swaps
the staged weights in and takes the new ``weights_version``. The two steps are also
separate (:func:`stage_weights`, :func:`commit_weights`, :func:`abort_weights`) for a
controller that sequences a group's calls and runs the commit as one fenced operation.

Calls on the destination may run while it stages: they see the old weights. The commit
is submitted to every rank under the group's submit lock, like any call, so each rank
takes it between the same two calls, and each rank runs one call at a time: a call sees
either the old weights on every rank or the new ones on every rank. A sync that fails
before its commit drops what was staged and leaves the old weights and version.

:func:`read_weights` and :func:`load_weights` keep what a rebuilt destination needs to
come back with exactly the weights of its last sync and the same version.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from single_controller.weights.collective import TransferGroup
from single_controller.weights.layout import RankWeights, WeightLayout
from single_controller.weights.plan import ReshardPlan, plan_resharding
from single_controller.weights.reasons import reason_of
from single_controller.weights.transport import COLLECTIVE, Route, choose_transport

#: Seconds a stage waits for its slices (and a collective transfer for its ranks).
DEFAULT_TIMEOUT_S = 300.0


class WeightSyncError(RuntimeError):
    """A sync that could not complete. Raised before the commit, the destination kept its
    previous weights and version; ``mixed`` says a commit reached only some ranks (the
    group's weights now differ by rank and it must be rebuilt)."""

    def __init__(self, message: str, mixed: bool = False) -> None:
        super().__init__(message)
        self.mixed = mixed


@dataclass
class StagedSync:
    """A sync whose slices wait, staged, on every destination rank."""

    sync_id: str
    version: int
    src_layout: WeightLayout
    dst_layout: WeightLayout
    plan: ReshardPlan
    route: Route
    #: Per destination rank, what it received: bytes, slices, (param, src rank, bytes).
    receipts: list[dict[str, Any]]
    started: float
    stage_seconds: float


@dataclass(frozen=True)
class SyncReport:
    """What a committed sync did."""

    version: int
    transport: str
    backend: str | None
    reason: str
    #: Bytes each destination rank received, as the rank counted them.
    bytes_per_rank: list[int]
    slices_per_rank: list[int]
    #: One full copy of the model, for comparison.
    full_bytes: int
    stage_seconds: float
    commit_seconds: float
    seconds: float
    #: Per destination rank, each slice received: (param, src rank, bytes).
    received: list[list[tuple[str, int, int]]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "weights_version": self.version,
            "transport": self.transport,
            "backend": self.backend,
            "reason": self.reason,
            "bytes_per_rank": list(self.bytes_per_rank),
            "slices_per_rank": list(self.slices_per_rank),
            "full_bytes": self.full_bytes,
            "stage_seconds": self.stage_seconds,
            "commit_seconds": self.commit_seconds,
            "seconds": self.seconds,
        }


# -- reading a group --------------------------------------------------------------------
def _all_ranks(group: Any, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
    return ray.get(group.execute_all_async(method, *args), timeout=timeout_s)


def weight_layout(group: Any, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> WeightLayout:
    """The group's weight layout, every rank's declaration checked against the others'."""
    ranks: list[RankWeights] = _all_ranks(group, "_weight_layout", timeout_s=timeout_s)
    return WeightLayout(tuple(ranks))


def _agreed_version(versions: list[int]) -> int:
    if len(set(versions)) != 1:
        raise WeightSyncError(f"the group's ranks disagree on their weights version: {versions}", mixed=True)
    return int(versions[0])


def weights_version(group: Any, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> int:
    """The group's weights version (0: never synced or loaded); every rank must agree."""
    return _agreed_version(_all_ranks(group, "_weights_version", timeout_s=timeout_s))


def _check_distinct(src: Any, dst: Any) -> None:
    shared = {w._actor_id for w in src.workers} & {w._actor_id for w in dst.workers}
    if shared:
        raise ValueError("the source and destination groups share worker processes; a sync needs two groups")


# -- staging -------------------------------------------------------------------------------
def _stage_through_object_store(
    src: Any, dst: Any, sync_id: str, version: int, plan: ReshardPlan, timeout_s: float
) -> list[dict[str, Any]]:
    # Each distinct piece is put once by its source rank; each destination rank fetches
    # the ones it needs. The stage goes out only once every piece is in the store, so a
    # destination rank (which runs one call at a time) never waits on a busy source.
    # (execute_all hands item r of a list of world-size items to rank r.)
    pieces = plan.pieces_by_src_rank()
    refs_by_src = _all_ranks(src, "_put_weight_slices", pieces, timeout_s=timeout_s)
    ref_of = {
        (rank, param, box): ref
        for rank, (held, refs) in enumerate(zip(pieces, refs_by_src, strict=True))
        for (param, box), ref in zip(held, refs, strict=True)
    }
    transfers = [plan.per_dst[rank] for rank in range(plan.dst_world)]
    refs = [[ref_of[t.piece] for t in rank_transfers] for rank_transfers in transfers]
    return _all_ranks(dst, "_stage_weights", sync_id, version, transfers, refs, timeout_s=timeout_s)


def _stage_through_collective(
    src: Any, dst: Any, sync_id: str, version: int, plan: ReshardPlan, backend: str, timeout_s: float
) -> list[dict[str, Any]]:
    # Opening the rendezvous is a call on every source rank: once it answers, the source
    # ranks have reached the transfer in their call order, and the destination ranks'
    # stage (which holds each of them until its slices arrive) waits on no other call.
    host = plan.src_ranks[0]
    opened = _all_ranks(
        src, "_open_weight_transfer", [r == host for r in range(plan.src_world)], timeout_s, timeout_s=timeout_s
    )
    addr, port = opened[host]
    group = TransferGroup(sync_id, addr, port, backend, timeout_s)
    try:
        sends = src.execute_all_async("_send_weight_slices", group, plan)
        stages = dst.execute_all_async("_stage_weights", sync_id, version, group=group, plan=plan)
        # a margin over the process group's own timeout, which fails the ranks first
        ray.get(sends, timeout=timeout_s + 30)
        return ray.get(stages, timeout=timeout_s + 30)
    finally:
        src.execute_all_async("_close_weight_transfer")


def stage_weights(
    src: Any,
    dst: Any,
    version: int | None = None,
    transport: str = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> StagedSync:
    """Plan and move ``src``'s weights into a staged copy on every rank of ``dst``; the
    live weights of ``dst`` stay as they are. ``version`` (above the destination's
    current one) defaults to the current one plus one. ``transport``: ``auto``, ``object_store`` or
    ``collective``. Layouts that do not match raise ValueError before anything moves;
    a failure while moving drops what was staged and raises :class:`WeightSyncError`."""
    started = time.perf_counter()
    _check_distinct(src, dst)
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 1):
        raise ValueError(f"version must be a positive integer, got {version!r}")
    # both layouts and the destination's version, read at once
    reads = [g.execute_all_async(m) for g, m in ((src, "_weight_layout"), (dst, "_weight_layout"), (dst, "_weights_version"))]
    src_ranks, dst_ranks, versions = (ray.get(r, timeout=timeout_s) for r in reads)
    src_layout, dst_layout = WeightLayout(tuple(src_ranks)), WeightLayout(tuple(dst_ranks))
    plan = plan_resharding(src_layout, dst_layout)
    route = choose_transport(src_layout, dst_layout, plan, transport)
    current = _agreed_version(versions)
    if version is None:
        version = current + 1
    elif version <= current:
        raise ValueError(f"version {version} is not above the destination's current weights version {current}")
    sync_id = uuid.uuid4().hex
    try:
        if route.transport == COLLECTIVE:
            receipts = _stage_through_collective(src, dst, sync_id, version, plan, route.backend, timeout_s)
        else:
            receipts = _stage_through_object_store(src, dst, sync_id, version, plan, timeout_s)
    except Exception as exc:
        _abort_quietly(dst, sync_id)
        raise WeightSyncError(f"weights not staged ({route.transport}): {reason_of(exc)}") from exc
    return StagedSync(
        sync_id, version, src_layout, dst_layout, plan, route, receipts, started, time.perf_counter() - started
    )


def _abort_quietly(dst: Any, sync_id: str) -> None:
    try:
        _all_ranks(dst, "_abort_weights", sync_id, timeout_s=DEFAULT_TIMEOUT_S)
    except Exception:  # a rank that is gone has nothing staged to drop
        pass


def abort_weights(dst: Any, staged: StagedSync) -> None:
    """Drop a staged sync's copies; the live weights never changed."""
    _all_ranks(dst, "_abort_weights", staged.sync_id, timeout_s=DEFAULT_TIMEOUT_S)


# -- committing ------------------------------------------------------------------------------
def _commit(dst: Any, sync_id: str, timeout_s: float) -> None:
    futures = dst.execute_all_async("_commit_weights", sync_id)
    failed: list[tuple[int, Exception]] = []
    for rank, future in enumerate(futures):
        try:
            ray.get(future, timeout=timeout_s)
        except Exception as exc:
            failed.append((rank, exc))
    if not failed:
        return
    first = failed[0][1]  # the error's cause, with its traceback, for the log
    if len(failed) == len(futures):
        raise WeightSyncError(f"no rank committed; previous weights kept: {reason_of(first)}") from first
    ranks = [rank for rank, _ in failed]
    raise WeightSyncError(f"the commit failed on ranks {ranks} only: {reason_of(first)}", mixed=True) from first


def commit_weights(dst: Any, staged: StagedSync, timeout_s: float = DEFAULT_TIMEOUT_S) -> SyncReport:
    """Swap the staged weights in on every rank of ``dst``, which takes ``staged.version``."""
    committing = time.perf_counter()
    try:
        _commit(dst, staged.sync_id, timeout_s)
    except WeightSyncError as exc:
        if not exc.mixed:
            _abort_quietly(dst, staged.sync_id)
        raise
    done = time.perf_counter()
    receipts = staged.receipts
    return SyncReport(
        version=staged.version,
        transport=staged.route.transport,
        backend=staged.route.backend,
        reason=staged.route.reason,
        bytes_per_rank=[int(r["bytes"]) for r in receipts],
        slices_per_rank=[int(r["slices"]) for r in receipts],
        full_bytes=staged.plan.full_bytes,
        stage_seconds=staged.stage_seconds,
        commit_seconds=done - committing,
        seconds=done - staged.started,
        received=[[tuple(item) for item in r["received"]] for r in receipts],
    )


def sync_weights(
    src: Any,
    dst: Any,
    version: int | None = None,
    transport: str = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> SyncReport:
    """:func:`stage_weights` then :func:`commit_weights`: ``dst`` holds ``src``'s weights
    in its own layout under a new version, or, on failure, what it held before."""
    staged = stage_weights(src, dst, version=version, transport=transport, timeout_s=timeout_s)
    return commit_weights(dst, staged, timeout_s=timeout_s)


# -- keeping and restoring ---------------------------------------------------------------------
def read_weights(group: Any, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> tuple[int, list[dict[str, Any]]]:
    """``(version, per-rank shards)``: each rank's shards by logical name, as CPU tensors.
    Read right after a commit (in the same fenced operation), they are the synced weights
    a rebuilt group is to come back with (:func:`load_weights`). This process then holds
    every rank's shards; :func:`read_rank_weights` reads one rank's at a time."""
    answers = _all_ranks(group, "_read_weights", timeout_s=timeout_s)
    return _agreed_version([a["version"] for a in answers]), [a["shards"] for a in answers]


def read_rank_weights(group: Any, rank: int, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> tuple[int, dict[str, Any]]:
    """``(version, shards of rank)``: one rank's part of :func:`read_weights`, so a
    controller that stores them holds one rank's shards at a time, never the whole model."""
    if not 0 <= rank < group.world_size:
        raise ValueError(f"rank {rank} is not in a group of {group.world_size}")
    answers = _all_ranks(group, "_read_weights", [r == rank for r in range(group.world_size)], timeout_s=timeout_s)
    return _agreed_version([a["version"] for a in answers]), answers[rank]["shards"]


def load_weights(
    group: Any,
    shards: Sequence[dict[str, Any]] | Callable[[int], dict[str, Any]],
    version: int,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> int:
    """Give every rank of ``group`` its shards as :func:`read_weights` answered them, and
    ``version``, staged and committed like a sync. ``shards``: one dict per rank in rank
    order, or a function of the rank answering that rank's dict, called one rank at a
    time (a controller restoring from its store then holds one rank's shards at a time).
    Shards that do not fit the group's layout (another tp, shape or dtype) raise
    ValueError and change nothing."""
    world = group.world_size
    if not callable(shards) and (not isinstance(shards, Sequence) or len(shards) != world):
        count = len(shards) if isinstance(shards, Sequence) else type(shards).__name__
        raise ValueError(f"load_weights needs one shard dict per rank ({world}), got {count}")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"version must be a positive integer, got {version!r}")
    shards_of = shards if callable(shards) else shards.__getitem__
    sync_id = uuid.uuid4().hex
    try:
        for rank in range(world):
            # every rank gets the call, in the group's order; only this one has shards in it
            turn = [shards_of(rank) if r == rank else None for r in range(world)]
            _all_ranks(group, "_load_weights", sync_id, version, turn, timeout_s=timeout_s)
    except Exception:
        _abort_quietly(group, sync_id)
        raise
    _commit(group, sync_id, timeout_s)
    return version

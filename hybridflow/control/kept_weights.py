"""The synced weights a group keeps on disk (``hybridflow.state.shard_files``): written
after a sync's commit, loaded by a restore in the sync's place, and deleted once nothing
needs them, so that their disk use stays bounded.

Which syncs' files stay:
- those a restore loads: a sync in the group's journal not directly followed by another
  sync (that one replaces all it did), and the group's restore point;
- and the latest ``state.weights_kept`` syncs' files (the latest first), whatever else.

A group without snapshots would replay its journal from its first call, so every sync
followed by another call would keep its files for ever. Instead, once every call before
it has settled, a sync into such a group becomes its restore point
(``GroupDurability.store_restore_point``): a restore loads its weights, then replays the
calls after it; the journal before it, and the files of the syncs before it, go. A
group with snapshots needs the syncs after its latest snapshot (bounded by
``state.snapshot_every``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.control.group_state import READY, GroupState, RestoreRefused
from hybridflow.control.sync_queue import SyncQueue
from hybridflow.control.weights_version import WeightsVersion
from hybridflow.state.shard_files import GroupShardFiles, ShardFile, ShardFileError
from single_controller.weights.reasons import reason_of
from single_controller.weights.sync import WeightSyncError, load_weights, read_rank_weights

logger = logging.getLogger(__name__)


def replayed_syncs(acknowledged: list[int], syncs: dict[int, str]) -> dict[int, str]:
    """Of ``syncs`` (journal numbers of syncs -> their files' directory), those a restore
    replays from a journal of the ``acknowledged`` numbers: each one not directly followed
    by another sync (that one replaces all it did)."""
    order = sorted(acknowledged)
    kept = {}
    for index, seq in enumerate(order):
        if seq in syncs and (index + 1 == len(order) or order[index + 1] not in syncs):
            kept[seq] = syncs[seq]
    return kept


@dataclass
class GroupSyncs:
    """What the controller keeps for one group whose worker declares weights."""

    files: GroupShardFiles
    source: str | None
    #: The syncs into the group: one runs, a bounded number wait (limits.weight_syncs_queued).
    queue: SyncQueue
    version: WeightsVersion = field(default_factory=WeightsVersion)
    #: Journal number of each sync recorded or replayed -> its files' directory.
    syncs: dict[int, str] = field(default_factory=dict)
    #: The latest sync's journal number and record, until it becomes the restore point.
    latest: tuple[int, bytes] | None = None
    #: The highest version given: a sync's version is above it, even after init_model reset the workers'.
    issued: int = 0
    #: Why the latest sync into the group failed (None once one succeeded): one line.
    error: str | None = None
    #: How long the latest sync took: what a request refused for a full queue is told to wait.
    seconds: float = 0.0


class KeptWeights:
    """The kept files of one controller's groups (see the module docstring)."""

    def __init__(self, kept: int, timeout_s: float) -> None:
        """``kept``: ``state.weights_kept``, the latest syncs whose files stay in any case."""
        if kept < 1:
            raise ValueError(f"state.weights_kept must be at least 1, got {kept}")
        self.kept = kept
        self.timeout_s = timeout_s

    # -- keeping a sync ------------------------------------------------------------------
    async def keep(self, sync: GroupSyncs, group: Any, sync_dir: str, version: int) -> list[ShardFile]:
        """Read the committed shards back and write them, one rank at a time (this
        process never holds the whole model)."""
        return [await self._keep_rank(sync, group, sync_dir, rank, version) for rank in range(group.world_size)]

    async def _keep_rank(self, sync: GroupSyncs, group: Any, sync_dir: str, rank: int, version: int) -> ShardFile:
        read, shards = await asyncio.to_thread(read_rank_weights, group, rank, self.timeout_s)
        if read != version:
            raise WeightSyncError(f"rank {rank} holds version {read} after committing {version}")
        try:
            return await asyncio.to_thread(sync.files.write, sync_dir, rank, shards, version)
        finally:
            del shards

    async def settle(self, sync: GroupSyncs, dst: GroupState) -> None:
        """After a sync was recorded: once every call before it has settled, make it the
        restore point of a group without snapshots, then delete the files no restore
        needs beyond the latest ``kept``."""
        if not sync.syncs:
            return
        latest = max(sync.syncs)
        if not await dst.journal.settled_through(latest, self.timeout_s):
            return
        durability = dst.durability
        record, sync.latest = sync.latest, None
        if (durability.restore_points and record is not None and record[0] == latest and dst.status == READY
                and latest in dst.journal.acknowledged() and latest > durability.snapshot_seq):
            try:
                await durability.store_restore_point(dst, latest, record[1])
            except Exception:  # the journal still holds the sync and every call before it
                logger.warning("%s: the sync at call %s did not become the restore point", dst.name, latest,
                               exc_info=True)
        await self.collect(sync, dst)

    async def collect(self, sync: GroupSyncs, dst: GroupState) -> None:
        """Delete the files of every sync but those a restore loads and the latest ``kept``."""
        acknowledged = dst.journal.acknowledged()
        point = self._restore_point(dst)
        sync.syncs = {seq: d for seq, d in sync.syncs.items() if seq in set(acknowledged) or seq == point}
        needed = set(replayed_syncs(acknowledged, sync.syncs).values())
        if point in sync.syncs:
            needed.add(sync.syncs[point])
        try:
            on_disk = await asyncio.to_thread(sync.files.kept)
            latest = {k.sync_dir for k in on_disk[-self.kept:]}
            await asyncio.to_thread(sync.files.keep_only, needed | latest)
        except OSError:  # kept for the next sync's try; nothing replays from them
            logger.warning("%s: old synced weights not deleted", dst.name, exc_info=True)

    @staticmethod
    def _restore_point(dst: GroupState) -> int | None:
        durability = dst.durability
        return durability.snapshot_seq if durability.restore_points and durability.snapshot_seq else None

    async def disk_use(self, sync: GroupSyncs, dst: GroupState) -> dict[str, Any]:
        """The kept files' disk use, as ``GET /v1/weights/{group}`` shows it."""
        on_disk = await asyncio.to_thread(sync.files.kept)
        point = sync.syncs.get(self._restore_point(dst) or 0)
        return {
            "bytes": sum(k.bytes for k in on_disk),
            "weights_kept": self.kept,
            "syncs": [{"version": k.version, "bytes": k.bytes, "restore_point": k.sync_dir == point}
                      for k in on_disk],
        }

    # -- restore ---------------------------------------------------------------------------
    async def replay(self, sync: GroupSyncs, member: GroupState, seq: int, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> None:
        """Load a recorded sync's kept shards on a restoring group, in its place in the
        journal or as its restore point (``GroupDurability.operations``)."""
        scope = member.durability.scope
        try:
            version = kwargs["version"]
            files = [ShardFile.from_record(record) for record in kwargs["files"]]
            if type(version) is not int or version < 1 or args:
                raise ShardFileError(f"not a sync's version: {version!r}")
        except (KeyError, TypeError, ShardFileError) as exc:
            raise RestoreRefused(f"{scope}: journal entry {seq} is not a weight sync's record ({exc})") from None
        world = member.group.world_size
        if sorted(f.rank for f in files) != list(range(world)):
            raise RestoreRefused(f"{scope}: the weights of sync {version} are kept for other ranks than the group's {world}")
        missing = await asyncio.to_thread(sync.files.missing, files)
        if missing:
            raise RestoreRefused(f"{scope}: the weights of sync {version} cannot be restored: {'; '.join(missing)}")
        by_rank = {f.rank: f for f in files}

        def shards_of(rank: int) -> dict[str, Any]:
            try:
                return sync.files.read(by_rank[rank])
            except ShardFileError as exc:
                raise RestoreRefused(f"{scope}: the weights of sync {version} cannot be restored: {exc}") from None

        try:
            await asyncio.to_thread(load_weights, member.group, shards_of, version, self.timeout_s)
        except RestoreRefused:
            raise
        except ValueError as exc:  # shards that no longer fit the group's layout (here, or a rank's)
            logger.warning("%s: the weights of sync %s do not fit the group", scope, version, exc_info=True)
            raise RestoreRefused(
                f"{scope}: the weights of sync {version} do not fit the group: {reason_of(exc)}") from None
        sync.syncs[seq] = files[0].sync_dir
        sync.issued = max(sync.issued, version)


def directory_of(base: str, deployment: str, group: str) -> Path:
    """Where a group's synced shards are kept."""
    return Path(base) / deployment / group

"""When a group is snapshotted, and what became of its latest try.

Every ``snapshot_every`` acknowledged mutating calls, ``state_dict`` is submitted to every
rank like any call, in the group's one order, so each rank's answer reflects exactly the
calls numbered before it. The snapshot is kept only when every one of those calls has
settled and no rebuild started or ran meanwhile; then it is stored (replacing the previous
one) and the journal up to it is deleted, in the store and in memory.

A snapshot that fails (``state_dict`` raised or ran past the request timeout, the codec
cannot keep what it returned, the store did not take it) loses nothing: the journal still
holds every call. It is reported (``error``, which the group's status shows as
``snapshot_error``, a log line and the ``hybridflow_group_snapshot_failures_total``
metric) and tried again after another ``snapshot_every`` calls; snapshots are never
switched off.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from hybridflow.control import metrics
from hybridflow.control.catalogue import STATE_DICT
from hybridflow.control.group_state import READY, as_asyncio, failure_of
from hybridflow.state.async_store import AsyncStore
from hybridflow.state.codec import StateCodecError, encode_snapshot

if TYPE_CHECKING:
    from hybridflow.control.events import EventBus
    from hybridflow.control.group_state import GroupState

logger = logging.getLogger(__name__)


class Snapshots:
    """One group's snapshots: counted calls, the task taking one, the latest outcome."""

    def __init__(self, io: AsyncStore, scope: str, group: str, every: int, request_timeout_s: float) -> None:
        self.io = io
        self.scope = scope
        self.group = group
        #: Acknowledged calls between snapshots (0: never).
        self.every = every
        self.request_timeout_s = request_timeout_s
        #: The latest stored snapshot's sequence number (0: none yet).
        self.seq = 0
        #: Why the latest try failed; None once one is stored.
        self.error: str | None = None
        self.failures = 0
        #: Called once a snapshot is stored (the durability layer drops the state the
        #: ranks came up with, which a restore in place no longer needs).
        self.on_stored: Callable[[], None] | None = None
        #: Where a failure is published (``snapshot_failed``), when set.
        self.events: EventBus | None = None
        self._since = 0
        self._task: asyncio.Task | None = None

    def restored(self, seq: int, calls_after: int) -> None:
        """The group was restored from a snapshot at ``seq`` and ``calls_after`` calls."""
        self.seq = seq
        self._since = calls_after

    def acknowledged(self, member: GroupState) -> None:
        """Count an acknowledged call; every ``every`` of them, take a snapshot."""
        if not self.every:
            return
        self._since += 1
        if self._since >= self.every and (self._task is None or self._task.done()):
            self._since = 0
            self._task = asyncio.get_running_loop().create_task(self._take(member))

    async def settled(self) -> None:
        """Wait for a snapshot being taken."""
        if self._task is not None:
            await asyncio.shield(self._task)

    def _failed(self, seq: int, why: str) -> None:
        self.failures += 1
        self.error = f"the snapshot at call {seq} failed: {why}; retried after {self.every} more calls"
        logger.warning("%s: %s", self.scope, self.error)
        metrics.snapshot_failed(self.group)
        if self.events is not None:
            self.events.publish("snapshot_failed", self.group, reason=self.error)

    async def _take(self, member: GroupState) -> None:
        unit, group = member.unit, member.group
        if member.status != READY or group is None:
            return
        generation = unit.generation
        seq = member.journal.next_seq - 1
        if seq <= self.seq:
            return
        # Handed over now, with no await since seq was read: every rank runs it after the
        # calls numbered <= seq and before any later one.
        futures = as_asyncio(await member.submissions.submitted(lambda: member.caller.execute_all_async(STATE_DICT)))
        member.running += 1
        try:
            _, waiting = await asyncio.wait(futures, timeout=self.request_timeout_s)
        finally:
            member.running -= 1
        failed = [f.exception() for f in futures if f.done() and f.exception() is not None]
        if waiting or failed:
            why = f"state_dict ran past {self.request_timeout_s:g} s" if waiting else (
                f"state_dict raised {failure_of(failed[0])[1]}")
            return self._failed(seq, why)
        if not await member.journal.settled_through(seq, self.request_timeout_s + 10):
            return self._failed(seq, f"calls before it did not settle within {self.request_timeout_s + 10:g} s")
        if unit.generation != generation or member.status != READY:
            return  # a rebuild started or ran: the ranks may hold calls that were not acknowledged
        try:
            blob = await asyncio.to_thread(encode_snapshot, [f.result() for f in futures])
        except StateCodecError as exc:
            return self._failed(seq, f"state_dict() returned what the store cannot keep ({exc})")
        try:
            await self.io.call("store_snapshot", self.scope, seq, blob)
        except Exception as exc:
            return self._failed(seq, f"the store did not take it ({failure_of(exc)[1]})")
        del blob
        self.seq, self.error = seq, None
        member.journal.truncate(seq)
        metrics.snapshot_taken(self.group)
        if self.on_stored is not None:
            self.on_stored()

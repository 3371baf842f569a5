"""Which version of its weights each call on a group runs on (the ``weights_version`` an
inference answer carries), followed in the group's one order of calls.

The controller submits every call from its event loop and every rank runs its calls in
submission order, so a call runs on the version the last change before it left. A
weight sync's commit sets the version, and the controller knows which. A mutating call
may change it (``init_model`` sets it back to 0), so right after one is submitted rank 0
is asked for its version, in the same order, and the calls after it take that answer;
so is the first call after the group (re)started. No call waits for more than the calls
before it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hybridflow.control.group_state import GroupState, as_asyncio

#: A call's version: known at submission, or the answer of a question asked before it.
VersionRef = int | asyncio.Future


class WeightsVersion:
    """One group's weights version, used from the controller's event loop."""

    def __init__(self) -> None:
        self._now: VersionRef = 0
        #: The unit generation the version belongs to: a rebuild starts a new one.
        self._generation: int | None = None
        #: The latest version known for certain (the group's status shows it).
        self.known = 0

    def before_submission(self, state: GroupState, group: Any) -> VersionRef:
        """The version a call submitted next runs on; call it right before the submission
        (no ``await`` in between)."""
        generation = state.unit.generation if state.unit is not None else None
        if generation != self._generation:
            self._generation = generation
            self.ask(group)
        return self._now

    def ask(self, group: Any) -> None:
        """Ask rank 0 for its version now, in the group's order: right after submitting a
        call that may have changed it."""
        (answer,) = as_asyncio([group.execute_rank_zero_async("_weights_version")])
        self._now = answer
        answer.add_done_callback(self._learned)

    def _learned(self, answer: asyncio.Future) -> None:
        if answer.cancelled() or answer.exception() is not None:
            return  # a lost worker: the group is rebuilt, and asked again after
        if answer is self._now:
            self.known = int(answer.result())

    def set(self, version: int) -> None:
        """Calls submitted from now on run on ``version`` (a commit is submitted next);
        ``known`` follows once the commit is durable."""
        self._now = version

    @staticmethod
    async def resolve(version: VersionRef) -> int | None:
        """The version itself; None when rank 0 could not answer."""
        if isinstance(version, int):
            return version
        try:
            return int(await asyncio.shield(version))
        except Exception:
            return None

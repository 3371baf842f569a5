"""What a group's channel to its ranks offers a caller on an asyncio event loop, whatever
carries the calls (``socket_channel.SocketChannel``, ``graph_channel.GraphChannel``): the
group's dispatch and collect, and execute_all's and rank zero's calls, each answering
asyncio futures, one per rank. A channel implements :meth:`StepChannel._send`."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from single_controller.base.worker_group import PendingCall, split_per_rank

#: One rank's step: ``(method, args, kwargs)``, or None where the call does not run.
Step = tuple[str, tuple, dict] | None


class StepChannel:
    """The calls of ``group`` through a channel of steps, one step per rank and call."""

    group: Any

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def submit(self, method: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> PendingCall:
        """``group.submit`` over the channel: the method's registered dispatch and collect."""
        return self.group.submit(method, args, kwargs, channel=self)

    def execute_all_async(self, method: str, *args: Any, **kwargs: Any) -> list[asyncio.Future]:
        """Every rank, verl's execute_all rule for lists of world_size items."""
        name = self.group._method_prefix + method
        return self._send([(name, a, k) for a, k in split_per_rank(method, self.world_size, args, kwargs)])

    def execute_rank_zero_async(self, method: str, *args: Any, **kwargs: Any) -> asyncio.Future:
        steps: list[Step] = [None] * self.world_size
        steps[0] = (self.group._method_prefix + method, args, kwargs)
        return self._send(steps)[0]

    def _send(self, steps: list[Step]) -> list[asyncio.Future]:
        """Each rank's step sent (None: not to that rank), its future answered."""
        raise NotImplementedError

"""The served test actor: the tutorial's TestActor plus the checks the service's tests
and benchmarks need (call order, slow calls, tensor round trips). Not library code."""

from __future__ import annotations

import time

import numpy as np
import ray
import torch

from single_controller.base.decorator import Dispatch, Execute, register
from single_controller.models.tutorial_workers import TestActor

#: Longest ``sleep`` a client may ask for.
MAX_SLEEP_S = 60.0


@ray.remote
class TransportCheckActor(TestActor.__ray_actor_class__):
    """TestActor(x) with ``record``/``history`` (a method that does not commute, so the
    order calls reach each rank can be checked), ``sleep`` (a slow call), ``echo`` and
    ``checksum`` (a tensor round trip, and a tensor in with 8 bytes out), and ``score``
    (verl's DataProto in and out)."""

    def __init__(self, x) -> None:
        super().__init__(x)
        self._history: list = []

    @register(Dispatch.ONE_TO_ALL)
    def record(self, item):
        """Append ``item`` to this rank's history; returns the history's length."""
        self._history.append(item)
        return len(self._history)

    @register(Dispatch.ONE_TO_ALL)
    def history(self):
        return list(self._history)

    def state_dict(self):
        return {**super().state_dict(), "history": list(self._history)}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self._history = list(state["history"])

    @register(Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float):
        """Hold every rank for ``seconds`` (at most 60): a slow call, for timeouts."""
        seconds = float(seconds)
        if not 0 <= seconds <= MAX_SLEEP_S:
            raise ValueError(f"seconds must be within [0, {MAX_SLEEP_S:g}], got {seconds}")
        time.sleep(seconds)
        return seconds

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def echo(self, x):
        """Return ``x`` from rank 0: a round trip of a tensor, for transport checks."""
        return x

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def checksum(self, x):
        """``x``'s sum (in float64) as a one-element tensor from rank 0: a tensor in,
        a few bytes out, for upload bandwidth checks."""
        return x.to(torch.float64).sum().reshape(1)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def score(self, data):
        """verl's batch type through a PROTO method (each rank gets its rows): ``y`` is
        ``x`` times this actor's ``x``, a ``rank`` column says which rank scored each row,
        the other non-tensor columns and ``meta_info`` come back with the world size."""
        from single_controller.protocol import DataProto

        ranks = np.empty(len(data), dtype=object)
        ranks[:] = self.rank
        return DataProto.from_dict(
            tensors={"y": data.batch["x"] * self._x},
            non_tensors={**data.non_tensor_batch, "rank": ranks},
            meta_info={**data.meta_info, "world_size": self.world_size},
        )

"""Independent workers: ranks that share nothing with each other (no process group, no
collective), as a pool of reward or rollout workers is. One lost rank can be replaced
alone (``supervision: {on_rank_lost: replace_rank}``), and the service's supervision tests
serve them. Not library code.

Each rank keeps what it was sent: ``record`` (every rank, in the group's order), ``add``
(execute_all: a list of one number per rank gives each its own) and ``note`` (rank 0
only); ``state_dict``/``load_state_dict`` carry all of it. ``identity`` tells a rank's
process and how often it loaded a state, so a test sees which processes changed.
"""

from __future__ import annotations

import os
from pathlib import Path

import ray

from single_controller.base import Worker
from single_controller.base.decorator import Dispatch, Execute, register


@ray.remote
class Tally(Worker):
    """``refuse_restart_in``: a directory where each rank leaves a mark at its first start;
    a rank started again finds it and dies in ``__init__`` (a worker that cannot start
    twice, for the restart bounds)."""

    def __init__(self, refuse_restart_in: str | None = None) -> None:
        super().__init__()
        if refuse_restart_in:
            mark = Path(refuse_restart_in) / f"rank-{self.rank}"
            if mark.exists():
                raise RuntimeError(f"rank {self.rank} refuses to start a second time")
            mark.parent.mkdir(parents=True, exist_ok=True)
            mark.write_text(str(os.getpid()))
        self.records: list = []
        self.total = 0
        self.notes: list = []
        self.loads = 0

    @register(Dispatch.ONE_TO_ALL)
    def record(self, item):
        """Append ``item`` on every rank; returns how many this rank holds."""
        self.records.append(item)
        return len(self.records)

    def add(self, x):
        """Add ``x`` to this rank's total (a list of one number per rank: each its own)."""
        self.total += x
        return self.total

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def note(self, item):
        """Rank 0 alone keeps ``item``."""
        self.notes.append(item)
        return len(self.notes)

    @register(Dispatch.ONE_TO_ALL)
    def contents(self):
        return {"records": list(self.records), "total": self.total, "notes": list(self.notes)}

    @register(Dispatch.ONE_TO_ALL)
    def identity(self):
        return {"rank": self.rank, "pid": os.getpid(), "loads": self.loads}

    def state_dict(self):
        return {"records": list(self.records), "total": self.total, "notes": list(self.notes)}

    def load_state_dict(self, state):
        self.records = list(state["records"])
        self.total = state["total"]
        self.notes = list(state["notes"])
        self.loads += 1

"""A worker for the controller's fault tests (tests/ray/test_controller_faults.py): a
call that changes the rank's state and then raises, one whose collect function fails
after every rank applied it, one whose replay reads a file that may be gone by then, a
slow one, and a ``state_dict`` that can be made to fail."""

from __future__ import annotations

import time
from pathlib import Path

import ray

from single_controller.base import Worker
from single_controller.base.decorator import Dispatch, register
from single_controller.base.dispatch import dispatch_one_to_all


def refuse_to_collect(worker_group, outputs):
    raise RuntimeError("this collect function refuses every output")


@ray.remote
class Counter(Worker):
    """Each rank holds ``value`` (starting at 0) and a list of files it loaded."""

    def __init__(self) -> None:
        super().__init__()
        self.value = 0
        self.loaded: list[str] = []
        self.kept: list = []
        self.snapshots_fail = False

    @register(Dispatch.ONE_TO_ALL)
    def add(self, x):
        self.value += x
        return self.value

    @register(Dispatch.ONE_TO_ALL)
    def add_then_raise(self, x):
        """Changes the rank, then raises on every rank."""
        self.value += x
        raise ValueError(f"added {x}, then failed")

    @register(dispatch_mode={"dispatch_fn": dispatch_one_to_all, "collect_fn": refuse_to_collect})
    def add_uncollectable(self, x):
        self.value += x
        return self.value

    @register(Dispatch.ONE_TO_ALL)
    def load(self, path):
        """Reads a file: replaying it fails once the file is gone."""
        self.loaded.append(Path(path).read_text())
        return len(self.loaded)

    @register(Dispatch.ONE_TO_ALL)
    def keep(self, item):
        """Keeps ``item`` in this rank's state (its snapshot nests it two levels deeper)."""
        self.kept.append(item)
        return len(self.kept)

    @register(Dispatch.ONE_TO_ALL)
    def nap(self, seconds):
        time.sleep(float(seconds))
        return seconds

    @register(Dispatch.ONE_TO_ALL)
    def fail_snapshots(self, flag):
        self.snapshots_fail = bool(flag)

    @register(Dispatch.ONE_TO_ALL)
    def get(self):
        return self.value

    def state_dict(self):
        if self.snapshots_fail:
            raise RuntimeError("state_dict refuses for now")
        return {"value": self.value, "loaded": list(self.loaded), "kept": list(self.kept),
                "snapshots_fail": self.snapshots_fail}

    def load_state_dict(self, state):
        self.value, self.loaded, self.kept = state["value"], list(state["loaded"]), list(state["kept"])
        self.snapshots_fail = state["snapshots_fail"]

"""``WorkerGroup.submit_rank`` without Ray: a rank that replays only its share of each call
(as the group's dispatch gives it) ends exactly where the rank that ran every call whole
is, for every dispatch a journal holds: one value to all, execute_all's per-rank lists, a
custom dispatch that changes its arguments, and a call only rank 0 runs."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from single_controller.base.decorator import Dispatch, Execute, register
from single_controller.base.worker_group import WorkerGroup
from single_controller.models.tutorial_workers import two_to_all_dispatch_fn


class Ledger:
    """A rank that remembers everything it is sent."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.seen: list[tuple[str, Any]] = []

    @register(Dispatch.ONE_TO_ALL)
    def everyone(self, item):
        self.seen.append(("everyone", item))

    def own(self, x):  # execute_all: a list of one item per rank gives each its own
        self.seen.append(("own", x))

    @register(dispatch_mode={"dispatch_fn": two_to_all_dispatch_fn, "collect_fn": lambda group, out: out})
    def pairs(self, x):
        self.seen.append(("pairs", x))

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def first_only(self, item):
        self.seen.append(("first_only", item))


class LocalGroup(WorkerGroup):
    """Ranks as objects in this process; a call runs as it is submitted."""

    def __init__(self, world_size: int) -> None:
        super().__init__(resource_pool=None)
        self._workers = [Ledger(rank) for rank in range(world_size)]
        self._bind_worker_method(Ledger)

    def _submit(self, rank: int, method: str, args: tuple, kwargs: dict) -> Any:
        getattr(self._workers[rank], method)(*args, **kwargs)
        return (rank, method)

    def _wait(self, futures: Any) -> Any:
        return futures


JOURNAL = [
    ("everyone", ("a",), {}),
    ("own", ([10, 11, 12, 13],), {}),
    ("pairs", (), {"x": [1, 2]}),  # the dispatch appends to this list: every replay gets its own copy
    ("first_only", ("zero",), {}),
    ("own", (7,), {}),  # not a per-rank list: every rank gets it whole
]


def test_a_rank_replaying_its_share_ends_where_the_others_are():
    whole = LocalGroup(4)
    for method, args, kwargs in copy.deepcopy(JOURNAL):
        whole.submit(method, args, kwargs)
    for rank in range(4):
        replaced = LocalGroup(4)
        replaced._workers[rank] = Ledger(rank)  # a new worker, nothing seen
        submitted = [replaced.submit_rank(rank, method, args, kwargs) for method, args, kwargs in copy.deepcopy(JOURNAL)]
        assert replaced._workers[rank].seen == whole._workers[rank].seen, rank
        others = [r for r in range(4) if r != rank]
        assert all(replaced._workers[r].seen == [] for r in others)  # nothing reached the other ranks
        # a RANK_ZERO call has no share on the other ranks
        assert (submitted[3] is None) == (rank != 0)
    assert whole._workers[2].seen == [("everyone", "a"), ("own", 12), ("pairs", 1), ("own", 7)]
    assert whole._workers[0].seen[3] == ("first_only", "zero")


def test_a_rank_outside_the_group_is_refused():
    group = LocalGroup(2)
    with pytest.raises(ValueError, match="rank 2 is not in this group of 2 ranks"):
        group.submit_rank(2, "everyone", ("a",))

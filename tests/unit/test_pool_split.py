"""Split resource pools, a group's extra rank variables and the collective backend,
without a cluster: which bundles each split of a pool (or of a split) holds, across
placement groups, and what is refused."""

from __future__ import annotations

import pytest

from single_controller.device import get_dist_backend, get_nccl_backend
from single_controller.ray.rank_env import GROUP_ENV_NAMES, check_worker_env
from single_controller.ray.resource_pool import RayResourcePool, SubRayResourcePool, split_resource_pool


class FakePlacementGroup:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def placed_pool(process_on_nodes: list[int]) -> tuple[RayResourcePool, list[FakePlacementGroup]]:
    """A pool whose placement groups exist already (one per node entry)."""
    pool = RayResourcePool(process_on_nodes, use_gpu=True, name_prefix="global", max_colocate_count=3)
    pool.pgs = [FakePlacementGroup(f"pg{i}") for i in range(len(process_on_nodes))]
    pool.bundle_offsets = [0] * len(process_on_nodes)
    return pool, pool.pgs


def layout(pool: RayResourcePool) -> list[tuple[str, int, int]]:
    """(placement group, first bundle, ranks) per node entry."""
    return [(pg.name, first, count) for pg, first, count in zip(pool.pgs, pool.bundle_offsets, pool.store, strict=True)]


def test_equal_splits_keep_to_their_bundles():
    pool, _ = placed_pool([4, 4])
    first, second = split_resource_pool(pool, 4)
    assert layout(first) == [("pg0", 0, 4)] and layout(second) == [("pg1", 0, 4)]
    assert (first.world_size, second.start_bundle_index) == (4, 4)
    assert (second.use_gpu, second.max_colocate_count, second.parent) == (True, 3, pool)


def test_a_split_crosses_placement_groups_and_splits_again():
    pool, _ = placed_pool([4, 4])
    small, large = split_resource_pool(pool, [2, 6])
    assert layout(small) == [("pg0", 0, 2)]
    assert layout(large) == [("pg0", 2, 2), ("pg1", 0, 4)]  # ranks 0-1 on pg0's bundles 2-3
    assert [(pg.name, index) for pg, index in large.bundles()] == [
        ("pg0", 2), ("pg0", 3), ("pg1", 0), ("pg1", 1), ("pg1", 2), ("pg1", 3)
    ]
    parts = split_resource_pool(large, [1, 2, 3])
    assert [layout(p) for p in parts] == [[("pg0", 2, 1)], [("pg0", 3, 1), ("pg1", 0, 1)], [("pg1", 1, 3)]]
    assert [p.start_bundle_index for p in parts] == [2, 3, 5]  # counted from the first pool's bundles
    assert all(isinstance(p, SubRayResourcePool) and not p._owns_pgs for p in parts)
    parts[0].remove()  # a split never removes its parent's placement groups
    assert large.pgs is not None and pool.pgs is not None


@pytest.mark.parametrize(
    "split_size, message",
    [(3, "does not divide the pool's world size 8"), (0, "does not divide"), ([2, 2], "add up to 4, not"),
     ([4, 0, 4], "positive integers"), ("4", "positive integer or a list"), (True, "positive integer or a list")],
)
def test_bad_split_sizes_are_refused(split_size, message):
    pool, _ = placed_pool([4, 4])
    with pytest.raises(ValueError, match=message):
        split_resource_pool(pool, split_size)


def test_worker_env_adds_variables_but_never_the_groups_own():
    assert check_worker_env(None) == {} and check_worker_env({"HF_HOME": "/models"}) == {"HF_HOME": "/models"}
    with pytest.raises(ValueError, match=r"may not set \['RANK', 'WORLD_SIZE'\]"):
        check_worker_env({"WORLD_SIZE": "100", "RANK": "3", "OK": "1"})
    with pytest.raises(ValueError, match="string values"):
        check_worker_env({"N": 1})
    with pytest.raises(ValueError, match="a mapping"):
        check_worker_env(["A=1"])
    assert {"MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "RAY_LOCAL_WORLD_SIZE"} <= GROUP_ENV_NAMES


def test_the_collective_backend_follows_the_device():
    assert get_nccl_backend() == get_dist_backend() == "gloo"  # this CPU machine

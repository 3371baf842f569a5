"""The tutorial, step by step, on the session's cluster (8 logical GPUs): its numbers."""

from __future__ import annotations

import pytest
import torch

from examples.tutorial import run_tutorial


@pytest.fixture(scope="module")
def tutorial(ray_cluster):
    results = run_tutorial(use_gpu=True)
    yield results
    for group in results["groups"].values():
        group.shutdown()
    for name in ("pool", "pool_a"):
        results["pools"][name].remove()


def values(tensors):
    assert all(isinstance(t, torch.Tensor) and t.shape == (1,) for t in tensors)
    return [t.item() for t in tensors]


def test_chapter_1_plain_accumulator(tutorial):
    assert tutorial["accumulator_initial"] == 0
    assert tutorial["accumulator_after_add"] == 10


def test_chapter_2_worker_group_add(tutorial):
    assert values(tutorial["add_1"]) == [1, 2, 3, 4]
    assert tutorial["local_rank_list"] == [0, 1, 2, 3]
    assert tutorial["local_world_size_list"] == [4, 4, 4, 4]


def test_chapter_2_workers_and_names(tutorial):
    group = tutorial["groups"]["gpu_accumulator"]
    assert len(group.workers) == 4
    assert all(type(w).__name__ == "ActorHandle" for w in group.workers)
    names = group.worker_names
    assert [n.split("GPUAccumulator_")[1] for n in names] == ["0:0", "0:1", "0:2", "0:3"]
    assert len({n.split("GPUAccumulator")[0] for n in names}) == 1


def test_chapter_2_second_and_merged_pools(tutorial):
    assert tutorial["local_rank_list_1"] == [0, 1, 2, 3]
    assert tutorial["local_rank_list_merge"] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert values(tutorial["add_2"]) == [2, 3, 4, 5]
    assert values(tutorial["add_3"]) == [3, 4, 5, 6, 7, 8, 9, 10]
    assert tutorial["world_sizes"] == (4, 4, 8)


def test_chapter_3_decorated_one_to_all(tutorial):
    assert values(tutorial["decorator_add"]) == [10, 11, 12, 13, 14, 15, 16, 17]


def test_chapter_3_custom_dispatch_and_rank_zero(tutorial):
    assert tutorial["foo_custom"] == [8, 10, 8, 10]
    assert tutorial["foo_rank_zero"] == 5


def test_unregistered_method_broadcasts_scalars(tutorial):
    group = tutorial["groups"]["test_actor"]
    assert group.execute_all_sync("foo", y=3) == [5, 5, 5, 5]
    assert group.execute_all_sync("foo", y=[1, 2, 3, 4]) == [3, 4, 5, 6]
    assert group.execute_rank_zero_sync("foo", y=10) == 12


def test_merged_pool_shares_gpus_with_its_parts(tutorial):
    groups = tutorial["groups"]
    first = [i["cuda_visible_devices"] for i in groups["gpu_accumulator"].rank_info()]
    second = [i["cuda_visible_devices"] for i in groups["gpu_accumulator_a"].rank_info()]
    merged = [i["cuda_visible_devices"] for i in groups["gpu_accumulator_merge"].rank_info()]
    assert merged == first + second
    assert len(set(merged)) == 8  # 8 distinct logical GPUs
    assert [i["local_rank"] for i in groups["gpu_accumulator_merge"].rank_info()] == [0, 1, 2, 3, 0, 1, 2, 3]

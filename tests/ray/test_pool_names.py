"""Pools without a name (or with the same name) coexist in one cluster: each pool's
placement groups have names of their own."""

from __future__ import annotations

import ray
from ray.util.placement_group import placement_group_table

from single_controller.models.tutorial_workers import GPUAccumulator
from single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup


def pg_names(pool: RayResourcePool) -> list[str]:
    return [placement_group_table(pg)["name"] for pg in pool.get_placement_groups()]


def test_two_unnamed_pools_and_a_group_on_each(ray_cluster):
    gpu_pool = RayResourcePool([2], use_gpu=True)
    cpu_pool = RayResourcePool([2], use_gpu=False)
    groups = []
    try:
        groups = [RayWorkerGroup(pool, RayClassWithInitArgs(cls=GPUAccumulator)) for pool in (gpu_pool, cpu_pool)]
        for group in groups:
            assert [float(v) for v in group.execute_all_sync("add", x=[1, 1])] == [1.0, 2.0]
        gpus = [info["cuda_visible_devices"] for info in groups[0].rank_info()]
        assert all(gpus) and len(set(gpus)) == 2
        assert not any(info["cuda_visible_devices"] for info in groups[1].rank_info())
        assert set(pg_names(gpu_pool)).isdisjoint(pg_names(cpu_pool))
    finally:
        for group in groups:
            group.shutdown()
        gpu_pool.remove()
        cpu_pool.remove()


def test_pools_with_the_same_name_prefix_coexist(ray_cluster):
    first = RayResourcePool([1], use_gpu=False, name_prefix="twin")
    second = RayResourcePool([1], use_gpu=False, name_prefix="twin")
    try:
        names = pg_names(first) + pg_names(second)
        assert len(set(names)) == 2 and all(name.startswith("twinsc_pool_") for name in names)
        assert ray.get([pg.ready() for pg in first.get_placement_groups() + second.get_placement_groups()], timeout=30)
    finally:
        first.remove()
        second.remove()

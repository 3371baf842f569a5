"""Fused workers (several classes in one process, written as one class) and async role
methods on fused and colocated workers, on the session's Ray cluster."""

from __future__ import annotations

import asyncio

import pytest
import ray
import torch

from single_controller import DataProto
from single_controller.base import Worker
from single_controller.base.decorator import Dispatch, register
from single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    create_colocated_worker_cls,
    create_colocated_worker_cls_fused,
    create_colocated_worker_raw_cls,
)


@ray.remote
class Adder(Worker):
    def __init__(self, base: int = 0) -> None:
        super().__init__()
        self.base = base

    @register(Dispatch.ONE_TO_ALL)
    def add(self, x):
        return x + self.base + self.rank

    @register(Dispatch.ONE_TO_ALL)
    async def add_later(self, x):
        await asyncio.sleep(0.01)
        return x + self.base + self.rank

    @register(Dispatch.DP_COMPUTE_PROTO)
    def scale(self, data: DataProto) -> DataProto:
        data.batch["x"] *= 10
        return data


@ray.remote
class Subtractor(Worker):
    def __init__(self, val: int) -> None:
        super().__init__()
        self.val = val

    @register(Dispatch.ALL_TO_ALL)
    def sub(self, x):
        return x - self.val

    @register(Dispatch.ONE_TO_ALL)
    def peer_base(self):
        """Roles of one fused worker see each other."""
        return self.get_fused_worker_by_name("adder").base


ROLES = {"adder": RayClassWithInitArgs(Adder, base=100), "sub": RayClassWithInitArgs(Subtractor, val=1)}
FusedBase = create_colocated_worker_raw_cls(ROLES)


@ray.remote
class Hybrid(FusedBase):
    @register(Dispatch.ONE_TO_ALL)
    def both(self, x):
        return self.sub.sub(self.adder.add(x))


@pytest.fixture(scope="module")
def pool(ray_cluster):
    p = RayResourcePool([2], use_gpu=False, name_prefix="fused")
    yield p
    p.remove()


@pytest.fixture(scope="module")
def hybrid(pool):
    cls = RayClassWithInitArgs(cls=Hybrid)
    cls.fused_worker_used = True
    group = RayWorkerGroup(pool, cls)
    group.fuse(["adder", "sub"])
    yield group
    group.shutdown()


def test_the_raw_class_is_a_worker_holding_every_role():
    assert issubclass(FusedBase, Worker) and FusedBase.__name__ == "FusedWorker_adder_sub"
    assert FusedBase.is_fused_worker and set(FusedBase.raw_cls_dict) == {"adder", "sub"}
    with pytest.raises(ValueError, match="would hide Worker attributes"):
        create_colocated_worker_raw_cls({"rank": RayClassWithInitArgs(Adder)})
    with pytest.raises(ValueError, match="not a Worker subclass"):
        create_colocated_worker_raw_cls({"plain": RayClassWithInitArgs(dict)})


def test_a_fused_group_reaches_each_role_and_its_own_methods(hybrid):
    assert hybrid.fused_worker_used and set(hybrid.wg_dict) == {"adder", "sub"}
    assert hybrid.adder.add(1) == [101, 102]
    assert hybrid.sub.sub([101, 102]) == [100, 101]
    assert hybrid.both(1) == [100, 101]
    assert hybrid.sub.peer_base() == [100, 100]
    assert not hasattr(hybrid, "add") and not hasattr(hybrid.adder, "both")
    out = hybrid.adder.scale(DataProto.from_dict({"x": torch.arange(4.0)}))
    assert out.batch["x"].tolist() == [0.0, 10.0, 20.0, 30.0]
    pids = {name: [info["pid"] for info in g.rank_info()] for name, g in [("all", hybrid), *hybrid.wg_dict.items()]}
    assert pids["all"] == pids["adder"] == pids["sub"]


def test_async_role_methods_are_awaited(hybrid):
    assert hybrid.adder.add_later(1) == [101, 102]
    # verl's entry point by fused method name, sync and async
    assert hybrid.execute_all_sync("_fuw_execute", "adder_fwmn_add", 5) == [105, 106]
    assert hybrid.execute_all_sync("_fuw_execute", "adder_fwmn_add_later", 5) == [105, 106]
    with pytest.raises(ray.exceptions.RayTaskError, match="_fuw_execute takes"):
        hybrid.execute_rank_zero_sync("_fuw_execute", "nobody_fwmn_add", 5)


def test_create_colocated_worker_cls_fused_spawns_role_groups(pool):
    fused = create_colocated_worker_cls_fused(ROLES)
    assert fused.fused_worker_used
    group = RayWorkerGroup(pool, fused)
    try:
        roles = group.spawn(prefix_set=ROLES.keys())
        assert roles["adder"].sub_cls_name == "adder" and roles["adder"].add_later(2) == [102, 103]
        assert roles["sub"].sub([5, 6]) == [4, 5]
        with pytest.raises(ValueError, match="unknown roles"):
            group.spawn_fused(["critic"])
    finally:
        group.shutdown()


def test_async_methods_on_colocated_roles_are_awaited(pool):
    group = RayWorkerGroup(pool, create_colocated_worker_cls(ROLES))
    try:
        roles = group.spawn(prefix_set=["adder", "sub"])
        assert roles["adder"].add_later(1) == [101, 102]
        assert roles["adder"].add(1) == [101, 102] and roles["sub"].peer_base() == [100, 100]
    finally:
        group.shutdown()

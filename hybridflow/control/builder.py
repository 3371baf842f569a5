"""From a deployment's declaration to running worker groups: its resource pools (on the
replica's placement group where the plan puts them) and one start function per unit.

A unit is what starts, fails and is rebuilt as one: a group, or the groups colocated in
one process per bundle. Its ``start()`` blocks (it waits for worker processes), so the
controller runs it in a thread; it returns every member group by name, after the
members' ``init_calls``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from hybridflow.config import DeploymentConfig, GroupConfig, import_worker
from hybridflow.control.placement import DeploymentPlan
from single_controller.base.worker_group import PendingCall, split_per_rank
from single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, merge_resource_pool
from single_controller.ray.colocated import create_colocated_worker_cls


class PlainActorGroup:
    """A plain Ray actor (the tutorial's chapter-1 Accumulator) presented as a group of
    one: its calls return the actor's value itself."""

    world_size = 1

    def __init__(self, actor_cls: Any, args: list, kwargs: dict, options: dict[str, Any]) -> None:
        remote_cls = actor_cls if hasattr(actor_cls, "options") else ray.remote(actor_cls)
        self.actor = remote_cls.options(**{"num_cpus": 0, **options}).remote(*args, **kwargs)
        ray.get(self.actor.__ray_ready__.remote())

    @property
    def workers(self) -> list[Any]:
        return [self.actor]

    def submit(self, method: str, args: Any = (), kwargs: dict[str, Any] | None = None) -> PendingCall:
        future = getattr(self.actor, method).remote(*args, **(kwargs or {}))
        return PendingCall([future], lambda values: values[0])

    def execute_all_async(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """verl's execute_all on a group of one: a one-item list is the rank's own item."""
        ((rank_args, rank_kwargs),) = split_per_rank(method, 1, args, kwargs)
        return [getattr(self.actor, method).remote(*rank_args, **rank_kwargs)]

    def call_method(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return ray.get(getattr(self.actor, method).remote(*args, **kwargs))

    def rank_info(self) -> list[dict[str, Any]]:
        return [{"rank": 0, "local_rank": 0, "world_size": 1, "actor_id": self.actor._actor_id.hex()}]

    def shutdown(self) -> None:
        ray.kill(self.actor)


@dataclass
class Unit:
    """Groups that start and fail together (one, or a colocation)."""

    name: str
    members: list[str]
    start: Callable[[], dict[str, Any]]


class PoolSet:
    """The deployment's pools, made once and kept across rebuilds (its placement groups
    outlive the workers in them)."""

    def __init__(self, plan: DeploymentPlan, placement_group: Any = None, bundle_shift: int = 0) -> None:
        """``bundle_shift``: where the plan's bundles start in ``placement_group`` past
        their own place (the ingress's group, when it hosts several controllers)."""
        self.plan = plan
        self.placement_group = placement_group
        self.bundle_shift = bundle_shift
        self._pools: dict[tuple[str, ...], RayResourcePool] = {}

    def pool(self, roots: tuple[str, ...]) -> RayResourcePool:
        if roots not in self._pools:
            if len(roots) == 1:
                self._pools[roots] = self._own(roots[0])
            else:
                merged = self.pool(roots[:1])
                for root in roots[1:]:
                    merged = merge_resource_pool(merged, self.pool((root,)))
                self._pools[roots] = merged
        return self._pools[roots]

    def _own(self, name: str) -> RayResourcePool:
        plan = self.plan.pools[name]
        common = {"use_gpu": plan.use_gpu, "name_prefix": plan.name_prefix, "max_colocate_count": plan.max_colocate_count}
        if plan.first_bundle is not None and self.placement_group is not None:
            return RayResourcePool.from_placement_group(
                self.placement_group, plan.world_size, first_bundle=plan.first_bundle + self.bundle_shift, **common
            )
        return RayResourcePool(list(plan.process_on_nodes), num_cpus_per_bundle=plan.num_cpus_per_bundle, **common)

    def remove(self) -> None:
        for roots, pool in self._pools.items():
            if len(roots) == 1:
                pool.remove()  # a no-op for bundles of the replica's own placement group


def _class_with_args(group: GroupConfig, worker: Any) -> RayClassWithInitArgs:
    cls_with_init = RayClassWithInitArgs(worker, *copy.deepcopy(group.init_args), **copy.deepcopy(group.init_kwargs))
    if group.actor_options:
        cls_with_init.update_options(copy.deepcopy(group.actor_options))
    return cls_with_init


def _answering_out_of_band(cls_with_init: Any) -> Any:
    """The controller reads every output: a rank's tensors come back without torch's
    pickling (the bench's tensor_return_ratio: 0.76x for four one-element answers)."""
    cls_with_init.send_tensors_out_of_band()
    return cls_with_init


def _run_init_calls(group: Any, config: GroupConfig) -> None:
    for call in config.init_calls:
        group.call_method(call.method, *copy.deepcopy(call.args), **copy.deepcopy(call.kwargs))


def restart_rank(group: Any, config: GroupConfig, rank: int) -> None:
    """Start ``group``'s ``rank`` again alone (``RayWorkerGroup.replace_worker``) and run
    that rank's share of the group's init calls on it, as its first start ran them."""
    group.replace_worker(rank)
    for call in config.init_calls:
        future = group.submit_rank(rank, call.method, copy.deepcopy(call.args), copy.deepcopy(call.kwargs))
        if future is not None:
            ray.get(future)


def _start_group(config: GroupConfig, pools: PoolSet, plan: DeploymentPlan) -> Any:
    worker = import_worker(config.worker)
    if config.plain_actor:
        return PlainActorGroup(worker, copy.deepcopy(config.init_args), copy.deepcopy(config.init_kwargs),
                               copy.deepcopy(config.actor_options))
    pool = pools.pool(plan.group_pools[config.name])
    cls_with_init = _answering_out_of_band(_class_with_args(config, worker))
    if config.megatron is not None:
        from single_controller.ray.megatron import MegatronRayWorkerGroup

        return MegatronRayWorkerGroup(pool, cls_with_init, default_megatron_kwargs=config.megatron.kwargs())
    return RayWorkerGroup(pool, cls_with_init)


def units(deployment: DeploymentConfig, plan: DeploymentPlan, pools: PoolSet) -> list[Unit]:
    """One unit per colocation and per group outside any, in declaration order."""
    configs = {g.name: g for g in deployment.groups}
    colocated = {name: members for members in plan.colocations for name in members}
    found: list[Unit] = []
    for group in deployment.groups:
        members = colocated.get(group.name)
        if members is None:

            def start(config: GroupConfig = group) -> dict[str, Any]:
                started = _start_group(config, pools, plan)
                try:
                    _run_init_calls(started, config)
                except Exception:
                    started.shutdown()
                    raise
                return {config.name: started}

            found.append(Unit(group.name, [group.name], start))
        elif members[0] == group.name:

            def start_colocated(names: list[str] = members) -> dict[str, Any]:
                roles = {name: _class_with_args(configs[name], import_worker(configs[name].worker)) for name in names}
                pool = pools.pool(plan.group_pools[names[0]])
                fused = RayWorkerGroup(pool, _answering_out_of_band(create_colocated_worker_cls(roles)))
                groups = fused.spawn(prefix_set=names)
                try:
                    for name in names:
                        _run_init_calls(groups[name], configs[name])
                except Exception:
                    fused.shutdown()
                    raise
                return groups

            found.append(Unit("+".join(members), list(members), start_colocated))
    return found

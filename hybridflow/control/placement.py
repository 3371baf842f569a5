"""Placement derived from a deployment's declaration: its Serve placement-group bundles,
and where each pool's bundles are (nothing counts offsets by hand).

A pool of one node entry (``process_on_nodes: [4]``) lives in the controller replica's
own placement group, after the replica's bundle, in declaration order: Serve reserves it
with the replica, its scheduler and autoscaler see it, and Serve frees it with the replica.
A pool over several nodes (``[2, 2]``) cannot sit in one STRICT_PACK group: it gets
placement groups of its own (one per entry, on distinct nodes when the cluster has
them), which the replica creates and which go with it. Groups that share a pool
(``same_as``) or merge pools (``merge``) add no bundles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridflow.config import DeploymentConfig, GroupConfig, ServiceConfig, colocations, pool_root


@dataclass(frozen=True)
class PoolPlan:
    """A pool of its own, named after the group that declares it."""

    name: str
    process_on_nodes: tuple[int, ...]
    use_gpu: bool
    name_prefix: str | None
    max_colocate_count: int
    num_cpus_per_bundle: float
    #: Index of its first bundle in the replica's placement group; None when the pool
    #: spans nodes and makes placement groups of its own.
    first_bundle: int | None

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    def bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.num_cpus_per_bundle}
        if self.use_gpu:
            bundle["GPU"] = 1.0
        return bundle

    def describe(self) -> str:
        where = "replica placement group" if self.first_bundle is not None else "placement groups of its own"
        device = "GPU" if self.use_gpu else "CPU"
        return f"pool {self.name} {list(self.process_on_nodes)} ({device}, {where})"


@dataclass(frozen=True)
class DeploymentPlan:
    name: str
    replica_cpus: float
    pools: dict[str, PoolPlan]
    #: Per group: the pools its ranks run on (one, or the merged ones in order); empty
    #: for a plain actor.
    group_pools: dict[str, tuple[str, ...]]
    colocations: list[list[str]] = field(default_factory=list)

    def replica_bundles(self) -> list[dict[str, float]]:
        """The replica's own bundle first, then one per process of each single-node pool."""
        bundles = [{"CPU": self.replica_cpus}]
        for pool in self.pools.values():
            if pool.first_bundle is not None:
                bundles += [pool.bundle() for _ in range(pool.world_size)]
        return bundles

    def serve_options(self) -> dict[str, Any]:
        """Options for ``serve.deployment(...).options``: the replica's CPUs and bundles."""
        return {
            "ray_actor_options": {"num_cpus": self.replica_cpus},
            "placement_group_bundles": self.replica_bundles(),
            "placement_group_strategy": "STRICT_PACK",
        }

    def world_size(self, group: str) -> int:
        """A group's ranks: its pools' processes (1 for a plain actor)."""
        roots = self.group_pools.get(group, ())
        return sum(self.pools[root].world_size for root in roots) if roots else 1

    def describe_pool(self, group: str) -> str:
        roots = self.group_pools.get(group, ())
        if not roots:
            return "plain actor"
        if len(roots) == 1:
            return self.pools[roots[0]].describe()
        sizes = [n for root in roots for n in self.pools[root].process_on_nodes]
        return f"merge({', '.join(roots)}) {sizes}"

    @property
    def gpus(self) -> int:
        return sum(p.world_size for p in self.pools.values() if p.use_gpu)


class GpuBudget:
    """``use_gpu: auto`` gives a deployment GPU bundles while the cluster has enough left
    for all of its auto pools, in config order; the rest run on CPU bundles."""

    def __init__(self, cluster_gpus: float) -> None:
        self.left = cluster_gpus

    def take(self, count: int) -> bool:
        if count and self.left >= count:
            self.left -= count
            return True
        return False


def plan_deployment(deployment: DeploymentConfig, service: ServiceConfig, budget: GpuBudget) -> DeploymentPlan:
    """Pools, bundles and offsets of one deployment (ValueError when merged pools
    disagree on GPUs)."""
    groups = {g.name: g for g in deployment.groups}
    own = [g for g in deployment.groups if g.pool is not None and g.pool.process_on_nodes is not None]

    def wanted(group: GroupConfig) -> Any:
        return service.use_gpu if group.pool.use_gpu is None else group.pool.use_gpu

    auto_count = sum(sum(g.pool.process_on_nodes) for g in own if wanted(g) == "auto")
    auto_gpu = budget.take(auto_count) if auto_count else False
    pools: dict[str, PoolPlan] = {}
    next_bundle = 1  # bundle 0 is the replica's own
    for group in own:
        nodes = tuple(group.pool.process_on_nodes)
        choice = wanted(group)
        single = len(nodes) == 1
        pools[group.name] = PoolPlan(
            name=group.name,
            process_on_nodes=nodes,
            use_gpu=auto_gpu if choice == "auto" else bool(choice),
            name_prefix=group.pool.name_prefix,
            max_colocate_count=group.pool.max_colocate_count,
            num_cpus_per_bundle=(
                service.worker_cpus if group.pool.num_cpus_per_bundle is None else group.pool.num_cpus_per_bundle
            ),
            first_bundle=next_bundle if single else None,
        )
        if single:
            next_bundle += nodes[0]
    group_pools = {g.name: (pool_root(g.name, groups) if g.pool is not None else ()) for g in deployment.groups}
    for name, roots in group_pools.items():
        if len({pools[root].use_gpu for root in roots}) > 1:
            raise ValueError(
                f"deployments[{deployment.name}].groups[{name}].pool.merge: cannot merge GPU and CPU pools "
                f"({', '.join(f'{r}: {pools[r].use_gpu}' for r in roots)})"
            )
    return DeploymentPlan(
        name=deployment.name,
        replica_cpus=service.replica_cpus,
        pools=pools,
        group_pools=group_pools,
        colocations=colocations(deployment),
    )


def hosted_bundles(plans: list[DeploymentPlan], ingress_cpus: float) -> tuple[list[dict[str, float]], list[int]]:
    """The ingress replica's bundles when it hosts every controller
    (``controllers_in_ingress``): its own, then each deployment's pool bundles in
    order; and per deployment the shift of its pools' ``first_bundle`` in that group."""
    bundles: list[dict[str, float]] = [{"CPU": ingress_cpus}]
    shifts = []
    for plan in plans:
        shifts.append(len(bundles) - 1)
        bundles += plan.replica_bundles()[1:]
    return bundles, shifts

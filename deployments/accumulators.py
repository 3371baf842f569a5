"""The tutorial's accumulators: the plain Accumulator actor and the GPUAccumulator groups
on pool [4], pool 'a' [4] and their merge (plus the ONE_TO_ALL decorator group).

The two groups on the merged pool are colocated: one process per bundle holds both
roles (HybridFlow's fused workers), so the merge costs 8 worker processes, not 16."""

from __future__ import annotations

from ray import serve

from deployments.group_controller import Colocation, GroupSpec, SingleActor
from deployments.served_controller import ServedController, replica_pool
from single_controller.models.tutorial_workers import Accumulator, GPUAccumulator, GPUAccumulatorDecorator
from single_controller.ray import RayClassWithInitArgs, RayWorkerGroup, merge_resource_pool
from single_controller.ray.colocated import create_colocated_worker_cls

MERGED_ROLES = {"gpu_accumulator_merge": GPUAccumulator, "gpu_accumulator_decorator": GPUAccumulatorDecorator}

#: Bundles after the replica's own: pool [4] then pool 'a' [4].
WORKER_BUNDLES = 8


@serve.deployment(name="accumulators", max_ongoing_requests=256)
class AccumulatorsDeployment(ServedController):
    def __init__(self, use_gpu: bool = False, request_timeout_s: float = 120.0) -> None:
        pool = replica_pool(first_bundle=1, process_count=4, use_gpu=use_gpu)
        pool_a = replica_pool(first_bundle=5, process_count=4, use_gpu=use_gpu, name_prefix="a")
        pool_merge = merge_resource_pool(pool, pool_a)

        def group_on(resource_pool, cls):
            return lambda: RayWorkerGroup(resource_pool, RayClassWithInitArgs(cls=cls))

        def merged_roles() -> dict[str, RayWorkerGroup]:
            fused = create_colocated_worker_cls({role: RayClassWithInitArgs(cls) for role, cls in MERGED_ROLES.items()})
            return RayWorkerGroup(pool_merge, fused).spawn(prefix_set=MERGED_ROLES)

        merged = Colocation("merge", merged_roles)
        read_only = frozenset({"get_value"})
        specs = [
            GroupSpec("accumulator", lambda: SingleActor(Accumulator, {"num_cpus": 0}), Accumulator,
                      "replica", read_only),
            GroupSpec("gpu_accumulator", group_on(pool, GPUAccumulator), GPUAccumulator, "pool [4]", read_only),
            GroupSpec("gpu_accumulator_a", group_on(pool_a, GPUAccumulator), GPUAccumulator,
                      "pool 'a' [4]", read_only),
            GroupSpec("gpu_accumulator_merge", None, GPUAccumulator, "merge(pool, pool 'a') [4, 4]", read_only,
                      colocation=merged),
            GroupSpec("gpu_accumulator_decorator", None, GPUAccumulatorDecorator, "merge(pool, pool 'a') [4, 4]",
                      read_only, colocation=merged),
        ]
        super().__init__(specs, request_timeout_s=request_timeout_s)

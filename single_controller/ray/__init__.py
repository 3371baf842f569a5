"""Ray backend: resource pools as placement groups, worker groups as actors."""

from single_controller.ray.base import (
    GroupLayout,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    ResourceUnavailableError,
    create_colocated_worker_cls,
    merge_resource_pool,
)

__all__ = [
    "GroupLayout",
    "MegatronRayWorkerGroup",
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "ResourceUnavailableError",
    "create_colocated_worker_cls",
    "merge_resource_pool",
]


def __getattr__(name: str):
    # Imported on first use: it pulls in megatron-core, which plain groups never need.
    if name == "MegatronRayWorkerGroup":
        from single_controller.ray.megatron import MegatronRayWorkerGroup

        return MegatronRayWorkerGroup
    raise AttributeError(name)

"""Ray backend: resource pools as placement groups, worker groups as actors."""

from single_controller.ray.base import (
    GroupLayout,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    ResourceUnavailableError,
    SubRayResourcePool,
    create_colocated_worker_cls,
    create_colocated_worker_cls_fused,
    create_colocated_worker_raw_cls,
    merge_resource_pool,
    split_resource_pool,
)

__all__ = [
    "GroupLayout",
    "MegatronRayWorkerGroup",
    "NVMegatronRayWorkerGroup",
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "ResourceUnavailableError",
    "SubRayResourcePool",
    "create_colocated_worker_cls",
    "create_colocated_worker_cls_fused",
    "create_colocated_worker_raw_cls",
    "merge_resource_pool",
    "split_resource_pool",
]

#: Imported on first use: they pull in megatron-core, which plain groups never need.
_MEGATRON_GROUPS = ("MegatronRayWorkerGroup", "NVMegatronRayWorkerGroup")


def __getattr__(name: str):
    if name in _MEGATRON_GROUPS:
        from single_controller.ray import megatron

        return getattr(megatron, name)
    raise AttributeError(name)

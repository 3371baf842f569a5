"""The tutorial's and verl's import path: ``from single_controller.ray.base import
RayResourcePool, RayClassWithInitArgs, RayWorkerGroup, merge_resource_pool,
split_resource_pool, SubRayResourcePool,
create_colocated_worker_cls, create_colocated_worker_cls_fused,
create_colocated_worker_raw_cls``."""

from single_controller.base.worker import Worker
from single_controller.ray.colocated import create_colocated_worker_cls
from single_controller.ray.fused import create_colocated_worker_cls_fused, create_colocated_worker_raw_cls
from single_controller.ray.resource_pool import (
    RayResourcePool,
    ResourceUnavailableError,
    SubRayResourcePool,
    merge_resource_pool,
    split_resource_pool,
)
from single_controller.ray.worker_group import GroupLayout, RayClassWithInitArgs, RayWorkerGroup

__all__ = [
    "GroupLayout",
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "ResourceUnavailableError",
    "SubRayResourcePool",
    "Worker",
    "create_colocated_worker_cls",
    "create_colocated_worker_cls_fused",
    "create_colocated_worker_raw_cls",
    "merge_resource_pool",
    "split_resource_pool",
]

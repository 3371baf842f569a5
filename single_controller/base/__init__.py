"""Backend-neutral parts of the single controller: Worker, pools, groups, dispatch."""

from single_controller.base.decorator import Dispatch, Execute, register, register_dispatch_mode
from single_controller.base.worker import Worker
from single_controller.base.worker_group import ClassWithInitArgs, ResourcePool, WorkerGroup

__all__ = [
    "ClassWithInitArgs",
    "Dispatch",
    "Execute",
    "ResourcePool",
    "Worker",
    "WorkerGroup",
    "register",
    "register_dispatch_mode",
]

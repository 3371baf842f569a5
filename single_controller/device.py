"""Device and collective-backend choice: cuda/nccl where this process may use a GPU, else cpu/gloo.

"May use" is what the scheduler gave it, not what the node has: a Ray actor placed in a
CPU pool on a GPU node still sees the node's GPUs (Ray narrows CUDA_VISIBLE_DEVICES only
for actors that asked for GPUs), and if each rank of such a group took cuda, every rank
would land on device 0 and NCCL would refuse the group ("Duplicate GPU detected").
"""

from __future__ import annotations

import os

import torch


def _ray_actor_gpu_ids() -> list | None:
    """The GPU ids Ray assigned to this actor, or None outside a Ray actor."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return None
    return ray.get_gpu_ids()


def is_cuda_available() -> bool:
    """A GPU is visible and, inside a Ray actor, Ray assigned this actor at least one."""
    if not torch.cuda.is_available():
        return False
    assigned = _ray_actor_gpu_ids()
    return assigned is None or len(assigned) > 0


def get_device_name() -> str:
    """Torch device name for tensors on this process: ``"cuda"`` when it may use a GPU, else ``"cpu"``."""
    return "cuda" if is_cuda_available() else "cpu"


def get_dist_backend() -> str:
    """torch.distributed backend matching :func:`get_device_name`: nccl on GPU, gloo on CPU."""
    return "nccl" if is_cuda_available() else "gloo"


def get_nccl_backend() -> str:
    """verl's name for :func:`get_dist_backend`: the collective backend for this
    process's device, nccl with a GPU, gloo without."""
    return get_dist_backend()


def get_torch_device() -> torch.device:
    """The device a worker should compute on; under Ray each worker sees only its own GPU(s)."""
    if not is_cuda_available():
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # Ray narrows CUDA_VISIBLE_DEVICES to the bundle's GPU, so index 0 is ours;
    # torchrun-style launches see every GPU and pick by local rank.
    index = local_rank if torch.cuda.device_count() > local_rank else 0
    return torch.device("cuda", index)

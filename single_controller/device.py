"""Device and collective-backend choice: cuda/nccl when a GPU is visible, else cpu/gloo."""

from __future__ import annotations

import os

import torch


def is_cuda_available() -> bool:
    return torch.cuda.is_available()


def get_device_name() -> str:
    """Torch device name for tensors on this process: ``"cuda"`` when present, else ``"cpu"``."""
    return "cuda" if is_cuda_available() else "cpu"


def get_dist_backend() -> str:
    """torch.distributed backend matching :func:`get_device_name`: nccl on GPU, gloo on CPU."""
    return "nccl" if is_cuda_available() else "gloo"


def get_torch_device() -> torch.device:
    """The device a worker should compute on; under Ray each worker sees only its own GPU(s)."""
    if not is_cuda_available():
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # Ray narrows CUDA_VISIBLE_DEVICES to the bundle's GPU, so index 0 is ours;
    # torchrun-style launches see every GPU and pick by local rank.
    index = local_rank if torch.cuda.device_count() > local_rank else 0
    return torch.device("cuda", index)

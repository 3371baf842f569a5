"""Helpers of the client's tests."""

from __future__ import annotations

from typing import Any

import numpy as np

from hybridflow_client.wire import tensors

TORCH = tensors.installed_torch()


def as_numpy(value: Any) -> np.ndarray:
    """A returned tensor as a numpy array (BF16 as float32), checking its kind first."""
    if TORCH is not None and isinstance(value, TORCH.Tensor):
        return (value.float() if value.dtype is TORCH.bfloat16 else value).numpy()
    assert isinstance(value, np.ndarray), type(value)
    return value


def returned_type(mode: str) -> type:
    """What tensors come back as in ``mode``."""
    return TORCH.Tensor if mode == "torch" else np.ndarray

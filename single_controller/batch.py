"""Batches of named tensors for the *_PROTO dispatch modes, carried by tensordict.

A batch is a :class:`tensordict.TensorDict` whose first batch dimension is the
sample dimension. These helpers are the only operations dispatch needs: split into
equal chunks, concatenate back, pad so a batch divides, and drop the padding.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tensordict import TensorDict, TensorDictBase

__all__ = [
    "as_batch",
    "batch_len",
    "chunk_batch",
    "concat_batches",
    "is_batch",
    "pad_batch",
    "unpad_batch",
]


def is_batch(value: Any) -> bool:
    # tensordict costs seconds to import; a value can only be a TensorDict if
    # someone already imported it, so look without importing.
    tensordict = sys.modules.get("tensordict")
    return tensordict is not None and isinstance(value, tensordict.TensorDictBase)


def as_batch(tensors: Mapping[str, torch.Tensor]) -> TensorDict:
    """Build a batch from named tensors that share their first dimension."""
    sizes = {name: t.shape[0] for name, t in tensors.items() if t.dim() > 0}
    if not sizes or len(set(sizes.values())) != 1 or len(sizes) != len(tensors):
        raise ValueError(f"a batch needs tensors that share their first dimension, got {sizes}")
    from tensordict import TensorDict

    return TensorDict(dict(tensors), batch_size=[next(iter(sizes.values()))])


def batch_len(batch: TensorDictBase) -> int:
    if not batch.batch_dims:
        raise ValueError("a batch needs at least one batch dimension")
    return int(batch.batch_size[0])


def pad_batch(batch: TensorDictBase, multiple: int) -> tuple[TensorDictBase, int]:
    """Return ``(padded, pad)`` where ``len(padded)`` is a multiple of ``multiple``.

    Padding repeats rows from the start of the batch (cyclically when the batch is
    shorter than the pad), so padded rows are real data and never NaN. The input is
    not modified.
    """
    n = batch_len(batch)
    if n == 0:
        raise ValueError("cannot split an empty batch")
    pad = (-n) % multiple
    if pad == 0:
        return batch, 0
    index = torch.arange(pad) % n
    return torch.cat([batch, batch[index]], dim=0), pad


def unpad_batch(batch: TensorDictBase, pad: int) -> TensorDictBase:
    """Drop ``pad`` trailing rows added by :func:`pad_batch`."""
    return batch if pad == 0 else batch[: batch_len(batch) - pad]


def chunk_batch(batch: TensorDictBase, chunks: int) -> list[TensorDictBase]:
    """Split into ``chunks`` equal parts along dim 0; the length must divide."""
    n = batch_len(batch)
    if chunks <= 0 or n % chunks:
        raise ValueError(f"a batch of {n} rows does not split into {chunks} equal chunks")
    size = n // chunks
    return [batch[i * size : (i + 1) * size] for i in range(chunks)]


def concat_batches(batches: Sequence[TensorDictBase]) -> TensorDictBase:
    """Concatenate batches along dim 0, in order."""
    if not batches:
        raise ValueError("nothing to concatenate")
    return torch.cat(list(batches), dim=0)

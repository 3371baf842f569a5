"""Batches for the *_PROTO dispatch modes: a :class:`~single_controller.protocol.DataProto`
or a :class:`tensordict.TensorDict`, whose first dimension is the sample dimension.

These helpers are the only operations dispatch needs, the same for both kinds: split
into equal chunks, concatenate back, pad so a batch divides, and drop the padding. Each
costs time and memory in proportion to the batch's bytes: a DataProto's columns are numpy
arrays, and a TensorDict's jagged tensors and object columns go through
:mod:`single_controller.tensordict_utils` (values and offsets, lists of values), never
through a Python object per row.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDict, TensorDictBase

#: A batch: a TensorDict or a DataProto (single_controller.protocol, which imports this
#: module; a DataProto is recognised by its class's module, see :func:`is_dataproto`).
Batch = Any

#: The keyword a padded call carries to its ranks: how many rows dispatch added.
PADDING_KEY = "_padding_size_key_x123d"

__all__ = [
    "as_batch",
    "batch_len",
    "chunk_batch",
    "compact_tensordict",
    "concat_batches",
    "is_batch",
    "is_dataproto",
    "may_pad",
    "pad_batch",
    "unpad_batch",
]


def is_dataproto(value: Any) -> bool:
    """Whether ``value`` is a DataProto (looked up without importing the protocol)."""
    protocol = sys.modules.get("single_controller.protocol")
    return protocol is not None and isinstance(value, protocol.DataProto)


def is_batch(value: Any) -> bool:
    # tensordict costs seconds to import; a value can only be a TensorDict (or a
    # DataProto) if someone already imported it, so look without importing.
    tensordict = sys.modules.get("tensordict")
    return (tensordict is not None and isinstance(value, tensordict.TensorDictBase)) or is_dataproto(value)


def may_pad(batch: Any) -> bool:
    """Whether dispatch may pad this batch: a TensorDict always; a DataProto only with
    its auto padding on (``DataProtoConfig.auto_padding`` or its own flag), as in verl."""
    return batch.is_padding_enabled() if is_dataproto(batch) else True


def as_batch(tensors: Mapping[str, torch.Tensor]) -> TensorDict:
    """Build a batch from named tensors that share their first dimension."""
    sizes = {name: t.shape[0] for name, t in tensors.items() if t.dim() > 0}
    if not sizes or len(set(sizes.values())) != 1 or len(sizes) != len(tensors):
        raise ValueError(f"a batch needs tensors that share their first dimension, got {sizes}")
    from tensordict import TensorDict

    return TensorDict(dict(tensors), batch_size=[next(iter(sizes.values()))])


def batch_len(batch: Batch) -> int:
    if is_dataproto(batch):
        return len(batch)
    if not batch.batch_dims:
        raise ValueError("a batch needs at least one batch dimension")
    return int(batch.batch_size[0])


def pad_batch(batch: Batch, multiple: int) -> tuple[Batch, int]:
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
    import torch  # a batch to pad means torch is loaded already

    index = torch.arange(pad) % n
    if not is_dataproto(batch) and _has_row_entries(batch):
        from single_controller.tensordict_utils import index_select_tensor_dict

        return concat_batches([batch, index_select_tensor_dict(batch, index)]), pad
    return concat_batches([batch, batch[index]]), pad


def unpad_batch(batch: Batch, pad: int) -> Batch:
    """Drop ``pad`` trailing rows added by :func:`pad_batch`."""
    if pad == 0:
        return batch
    if not is_dataproto(batch) and _has_row_entries(batch):
        from single_controller.tensordict_utils import unpad

        return unpad(batch, pad)
    return batch[: batch_len(batch) - pad]


def _owns_its_storage(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() <= tensor.numel() * tensor.element_size()


def compact_tensordict(batch: TensorDictBase) -> TensorDictBase:
    """``batch`` with every tensor that views part of a larger storage copied into one
    of its own. Torch pickles a view with its whole storage, so a slice of a large batch
    sent to a rank would carry every row; compacted, it carries only its own. Jagged
    tensors and object columns are kept as they are (the helpers that split them give
    parts of their own), and never walked row by row."""
    from tensordict import TensorDict

    if type(batch) is not TensorDict:  # another kind of TensorDict: its own walk
        if all(_owns_its_storage(t) for t in batch.values(include_nested=True, leaves_only=True)):
            return batch
        return batch.apply(lambda t: t if _owns_its_storage(t) else t.clone())
    entries = {key: batch.get(key) for key in batch.keys()}
    compacted = {key: _compact(value) for key, value in entries.items()}
    if all(compacted[key] is value for key, value in entries.items()):
        return batch
    return TensorDict(compacted, batch_size=batch.batch_size, device=batch.device, names=batch.names)


def _compact(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value if value.is_nested or _owns_its_storage(value) else value.clone()
    if getattr(value, "_is_non_tensor", False):  # NonTensorData, object columns: no storage
        return value
    return compact_tensordict(value)


def chunk_batch(batch: Batch, chunks: int) -> list[Batch]:
    """Split into ``chunks`` equal parts along dim 0 (the length must divide), each
    holding only its own rows when pickled (a DataProto compacts itself when pickled)."""
    n = batch_len(batch)
    if chunks <= 0 or n % chunks:
        raise ValueError(f"a batch of {n} rows does not split into {chunks} equal chunks")
    size = n // chunks
    if not is_dataproto(batch) and _has_row_entries(batch):
        from single_controller.tensordict_utils import chunk_tensordict

        # torch cannot chunk jagged tensors of 3 or more dims, and tensordict would make
        # an object column's members (a tensorclass per row): both split here instead.
        return [compact_tensordict(piece) for piece in chunk_tensordict(batch, chunks)]
    pieces = [batch[i * size : (i + 1) * size] for i in range(chunks)]
    return pieces if is_dataproto(batch) else [compact_tensordict(piece) for piece in pieces]


def _has_row_entries(batch: TensorDictBase) -> bool:
    """Whether a TensorDict holds jagged tensors or object columns (at its top level)."""
    from tensordict import NonTensorStack

    from single_controller.jagged import is_jagged

    return any(is_jagged(value) or isinstance(value, NonTensorStack) for value in map(batch.get, batch.keys()))


def concat_batches(batches: Sequence[Batch]) -> Batch:
    """Concatenate batches along dim 0, in order (DataProtos keep the first one's meta_info)."""
    if not batches:
        raise ValueError("nothing to concatenate")
    if is_dataproto(batches[0]):
        return type(batches[0]).concat(list(batches))
    if _has_row_entries(batches[0]):
        from single_controller.tensordict_utils import concat_tensordict

        return concat_tensordict(list(batches))
    import torch  # batches to concatenate mean torch is loaded already

    return torch.cat(list(batches), dim=0)

"""TensorDict as a batch type of its own (verl's ``verl.utils.tensordict_utils`` names).

A batch TensorDict has one batch dimension, the rows. Per row it may hold tensors,
jagged nested tensors (``torch.nested`` with ``layout=torch.jagged``: rows of different
lengths, e.g. token ids) and Python objects (a ``NonTensorStack``, one item per row);
for the whole batch, metadata (``NonTensorData``). Build one with :func:`get_tensordict`.

Splitting, concatenating and selecting rows go through jagged tensors' rows (``unbind``)
where torch cannot do it on the nested tensor itself (three or more dimensions), so
every helper here takes every kind of entry. Bad input raises ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

__all__ = [
    "assign_non_tensor",
    "chunk_tensordict",
    "concat_nested_tensors",
    "concat_tensordict",
    "contiguous",
    "get",
    "get_non_tensor_data",
    "get_tensordict",
    "index_select_tensor_dict",
    "is_jagged",
    "jagged_from_parts",
    "jagged_parts",
    "object_column",
    "pad_to_divisor",
    "pop",
    "unpad",
]


def is_jagged(value: Any) -> bool:
    """Whether ``value`` is a nested tensor (rows of different lengths)."""
    return isinstance(value, torch.Tensor) and value.is_nested


def _rows(value: Any) -> int:
    return value.size(0) if isinstance(value, torch.Tensor) else len(value)


def object_column(items: Sequence[Any]) -> NonTensorStack:
    """A per-row column of Python objects (strings, lists, dicts, ...), one per row."""
    return NonTensorStack.from_list([NonTensorData(item) for item in items])


def get_tensordict(tensor_dict: Mapping[str, Any], non_tensor_dict: Mapping[str, Any] | None = None) -> TensorDict:
    """A batch from per-row entries and whole-batch metadata.

    ``tensor_dict``: tensors (jagged nested ones too: contiguous, ``layout=torch.jagged``),
    lists of Python objects (one per row; stored as a ``NonTensorStack``) and
    ``NonTensorStack``s, all with the same number of rows. ``non_tensor_dict``: values
    about the whole batch (stored as ``NonTensorData``). With no per-row entry the batch
    has no batch dimension. ``ValueError`` naming the entry that does not fit.
    """
    if not isinstance(tensor_dict, Mapping):
        raise ValueError(f"tensor_dict is a mapping of names to tensors or lists, got {type(tensor_dict).__name__}")
    source: dict[str, Any] = {}
    rows: dict[str, int] = {}
    for key, value in tensor_dict.items():
        if is_jagged(value):
            if value.layout != torch.jagged or not value.is_contiguous():
                raise ValueError(f"{key!r}: a nested tensor must be contiguous with layout=torch.jagged")
            source[key] = value
        elif isinstance(value, torch.Tensor):
            if value.dim() == 0:
                raise ValueError(f"{key!r}: a per-row tensor needs a first (row) dimension, got a scalar")
            source[key] = value
        elif isinstance(value, NonTensorStack):
            source[key] = value
        elif isinstance(value, list):
            if any(isinstance(item, torch.Tensor) for item in value):
                raise ValueError(f"{key!r}: a list is a column of Python objects; give tensors as one tensor")
            source[key] = object_column(value)
        else:
            raise ValueError(f"{key!r}: expected a tensor, a list or a NonTensorStack, got {type(value).__name__}")
        rows[key] = _rows(value)
    if len(set(rows.values())) > 1:
        raise ValueError(f"every per-row entry needs the same number of rows, got {rows}")
    for key, value in (non_tensor_dict or {}).items():
        if key in source:
            raise ValueError(f"{key!r} is both a per-row entry and batch metadata")
        source[key] = value if isinstance(value, NonTensorData) else NonTensorData(value)
    batch_size = [next(iter(rows.values()))] if rows else []
    return TensorDict(source, batch_size=batch_size)


def concat_nested_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One jagged tensor holding the rows of ``tensors`` (jagged tensors of two or more
    dimensions), in order."""
    if not tensors:
        raise ValueError("nothing to concatenate")
    rows: list[torch.Tensor] = []
    for i, tensor in enumerate(tensors):
        if not is_jagged(tensor):
            raise ValueError(f"tensor {i} is not a nested tensor")
        if tensor.dim() < 2:
            raise ValueError(f"tensor {i}: a nested tensor has two or more dimensions, got shape {tuple(tensor.shape)}")
        rows.extend(tensor.unbind(0))
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def jagged_parts(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A jagged tensor as plain tensors, e.g. to send over a wire: ``(values, offsets,
    ragged_dim)``. ``values`` holds every row's elements, the rows joined along dimension
    ``ragged_dim - 1`` of a row; ``offsets`` (int64, one more than the rows) is where each
    row starts in it. :func:`jagged_from_parts` reverses it."""
    if not is_jagged(tensor) or tensor.layout != torch.jagged:
        raise ValueError("jagged_parts takes a nested tensor with layout=torch.jagged")
    if tensor.lengths() is not None:  # rows with gaps between them: pack them first
        tensor = torch.nested.as_nested_tensor(list(tensor.unbind(0)), layout=torch.jagged)
    return tensor.values(), tensor.offsets().to(torch.int64), int(tensor._ragged_idx)


def jagged_from_parts(values: torch.Tensor, offsets: torch.Tensor, ragged_dim: int = 1) -> torch.Tensor:
    """The jagged tensor :func:`jagged_parts` took apart, as a view of ``values`` (no copy
    of the elements; work in proportion to the rows). ``ValueError`` unless the offsets
    are one-dimensional integers that start at 0, never decrease and end at the length
    of ``values`` along the ragged dimension."""
    if isinstance(ragged_dim, bool) or not isinstance(ragged_dim, int) or not 1 <= ragged_dim <= values.dim():
        raise ValueError(f"ragged_dim must be between 1 and {values.dim()} for values of shape {tuple(values.shape)}")
    if offsets.dim() != 1 or offsets.numel() < 2 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offsets must be a 1-D integer tensor of rows + 1 entries, got {offsets.dtype} "
                         f"of shape {tuple(offsets.shape)}")
    offsets = offsets.to(torch.int64)
    total = values.shape[ragged_dim - 1]
    if offsets[0] != 0 or offsets[-1] != total or bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError(f"offsets must start at 0, never decrease and end at {total} (the values' ragged length)")
    return torch.nested.nested_tensor_from_jagged(values, offsets, jagged_dim=ragged_dim)


def _split_jagged(tensor: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    rows = tensor.unbind(0)
    parts, start = [], 0
    for size in sizes:
        parts.append(torch.nested.as_nested_tensor(list(rows[start : start + size]), layout=torch.jagged))
        start += size
    return parts


def _without(data: TensorDict, keys: Iterable[str]) -> TensorDict:
    skip = set(keys)
    return TensorDict(
        {key: data.get(key) for key in data.keys() if key not in skip}, batch_size=data.batch_size, device=data.device
    )


def _jagged_keys(data: TensorDict) -> list[str]:
    return [key for key in data.keys() if is_jagged(data.get(key))]


def chunk_tensordict(data: TensorDict, chunks: int) -> list[TensorDict]:
    """``chunks`` batches of equal length, in order (the length must divide)."""
    if not isinstance(data, TensorDict) or not data.batch_dims:
        raise ValueError("chunk_tensordict takes a TensorDict with a batch dimension")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks <= 0 or len(data) % chunks:
        raise ValueError(f"a batch of {len(data)} rows does not split into {chunks!r} equal chunks")
    size = len(data) // chunks
    jagged = _jagged_keys(data)
    parts = list(_without(data, jagged).split(size, dim=0))
    for key in jagged:
        for part, piece in zip(parts, _split_jagged(data.get(key), [size] * chunks), strict=True):
            part[key] = piece
    return parts


def concat_tensordict(data: Sequence[TensorDict]) -> TensorDict:
    """The batches' rows in order, in one batch. Batches without a batch dimension
    (metadata only) are the same batch: the first is answered."""
    if not data:
        raise ValueError("nothing to concatenate")
    if not data[0].batch_dims:
        return data[0]
    jagged = _jagged_keys(data[0])
    for i, part in enumerate(data):
        if sorted(_jagged_keys(part)) != sorted(jagged):
            raise ValueError(f"batch {i} has nested tensors {_jagged_keys(part)}, batch 0 has {jagged}")
    out = torch.cat([_without(part, jagged) for part in data], dim=0)
    for key in jagged:
        out[key] = concat_nested_tensors([part.get(key) for part in data])
    return out


def index_select_tensor_dict(data: TensorDict, indices: torch.Tensor | Sequence[int]) -> TensorDict:
    """A new batch of the rows ``indices`` names, in that order; metadata kept."""
    index = torch.as_tensor(indices, dtype=torch.long)
    if index.dim() != 1:
        raise ValueError(f"indices must be one-dimensional, got shape {tuple(index.shape)}")
    out: dict[str, Any] = {}
    for key in data.keys():
        value = data.get(key)
        if is_jagged(value):
            rows = value.unbind(0)
            out[key] = torch.nested.as_nested_tensor([rows[i] for i in index.tolist()], layout=torch.jagged)
        elif isinstance(value, NonTensorData):
            out[key] = NonTensorData(value.data)
        else:
            out[key] = value[index]
    return TensorDict(out, batch_size=[len(index)])


def contiguous(data: TensorDict) -> TensorDict:
    """A new batch whose tensors are contiguous (a received part may be a view), so it
    can be changed in place; Python-object columns and metadata kept as they are."""
    per_row: dict[str, Any] = {}
    metadata: dict[str, Any] = {}
    for key in data.keys():
        value = data.get(key)
        if isinstance(value, NonTensorData):
            metadata[key] = value
        elif isinstance(value, NonTensorStack):
            per_row[key] = value
        elif isinstance(value, torch.Tensor):
            per_row[key] = value.contiguous()
        else:
            raise ValueError(f"{key!r}: contiguous takes tensors and non-tensor data, got {type(value).__name__}")
    return get_tensordict(per_row, metadata)


def pad_to_divisor(data: TensorDict, size_divisor: int) -> tuple[TensorDict, int]:
    """``(padded, pad)``: rows repeated from the start until the length divides by
    ``size_divisor``; ``pad`` rows were added."""
    if isinstance(size_divisor, bool) or not isinstance(size_divisor, int) or size_divisor <= 0:
        raise ValueError(f"size_divisor is a positive integer, got {size_divisor!r}")
    n = len(data)
    pad = (-n) % size_divisor
    if pad == 0:
        return data, 0
    if n == 0:
        raise ValueError("cannot pad an empty batch")
    return concat_tensordict([data, index_select_tensor_dict(data, torch.arange(pad) % n)]), pad


def unpad(data: TensorDict, pad_size: int) -> TensorDict:
    """The batch without its last ``pad_size`` rows (what :func:`pad_to_divisor` added)."""
    if pad_size == 0:
        return data
    if pad_size < 0 or pad_size > len(data):
        raise ValueError(f"cannot drop {pad_size} rows of a batch of {len(data)}")
    return index_select_tensor_dict(data, torch.arange(len(data) - pad_size))


def _plain(value: Any) -> Any:
    if isinstance(value, NonTensorStack):
        return value.tolist()
    if isinstance(value, NonTensorData):
        return value.data
    return value


def get(data: TensorDict, key: str, default: Any = None) -> Any:
    """The entry as Python sees it: a tensor, a list for an object column, the value of
    metadata; ``default`` when absent."""
    return _plain(data.get(key)) if key in data.keys() else default


def get_non_tensor_data(data: TensorDict, key: str, default: Any) -> Any:
    """Metadata ``key``'s value (``default`` when absent)."""
    return get(data, key, default)


def pop(data: TensorDict, key: str, default: Any = None) -> Any:
    """:func:`get`, removing the entry."""
    return _plain(data.pop(key)) if key in data.keys() else default


def assign_non_tensor(data: TensorDict, **entries: Any) -> TensorDict:
    """Set Python values on a batch: a list as an object column (one item per row), any
    other value as metadata. Returns the batch."""
    for key, value in entries.items():
        if isinstance(value, (NonTensorData, NonTensorStack)):
            data[key] = value
        elif isinstance(value, list):
            data[key] = object_column(value)
        else:
            data[key] = NonTensorData(value)
    return data

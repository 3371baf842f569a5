"""TensorDict as a batch type of its own (verl's ``verl.utils.tensordict_utils`` names).

A batch TensorDict has one batch dimension, the rows. Per row it may hold tensors,
jagged nested tensors (``torch.nested`` with ``layout=torch.jagged``: rows of different
lengths, e.g. token ids) and Python objects (a ``NonTensorStack``, one item per row);
for the whole batch, metadata (``NonTensorData``). Build one with :func:`get_tensordict`.

Splitting, concatenating and selecting rows take every kind of entry, each at a cost in
proportion to its bytes: jagged tensors through their values and offsets
(:mod:`single_controller.jagged`), object columns through their list of values
(:mod:`single_controller.object_column`: an object column is built as an
:class:`ObjectColumn`, which makes no tensorclass per row until one is asked for), the
other tensors with torch. Bad input raises ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from single_controller.jagged import (
    concat_jagged,
    is_jagged,
    jagged_from_parts,
    jagged_parts,
    select_jagged,
    slice_jagged,
    split_jagged,
)
from single_controller.object_column import (
    ObjectColumn,
    concat_columns,
    select_column,
    slice_column,
)

__all__ = [
    "ObjectColumn",
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
    "slice_rows",
    "unpad",
]


def _rows(value: Any) -> int:
    return value.size(0) if isinstance(value, torch.Tensor) else len(value)


def object_column(items: Sequence[Any]) -> ObjectColumn:
    """A per-row column of Python objects (strings, lists, dicts, ...), one per row: a
    ``NonTensorStack`` that keeps them in a list until its members are asked for."""
    return ObjectColumn.of(items)


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
    return concat_jagged(tensors)


def _without(data: TensorDict, keys: Iterable[str]) -> TensorDict:
    skip = set(keys)
    return TensorDict(
        {key: data.get(key) for key in data.keys() if key not in skip}, batch_size=data.batch_size, device=data.device
    )


def _is_column(value: Any) -> bool:
    return isinstance(value, NonTensorStack) and value.batch_dims == 1


def _row_keys(data: TensorDict) -> list[str]:
    """The entries moved by the helpers here rather than by torch: jagged tensors and
    object columns."""
    return [key for key in data.keys() if is_jagged(data.get(key)) or _is_column(data.get(key))]


def _kinds(data: TensorDict) -> dict[str, str]:
    return {key: "jagged" if is_jagged(data.get(key)) else "objects" for key in _row_keys(data)}


def _require_batch(data: Any, what: str) -> None:
    if not isinstance(data, TensorDict) or not data.batch_dims:
        raise ValueError(f"{what} takes a TensorDict with a batch dimension")


def slice_rows(data: TensorDict, start: int, stop: int) -> TensorDict:
    """Rows ``[start, stop)`` (a non-empty part) as a batch, its tensors views of the
    batch's where they can be (as slicing a TensorDict gives); metadata kept."""
    _require_batch(data, "slice_rows")
    if not 0 <= start < stop <= len(data):
        raise ValueError(f"rows [{start}, {stop}) are not a non-empty part of a batch of {len(data)}")
    moved = _row_keys(data)
    out = _without(data, moved)[start:stop]
    for key in moved:
        value = data.get(key)
        out[key] = slice_jagged(value, start, stop, copy=False) if is_jagged(value) else slice_column(value, start, stop)
    return out


def chunk_tensordict(data: TensorDict, chunks: int) -> list[TensorDict]:
    """``chunks`` batches of equal length, in order (the length must divide)."""
    _require_batch(data, "chunk_tensordict")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks <= 0 or len(data) % chunks:
        raise ValueError(f"a batch of {len(data)} rows does not split into {chunks!r} equal chunks")
    size = len(data) // chunks
    moved = _row_keys(data)
    parts = list(_without(data, moved).split(size, dim=0))
    for key in moved:
        value = data.get(key)
        if is_jagged(value):
            pieces = split_jagged(value, [size] * chunks)
        else:
            pieces = [slice_column(value, i * size, (i + 1) * size) for i in range(chunks)]
        for part, piece in zip(parts, pieces, strict=True):
            part[key] = piece
    return parts


def concat_tensordict(data: Sequence[TensorDict]) -> TensorDict:
    """The batches' rows in order, in one batch. Batches without a batch dimension
    (metadata only) are the same batch: the first is answered."""
    if not data:
        raise ValueError("nothing to concatenate")
    if not data[0].batch_dims:
        return data[0]
    kinds = _kinds(data[0])
    for i, part in enumerate(data):
        if _kinds(part) != kinds:
            raise ValueError(f"batch {i} has jagged and object entries {_kinds(part)}, batch 0 has {kinds}")
    out = torch.cat([_without(part, kinds) for part in data], dim=0)
    for key, kind in kinds.items():
        pieces = [part.get(key) for part in data]
        out[key] = concat_jagged(pieces) if kind == "jagged" else concat_columns(pieces)
    return out


def index_select_tensor_dict(data: TensorDict, indices: torch.Tensor | Sequence[int]) -> TensorDict:
    """A new batch of the rows ``indices`` names, in that order; metadata kept."""
    index = torch.as_tensor(indices, dtype=torch.long)
    if index.dim() != 1:
        raise ValueError(f"indices must be one-dimensional, got shape {tuple(index.shape)}")
    rows = len(data) if data.batch_dims else 0
    if index.numel() and bool(((index < -rows) | (index >= rows)).any()):
        raise ValueError(f"indices name rows outside a batch of {rows}")
    index = torch.where(index < 0, index + rows, index)
    out: dict[str, Any] = {}
    for key in data.keys():
        value = data.get(key)
        if is_jagged(value):
            out[key] = select_jagged(value, index)
        elif _is_column(value):
            out[key] = select_column(value, index)
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
    if pad_size == len(data):
        return index_select_tensor_dict(data, torch.arange(0))
    return slice_rows(data, 0, len(data) - pad_size)


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

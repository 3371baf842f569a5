"""Free functions on DataProto's parts that verl exposes from ``verl.protocol``: union of
tensor dicts, numpy dicts and meta dicts, padding to a divisor, folding the batch
dimension, an all-gather across a process group, and the conversion to and from a batch
TensorDict.

They build results with ``type(data)``, so they never import the DataProto class, and
they raise :class:`DataProtoError` on bad input.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

if TYPE_CHECKING:
    from tensordict import TensorDictBase

#: A DataProto (these functions only use its parts, so single_controller.protocol, which
#: imports this module, is not imported here).
DataProtoT = TypeVar("DataProtoT")

__all__ = [
    "DataProtoError",
    "all_gather_data_proto",
    "dataproto_parts_from_tensordict",
    "dataproto_to_tensordict",
    "fold_batch_dim",
    "list_of_dict_to_dict_of_list",
    "pad_dataproto_to_divisor",
    "union_numpy_dict",
    "union_tensor_dict",
    "union_two_dict",
    "unfold_batch_dim",
    "unpad_dataproto",
]


class DataProtoError(ValueError, AssertionError):
    """A DataProto operation got input it cannot use (the message names it).

    A ``ValueError``; also an ``AssertionError``, because verl checks these cases with
    ``assert`` and code written for verl catches that."""


def _same_value(x: Any, y: Any) -> bool:
    if isinstance(x, (float, np.floating)) and isinstance(y, (float, np.floating)) and math.isnan(x) and math.isnan(y):
        return True
    try:
        return bool(np.all(x == y))
    except Exception:  # values that cannot be compared are not the same
        return False


def arrays_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Same shape and the same items, NaN equal to NaN, object arrays item by item."""
    if a.shape != b.shape:
        return False
    if a.dtype.kind in "fc" and b.dtype.kind in "fc":
        return bool(np.array_equal(a, b, equal_nan=True))
    return all(_same_value(x, y) for x, y in zip(a.ravel(), b.ravel(), strict=True))


def union_tensor_dict(tensor_dict1: TensorDictBase, tensor_dict2: TensorDictBase) -> TensorDictBase:
    """Add ``tensor_dict2``'s keys to ``tensor_dict1`` (in place) and return it. Both need
    the same batch size, and a key in both must hold equal tensors."""
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise DataProtoError(
            f"union needs one batch size, got {tuple(tensor_dict1.batch_size)} and {tuple(tensor_dict2.batch_size)}"
        )
    for key in tensor_dict2.keys():
        if key not in tensor_dict1.keys():
            tensor_dict1[key] = tensor_dict2[key]
        elif not torch.equal(tensor_dict1[key], tensor_dict2[key]):
            raise DataProtoError(f"union: {key!r} holds different tensors in the two batches")
    return tensor_dict1


def union_numpy_dict(dict1: dict[str, np.ndarray], dict2: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Add ``dict2``'s arrays to ``dict1`` (in place) and return it; a key in both must
    hold equal arrays (NaN equals NaN, object arrays compared item by item)."""
    for key, value in dict2.items():
        if key in dict1:
            if not isinstance(value, np.ndarray) or not isinstance(dict1[key], np.ndarray):
                raise DataProtoError(f"union: {key!r} must be a numpy array on both sides")
            if not arrays_equal(dict1[key], value):
                raise DataProtoError(f"union: {key!r} holds different arrays in the two batches")
        dict1[key] = value
    return dict1


def union_two_dict(dict1: dict, dict2: Mapping) -> dict:
    """Add ``dict2``'s items to ``dict1`` (in place) and return it; a key in both must
    hold equal values."""
    for key, value in dict2.items():
        if key in dict1 and not _same_value(dict1[key], value):
            raise DataProtoError(f"union: meta_info {key!r} differs: {dict1[key]!r} and {value!r}")
        dict1[key] = value
    return dict1


def list_of_dict_to_dict_of_list(list_of_dict: list[dict]) -> dict[str, list]:
    """``[{'a': 1}, {'a': 2}]`` to ``{'a': [1, 2]}``; every dict needs the first one's keys."""
    if not list_of_dict:
        return {}
    keys = list(list_of_dict[0])
    out: dict[str, list] = {key: [] for key in keys}
    for index, item in enumerate(list_of_dict):
        if set(item) != set(keys):
            raise DataProtoError(f"item {index} has keys {sorted(item)}, the first has {sorted(keys)}")
        for key in keys:
            out[key].append(item[key])
    return out


def pad_dataproto_to_divisor(data: DataProtoT, size_divisor: int) -> tuple[DataProtoT, int]:
    """``(padded, pad_size)``: ``data`` followed by its own rows from the start (cyclically)
    until its length divides by ``size_divisor``. ``data`` itself is not changed."""
    if not isinstance(size_divisor, int) or size_divisor <= 0:
        raise DataProtoError(f"size_divisor must be a positive integer, got {size_divisor!r}")
    n = len(data)
    pad_size = (-n) % size_divisor
    if pad_size == 0 or n == 0:
        return data, 0
    extra = data[torch.arange(pad_size) % n]
    return type(data).concat([data, extra]), pad_size


def unpad_dataproto(data: DataProtoT, pad_size: int) -> DataProtoT:
    """``data`` without its last ``pad_size`` rows."""
    if pad_size < 0 or pad_size > len(data):
        raise DataProtoError(f"cannot drop {pad_size} rows from a DataProto of {len(data)}")
    return data[: len(data) - pad_size] if pad_size else data


def _batch_of(tensors: dict[str, torch.Tensor], rows: int, like: TensorDictBase) -> TensorDictBase:
    from tensordict import TensorDict

    return TensorDict(tensors, batch_size=[rows], device=like.device)


def fold_batch_dim(data: DataProtoT, new_batch_size: int) -> DataProtoT:
    """Rows ``[bsz, ...]`` to ``[new_batch_size, bsz // new_batch_size, ...]`` (tensors and
    non-tensor arrays alike); ``new_batch_size`` must divide the length."""
    n = len(data)
    if new_batch_size <= 0 or n % new_batch_size:
        raise DataProtoError(f"cannot fold {n} rows into a batch of {new_batch_size}")
    batch = None
    if data.batch is not None:
        folded = {k: v.reshape(new_batch_size, -1, *v.shape[1:]) for k, v in data.batch.items()}
        batch = _batch_of(folded, new_batch_size, data.batch)
    non_tensor = {k: v.reshape(new_batch_size, -1, *v.shape[1:]) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=data.meta_info)


def unfold_batch_dim(data: DataProtoT, batch_dims: int = 2) -> DataProtoT:
    """Merge the first ``batch_dims`` dimensions back into one batch dimension (the
    inverse of :func:`fold_batch_dim`)."""
    if batch_dims < 1:
        raise DataProtoError(f"batch_dims must be at least 1, got {batch_dims}")

    def merged(value: Any) -> Any:
        if value.ndim < batch_dims:
            raise DataProtoError(f"cannot unfold {batch_dims} dims of a value with shape {tuple(value.shape)}")
        return value.reshape(-1, *value.shape[batch_dims:])

    batch = None
    if data.batch is not None:
        tensors = {k: merged(v) for k, v in data.batch.items()}
        rows = next(iter(tensors.values())).shape[0] if tensors else 0
        batch = _batch_of(tensors, rows, data.batch)
    non_tensor = {k: merged(v) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=data.meta_info)


def all_gather_data_proto(data: DataProtoT, process_group: Any = None) -> None:
    """Replace ``data``'s rows by every rank's rows, in rank order (in place, like
    ``torch.distributed.all_gather``). Every rank must hold the same number of rows and
    the same keys; tensors travel on the process group's device (cuda for nccl)."""
    import torch.distributed as dist

    size = dist.get_world_size(group=process_group)
    if data.batch is not None:
        on_cuda = dist.get_backend(process_group) == "nccl"
        gathered = {}
        for key, tensor in data.batch.items():
            local = tensor.contiguous().to(torch.cuda.current_device()) if on_cuda else tensor.contiguous()
            parts = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(parts, local, group=process_group)
            gathered[key] = torch.cat(parts, dim=0).to(tensor.device)
        data.batch = _batch_of(gathered, len(data) * size, data.batch)
    others: list[Any] = [None] * size
    dist.all_gather_object(others, data.non_tensor_batch, group=process_group)
    data.non_tensor_batch = {key: np.concatenate([o[key] for o in others]) for key in data.non_tensor_batch}


def dataproto_to_tensordict(data: Any) -> TensorDictBase:
    """One batch TensorDict (see :mod:`single_controller.tensordict_utils`) holding a
    DataProto: its tensors, its non-tensor columns as object columns (one Python object
    per row) and its meta_info as metadata. A name used twice is a :class:`DataProtoError`."""
    from single_controller.tensordict_utils import get_tensordict, object_column

    per_row: dict[str, Any] = dict(data.batch.items()) if data.batch is not None else {}
    for key, column in data.non_tensor_batch.items():
        if key in per_row:
            raise DataProtoError(f"{key!r} is both a tensor and a non-tensor column")
        per_row[key] = object_column(list(column))
    clash = sorted(set(per_row) & set(data.meta_info))
    if clash:
        raise DataProtoError(f"meta_info keys {clash} are also column names")
    try:
        return get_tensordict(per_row, data.meta_info)
    except ValueError as exc:
        raise DataProtoError(f"cannot hold this DataProto in a TensorDict: {exc}") from None


def dataproto_parts_from_tensordict(
    tensor_dict: TensorDictBase, meta_info: Mapping[str, Any] | None = None
) -> tuple[TensorDictBase | None, dict[str, np.ndarray], dict[str, Any]]:
    """``(batch, non_tensor_batch, meta_info)`` of the DataProto a batch TensorDict holds
    (what :func:`dataproto_to_tensordict` made): tensors to ``batch``, object columns to
    ``dtype=object`` arrays, metadata to ``meta_info`` (after the given ``meta_info``)."""
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    tensors: dict[str, torch.Tensor] = {}
    columns: dict[str, np.ndarray] = {}
    meta = dict(meta_info or {})
    for key in tensor_dict.keys():
        value = tensor_dict.get(key)
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, NonTensorStack):
            items = value.tolist()
            column = np.empty(len(items), dtype=object)
            for row, item in enumerate(items):  # one object per row, lists included
                column[row] = item
            columns[key] = column
        elif isinstance(value, NonTensorData):
            meta[key] = value.data
        else:
            raise DataProtoError(f"{key!r}: a DataProto holds tensors and non-tensor data, got {type(value).__name__}")
    batch = TensorDict(tensors, batch_size=tensor_dict.batch_size) if tensors else None
    return batch, columns, meta

"""TensorDict batches (verl v0.7's batch type) in the client, where torch and tensordict
are installed (``pip install 'hybridflow-client[tensordict]'``): sent as arguments, read
back from answers. Nothing here imports either until a TensorDict is at hand.

On the wire a TensorDict is one JSON document and its tensors::

    {"batch_size": [4],
     "tensors": {"scores": <tensor>,
                 "input_ids": {"values": <tensor>, "offsets": <tensor>, "ragged_dim": 1}},
     "objects": {"turns": [[], ["hi"], [], ["a", "b"]]},     # per row: one JSON value a row
     "metadata": {"temperature": 0.7}}                       # the whole batch

A jagged (nested) tensor is its rows' elements joined (``values``), where each row starts
(``offsets``, rows + 1 of them) and its ragged dimension. In JSON each ``<tensor>`` is a
tensor object and the batch is ``{"__tensordict__": <document>}``; in safetensors the
metadata entry under the batch's path is ``{"__tensordict__": <document>}`` with each
``<tensor>`` the name of a tensor ``<path>@<name>`` of the body.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from hybridflow_client.dataproto import plain_json
from hybridflow_client.tensors import CodecError, WireTensor, to_wire

__all__ = [
    "TENSORDICT_MARKER",
    "build_tensordict",
    "is_tensordict",
    "map_tensor_leaves",
    "tensordict_document",
    "tensordict_from_members",
]

#: The key that marks a TensorDict in a JSON body and in a safetensors metadata document.
TENSORDICT_MARKER = "__tensordict__"
_JAGGED = frozenset({"values", "offsets", "ragged_dim"})
_KEYS = frozenset({"batch_size", "tensors", "objects", "metadata"})


def is_tensordict(value: Any) -> bool:
    """True for a TensorDict (any ``TensorDictBase`` but a column of Python objects); a
    value cannot be one before ``tensordict`` is imported."""
    module = sys.modules.get("tensordict")
    if module is None or not isinstance(value, module.TensorDictBase):
        return False
    return not isinstance(value, module.NonTensorStack)


def map_tensor_leaves(entries: Mapping[str, Any], fn: Callable[[Any], Any]) -> dict[str, Any]:
    """A document's ``tensors`` with every ``<tensor>`` replaced by ``fn(<tensor>)``."""
    out: dict[str, Any] = {}
    for key, entry in entries.items():
        if isinstance(entry, Mapping) and _JAGGED & set(entry):
            out[key] = {"values": fn(entry.get("values")), "offsets": fn(entry.get("offsets")),
                        "ragged_dim": entry.get("ragged_dim")}
        else:
            out[key] = fn(entry)
    return out


def tensordict_document(data: Any, where: str) -> tuple[dict[str, Any], dict[str, WireTensor]]:
    """A TensorDict as its document (each ``<tensor>`` a name) and its tensors by name."""
    import torch
    from tensordict import NonTensorData, NonTensorStack

    if data.batch_dims > 1:
        raise CodecError(f"{where}: a TensorDict travels with one batch dimension at most")
    entries: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    metadata: dict[str, Any] = {}
    parts: list[tuple[str, Any]] = []
    for key in data.keys():
        value, label = data.get(key), f"{where}.{key}"
        if not isinstance(key, str):
            raise CodecError(f"{where}: only string keys travel, got {key!r:.40}")
        if isinstance(value, NonTensorStack):
            objects[key] = plain_json(value.tolist(), label)
        elif isinstance(value, NonTensorData):
            metadata[key] = plain_json(value.data, label)
        elif isinstance(value, torch.Tensor) and value.is_nested:
            if value.layout != torch.jagged:
                raise CodecError(f"{label}: a nested tensor travels with layout=torch.jagged")
            if value.lengths() is not None:  # rows with gaps between them: packed first
                value = torch.nested.as_nested_tensor(list(value.unbind(0)), layout=torch.jagged)
            entries[key] = {"values": len(parts), "offsets": len(parts) + 1, "ragged_dim": int(value._ragged_idx)}
            parts += [(f"{key}.values", value.values()), (f"{key}.offsets", value.offsets().to(torch.int64))]
        elif isinstance(value, torch.Tensor):
            entries[key] = len(parts)
            parts.append((key, value))
        else:
            raise CodecError(f"{label} is a {type(value).__name__}; a TensorDict travels with tensors, jagged "
                             "tensors, columns of Python objects and metadata (no nested TensorDicts)")
    names = [name for name, _ in parts]
    if len(set(names)) != len(names):
        names = [str(i) for i in range(len(parts))]
    document = {
        "batch_size": list(data.batch_size),
        "tensors": map_tensor_leaves(entries, lambda index: names[index]),
        "objects": objects,
        "metadata": metadata,
    }
    tensors = {name: _wire(tensor, f"{where}.{name}") for name, (_, tensor) in zip(names, parts, strict=True)}
    return document, tensors


def _wire(tensor: Any, label: str) -> WireTensor:
    """A TensorDict's torch tensor on the wire, whatever the client takes elsewhere."""
    import torch

    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype is torch.bfloat16:
        return WireTensor("BF16", tensor.view(torch.int16).numpy().view(np.uint16))
    try:
        return to_wire(tensor.numpy(), label)
    except TypeError:
        raise CodecError(f"{label}: dtype {tensor.dtype} has no wire datatype") from None


def _torch(tensor: WireTensor) -> Any:
    """A TensorDict's tensors are torch tensors, whatever the client hands back elsewhere."""
    import torch

    if tensor.datatype == "BF16":
        return torch.from_numpy(tensor.array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(tensor.array)


def _jagged(entry: Mapping[str, Any], leaf: Callable[[Any, str], WireTensor], rows: int, label: str) -> Any:
    import torch

    if set(entry) != _JAGGED:
        raise CodecError(f"{label}: a jagged tensor is an object with exactly values, offsets and ragged_dim")
    values, offsets = leaf(entry["values"], f"{label}.values"), leaf(entry["offsets"], f"{label}.offsets")
    ragged_dim = entry["ragged_dim"]
    if isinstance(ragged_dim, bool) or not isinstance(ragged_dim, int) or not 1 <= ragged_dim <= values.array.ndim:
        raise CodecError(f"{label}.ragged_dim {ragged_dim!r:.40} does not fit values of shape {values.shape}")
    starts = offsets.array
    if offsets.datatype not in ("INT32", "INT64") or starts.shape != (rows + 1,) or rows == 0:
        raise CodecError(f"{label}.offsets must be {rows + 1} INT32 or INT64 values, one more than the rows")
    length = values.array.shape[ragged_dim - 1]
    if starts[0] != 0 or starts[-1] != length or bool((np.diff(starts) < 0).any()):
        raise CodecError(f"{label}.offsets must start at 0, never decrease and end at {length}")
    return torch.nested.nested_tensor_from_jagged(
        _torch(values), torch.from_numpy(starts.astype(np.int64)), jagged_dim=ragged_dim
    )


def build_tensordict(document: Any, leaf: Callable[[Any, str], WireTensor], where: str) -> Any:
    """The TensorDict a document describes, its tensors given by ``leaf``; a
    :class:`CodecError` when torch or tensordict is not installed, or the document does not fit."""
    try:
        import torch  # noqa: F401
        from tensordict import NonTensorData, NonTensorStack, TensorDict
    except ImportError:
        raise CodecError(f"{where} is a TensorDict: reading one needs torch and tensordict installed") from None
    if not isinstance(document, Mapping) or not {"batch_size", "tensors"} <= set(document) <= _KEYS:
        raise CodecError(f"{where}: a TensorDict is an object with batch_size and tensors")
    batch_size = document["batch_size"]
    if not isinstance(batch_size, list) or len(batch_size) > 1 or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in batch_size
    ):
        raise CodecError(f"{where}.batch_size must be [rows] or [], got {batch_size!r:.80}")
    rows = batch_size[0] if batch_size else 0
    parts = [document.get(key, {}) for key in ("tensors", "objects", "metadata")]
    if not all(isinstance(part, Mapping) for part in parts):
        raise CodecError(f"{where}: tensors, objects and metadata must be objects")
    entries, objects, metadata = parts
    source: dict[str, Any] = {}
    for key, entry in entries.items():
        label = f"{where}.tensors.{key}"
        if isinstance(entry, Mapping) and _JAGGED & set(entry):
            source[key] = _jagged(entry, leaf, rows, label)
        else:
            source[key] = _torch(leaf(entry, label))
    for key, items in objects.items():
        if not isinstance(items, list) or len(items) != rows:
            raise CodecError(f"{where}.objects.{key} must hold one value per row ({rows} rows)")
        source[key] = NonTensorStack.from_list([NonTensorData(item) for item in items])
    for key, value in metadata.items():
        source[key] = NonTensorData(value)
    try:
        return TensorDict(source, batch_size=batch_size)
    except (ValueError, RuntimeError, TypeError, KeyError) as exc:
        raise CodecError(f"{where}: {exc}") from None


def tensordict_from_members(document: Any, members: Mapping[str, WireTensor], where: str) -> Any:
    """:func:`build_tensordict` where each ``<tensor>`` names one of ``members`` (the
    tensors ``<path>@<name>`` of a safetensors body)."""

    def leaf(name: Any, label: str) -> WireTensor:
        if not isinstance(name, str) or name not in members:
            raise CodecError(f"{label}: {name!r:.100} names none of the batch's tensors")
        return members[name]

    return build_tensordict(document, leaf, where)

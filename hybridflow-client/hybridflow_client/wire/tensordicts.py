"""A ``tensordict.TensorDict`` batch on the wire (verl v0.7's batch type), never pickled:
its tensors travel as tensors, a jagged (nested) tensor as two of them, and its Python
values as JSON.

One JSON document describes the batch::

    {"batch_size": [4],
     "tensors": {"scores": <tensor>,                          # a dense tensor, rows first
                 "input_ids": {"values": <tensor>,            # a jagged tensor: its rows'
                               "offsets": <tensor>,           # elements joined, where each
                               "ragged_dim": 1}},             # row starts, its ragged dim
     "objects": {"turns": [[], ["hi"], [], ["a", "b"]]},      # per row: one JSON value a row
     "metadata": {"temperature": 0.7}}                        # the whole batch: JSON values

``objects`` and ``metadata`` may be left out. In a JSON body each ``<tensor>`` is a JSON
tensor object and the batch is ``{"__tensordict__": <document>}``; in safetensors the
metadata entry under the batch's path (an argument name, ``output``...) is
``{"__tensordict__": <document>}`` with each ``<tensor>`` the name of one of the body's
tensors ``<path>@<name>``, each used once. ``batch_size`` is ``[rows]`` (or ``[]`` for a
batch of metadata and tensors without rows). A jagged tensor's offsets are int32 or int64,
one more than the rows, start at 0, never decrease and end at the values' length along
the ragged dimension, all checked (vectorised, in numpy) before the side that decodes
makes the jagged tensor (:class:`~hybridflow_client.wire.parts.Builder`).

Nothing here imports torch or tensordict: a TensorDict, or a jagged tensor, can only be at
hand once they are imported.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from hybridflow_client.wire.dataproto import (
    build_dataproto,
    dataproto_document,
    is_dataproto,
    json_items,
    plain_json,
)
from hybridflow_client.wire.datatypes import WireTensor
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.limits import DEFAULT_LIMITS, WireLimits
from hybridflow_client.wire.parts import Builder, JaggedParts, TensorDictParts

__all__ = [
    "TENSORDICT_MARKER",
    "batch_document",
    "build_batch",
    "build_tensordict",
    "is_tensordict",
    "map_tensor_leaves",
    "tensordict_document",
    "tensordict_from_members",
    "tensordict_of",
]

#: The key that marks a TensorDict in a JSON body and in a safetensors metadata document.
TENSORDICT_MARKER = "__tensordict__"
_REQUIRED = frozenset({"batch_size", "tensors"})
_KEYS = _REQUIRED | {"objects", "metadata"}
_JAGGED = frozenset({"values", "offsets", "ragged_dim"})

#: ``leaf(value, label)``: the tensor a document's ``<tensor>`` stands for.
Leaf = Callable[[Any, str], Any]


def is_tensordict(value: Any) -> bool:
    """True for a TensorDict (any ``TensorDictBase`` but a column of Python objects),
    looked up without importing ``tensordict``: a value cannot be one before it is imported."""
    module = sys.modules.get("tensordict")
    if module is None or not isinstance(value, module.TensorDictBase):
        return False
    return not isinstance(value, module.NonTensorStack)


# -- to the wire -------------------------------------------------------------------------


def _jagged_parts(tensor: Any, label: str) -> tuple[Any, Any, int]:
    """A jagged tensor's ``(values, offsets, ragged_dim)``, its rows packed one after
    another: a view of its values where they are (work in proportion to the rows), else
    one gather of the elements (never a tensor per row)."""
    torch = sys.modules["torch"]
    if tensor.layout != torch.jagged:
        raise WireError(f"{label}: a nested tensor travels with layout=torch.jagged")
    values, offsets, dim = tensor.values(), tensor.offsets().to(torch.int64), int(tensor._ragged_idx)
    lengths = tensor.lengths()
    if lengths is not None:  # rows with gaps between them: each element's place in the packed rows
        lengths = lengths.to(torch.int64)
        ends = torch.cumsum(lengths, 0)
        total = int(ends[-1]) if len(ends) else 0
        shift = torch.repeat_interleave(offsets[:-1] - (ends - lengths), lengths, output_size=total)
        values = values.index_select(dim - 1, torch.arange(total, dtype=torch.int64, device=values.device) + shift)
        offsets = torch.cat([lengths.new_zeros(1), ends])
    return values, offsets, dim


def tensordict_document(data: Any, where: str, limits: WireLimits = DEFAULT_LIMITS) -> tuple[dict[str, Any], dict[str, Any]]:
    """A TensorDict as its document (each ``<tensor>`` a name) and its tensors by name,
    as torch holds them (the encoder that writes them checks their datatypes): a dense
    entry's tensor is named like the entry, a jagged entry's ``<key>.values`` and
    ``<key>.offsets`` (every tensor by its number should those names clash)."""
    from tensordict import NonTensorData, NonTensorStack

    if data.batch_dims > 1:
        raise WireError(f"{where}: a TensorDict travels with one batch dimension at most, not {list(data.batch_size)}")
    torch = sys.modules["torch"]
    entries: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    metadata: dict[str, Any] = {}
    parts: list[tuple[str, Any]] = []
    for key in data.keys():
        value = data.get(key)
        if not isinstance(key, str):
            raise WireError(f"{where}: only string keys travel, got {key!r:.40}")
        label = f"{where}.{key}"
        if isinstance(value, NonTensorStack):
            items = value.tolist()
            objects[key] = json_items(items, label, limits) if value.batch_dims == 1 else plain_json(items, label, limits)
        elif isinstance(value, NonTensorData):
            metadata[key] = plain_json(value.data, label, limits)
        elif isinstance(value, torch.Tensor) and value.is_nested:
            values, offsets, ragged_dim = _jagged_parts(value, label)
            entries[key] = {"values": len(parts), "offsets": len(parts) + 1, "ragged_dim": ragged_dim}
            parts += [(f"{key}.values", values), (f"{key}.offsets", offsets)]
        elif isinstance(value, torch.Tensor):
            entries[key] = len(parts)
            parts.append((key, value))
        else:
            raise WireError(f"{label} is a {type(value).__name__}; a TensorDict travels with tensors, jagged "
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
    return document, {name: tensor for name, (_, tensor) in zip(names, parts, strict=True)}


def map_tensor_leaves(entries: Mapping[str, Any], fn: Callable[[Any], Any]) -> dict[str, Any]:
    """A document's ``tensors`` with every ``<tensor>`` replaced by ``fn(<tensor>)``
    (e.g. names by JSON tensor objects)."""
    out: dict[str, Any] = {}
    for key, entry in entries.items():
        if isinstance(entry, Mapping) and _JAGGED & set(entry):
            out[key] = {"values": fn(entry["values"]), "offsets": fn(entry["offsets"]), "ragged_dim": entry["ragged_dim"]}
        else:
            out[key] = fn(entry)
    return out


def batch_document(value: Any, where: str, limits: WireLimits = DEFAULT_LIMITS) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """A DataProto's or TensorDict's document as a safetensors metadata entry holds it (a
    TensorDict's under :data:`TENSORDICT_MARKER`) and its tensors by name; None for any
    other value."""
    if is_dataproto(value):
        return dataproto_document(value, where, limits)
    if is_tensordict(value):
        document, tensors = tensordict_document(value, where, limits)
        return {TENSORDICT_MARKER: document}, tensors
    return None


# -- from the wire -----------------------------------------------------------------------


def _shape(tensor: Any) -> list[int]:
    return list(tensor.shape)


def _offsets(tensor: Any) -> np.ndarray | None:
    """A decoded (or torch) tensor's values as an int64 numpy array when it is 1-D INT32
    or INT64, else None."""
    if isinstance(tensor, WireTensor):
        array = tensor.array if tensor.datatype in ("INT32", "INT64") else None
    else:
        try:
            array = np.asarray(tensor)
        except (TypeError, RuntimeError):  # torch dtypes numpy has no form of
            return None
    if array is None or array.dtype not in (np.int32, np.int64) or array.ndim != 1:
        return None
    return array.astype(np.int64)


def _kind(tensor: Any) -> str:
    return tensor.datatype if isinstance(tensor, WireTensor) else str(getattr(tensor, "dtype", type(tensor).__name__))


def _batch_size(value: Any, where: str, limits: WireLimits) -> list[int]:
    if not isinstance(value, list) or len(value) > 1 or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= limits.max_tensor_elements for d in value
    ):
        raise WireError(f"{where}.batch_size must be [rows] or [], got {value!r:.80}")
    return value


def _mapping(document: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = document.get(key, {})
    if not isinstance(value, Mapping) or not all(isinstance(name, str) and name for name in value):
        raise WireError(f"{where}.{key} must be an object whose keys are non-empty names")
    return value


def _jagged(entry: Mapping[str, Any], leaf: Leaf, rows: int | None, label: str) -> JaggedParts:
    """A jagged tensor's parts, once the offsets fit the rows and the values."""
    if set(entry) != _JAGGED:
        raise WireError(f"{label}: a jagged tensor is an object with exactly values, offsets and ragged_dim")
    if not rows:
        raise WireError(f"{label}: a jagged tensor needs a batch of one or more rows (batch_size [rows])")
    values, raw_offsets = leaf(entry["values"], f"{label}.values"), leaf(entry["offsets"], f"{label}.offsets")
    shape, ragged_dim = _shape(values), entry["ragged_dim"]
    if isinstance(ragged_dim, bool) or not isinstance(ragged_dim, int) or not 1 <= ragged_dim <= len(shape):
        raise WireError(f"{label}.ragged_dim must be between 1 and {len(shape)} for values of shape "
                        f"{shape}, got {ragged_dim!r:.40}")
    offsets = _offsets(raw_offsets)
    if offsets is None:
        raise WireError(f"{label}.offsets must be a 1-D INT32 or INT64 tensor, got {_kind(raw_offsets)} "
                        f"of shape {_shape(raw_offsets)}")
    if offsets.size != rows + 1:
        raise WireError(f"{label}.offsets has {offsets.size} entries; {rows} rows need {rows + 1}")
    length = shape[ragged_dim - 1]
    if int(offsets[0]) != 0:
        raise WireError(f"{label}.offsets must start at 0, got {int(offsets[0])}")
    if bool((offsets[1:] < offsets[:-1]).any()):
        raise WireError(f"{label}.offsets decrease (a row would end before it starts)")
    if int(offsets[-1]) != length:
        raise WireError(f"{label}.offsets end at {int(offsets[-1])}, but the values hold {length} along "
                        f"the ragged dimension")
    return JaggedParts(values, offsets, ragged_dim)


def tensordict_parts(document: Any, leaf: Leaf, where: str, limits: WireLimits = DEFAULT_LIMITS) -> TensorDictParts:
    """The parts of the TensorDict a document describes, its tensors given by ``leaf``;
    every count, name, shape and offset checked (:class:`WireError` naming what does not
    fit)."""
    if not isinstance(document, Mapping) or not _REQUIRED <= set(document) or not set(document) <= _KEYS:
        raise WireError(f"{where}: a TensorDict is an object with batch_size and tensors "
                        "(and optionally objects and metadata)")
    batch_size = _batch_size(document["batch_size"], where, limits)
    rows = batch_size[0] if batch_size else None
    entries, objects, metadata = (_mapping(document, key, where) for key in ("tensors", "objects", "metadata"))
    count = len(entries) + len(objects) + len(metadata)
    if count > limits.max_tensors:
        raise WireError(f"{where}: {count} entries, over the limit of {limits.max_tensors} (limits.max_tensors)")
    clash = (set(entries) & set(objects)) | (set(entries) & set(metadata)) | (set(objects) & set(metadata))
    if clash:
        raise WireError(f"{where}: {sorted(clash)[0]!r:.60} is given twice")
    parts = TensorDictParts(list(batch_size))
    for key, entry in entries.items():
        label = f"{where}.tensors.{key}"
        if isinstance(entry, Mapping) and _JAGGED & set(entry):
            parts.tensors[key] = _jagged(entry, leaf, rows, label)
            continue
        tensor = leaf(entry, label)
        if _shape(tensor)[: len(batch_size)] != batch_size:
            raise WireError(f"{label}: shape {_shape(tensor)} does not start with batch_size {batch_size}")
        parts.tensors[key] = tensor
    for key, items in objects.items():
        if not isinstance(items, list) or len(items) != rows:
            raise WireError(f"{where}.objects.{key} must be a list of one value per row ({rows} rows)")
        parts.objects[key] = json_items(items, f"{where}.objects.{key}", limits)
    for key, value in metadata.items():
        parts.metadata[key] = plain_json(value, f"{where}.metadata.{key}", limits)
    return parts


def tensordict_of(
    parts: TensorDictParts, where: str, tensor: Callable[[Any], Any], jagged: Callable[[JaggedParts], Any],
    column: Callable[[list[Any]], Any],
) -> Any:
    """The TensorDict of checked parts, each made the side's way: ``tensor`` (a dense
    tensor), ``jagged`` (a jagged one) and ``column`` (a column of Python objects)."""
    from tensordict import NonTensorData, TensorDict

    source: dict[str, Any] = {}
    for key, entry in parts.tensors.items():
        if isinstance(entry, JaggedParts):
            try:
                source[key] = jagged(entry)
            except (ValueError, RuntimeError) as exc:
                raise WireError(f"{where}.tensors.{key}: {exc}") from None
        else:
            source[key] = tensor(entry)
    for key, items in parts.objects.items():
        source[key] = column(items)
    for key, value in parts.metadata.items():
        source[key] = NonTensorData(value)
    try:
        return TensorDict(source, batch_size=parts.batch_size)
    except (ValueError, RuntimeError, TypeError, KeyError) as exc:
        raise WireError(f"{where}: {exc}") from None


def build_tensordict(document: Any, leaf: Leaf, where: str, limits: WireLimits, builder: Builder) -> Any:
    """The TensorDict a document describes, its tensors given by ``leaf``, made by
    ``builder`` once :func:`tensordict_parts` checked it."""
    return builder.tensordict(tensordict_parts(document, leaf, where, limits), where)


def tensordict_from_members(
    document: Any, members: Mapping[str, Any], where: str, limits: WireLimits, builder: Builder
) -> Any:
    """:func:`build_tensordict` where each ``<tensor>`` names one of ``members`` (the
    tensors ``<path>@<name>`` of a safetensors body), each used exactly once."""
    used: set[str] = set()

    def leaf(name: Any, label: str) -> Any:
        if not isinstance(name, str) or name not in members:
            raise WireError(f"{label}: {name!r:.100} names none of the batch's tensors")
        if name in used:
            raise WireError(f"{label}: tensor {name!r:.100} is used twice")
        used.add(name)
        return members[name]

    parts = tensordict_parts(document, leaf, where, limits)
    if len(used) != len(members):
        raise WireError(f"{where}: tensors {sorted(set(members) - used)[:3]} belong to no entry")
    return builder.tensordict(parts, where)


def build_batch(document: Any, members: Mapping[str, Any], where: str, limits: WireLimits, builder: Builder) -> Any:
    """The DataProto or TensorDict (a document under :data:`TENSORDICT_MARKER`) a parsed
    safetensors metadata document and its tensors describe (:func:`batch_document`'s
    inverse), made by ``builder``."""
    if isinstance(document, Mapping) and set(document) == {TENSORDICT_MARKER}:
        return tensordict_from_members(document[TENSORDICT_MARKER], members, where, limits, builder)
    return build_dataproto(document, members, where, limits, builder)

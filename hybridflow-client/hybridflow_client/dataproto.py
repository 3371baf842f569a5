"""verl's DataProto on the client side, duck-typed: the client never imports verl or the
service's library, so any object whose class is named ``DataProto`` and has ``batch``,
``non_tensor_batch`` and ``meta_info`` travels as one (as does :class:`WireDataProto`).

On the wire a DataProto is one JSON document and its batch tensors::

    {"rows": 4, "batch": ["x"],                         # the tensors' names, in order
     "non_tensor_batch": {"uid": {"dtype": "object", "shape": [4], "data": ["a", "b", "c", "d"]}},
     "meta_info": {"step": 1}}

In safetensors the document is the metadata entry under the DataProto's path and its
tensors are named ``<path>@<key>``; in JSON a DataProto is ``{"__dataproto__": {<the
document>, "batch": {key: tensor object}}}``.

A DataProto in an answer is built with the class of the DataProto the call sent, else
with the ``DataProto`` of an already imported module of :data:`DATAPROTO_MODULES`, else
as a :class:`WireDataProto`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hybridflow_client.tensors import CodecError, WireTensor, to_user, to_wire

__all__ = [
    "DATAPROTO_MODULES",
    "JSON_MARKER",
    "MEMBER",
    "WireDataProto",
    "build_dataproto",
    "dataproto_class",
    "dataproto_document",
    "is_dataproto",
    "plain_json",
]

#: The key that marks a DataProto in a JSON body.
JSON_MARKER = "__dataproto__"
#: Between a DataProto's path and a tensor's key in safetensors names.
MEMBER = "@"
#: Modules whose ``DataProto`` answers are built with, when one of them is already imported.
DATAPROTO_MODULES = ("verl.protocol", "single_controller.protocol")
_DOCUMENT_KEYS = frozenset({"rows", "batch", "non_tensor_batch", "meta_info"})


@dataclass
class WireDataProto:
    """A DataProto's three parts, for a client without verl: ``batch`` maps names to
    tensors (same rows), ``non_tensor_batch`` names to numpy arrays (one item per row),
    ``meta_info`` is a JSON-able dict. Sent as a DataProto, and answers come back as one
    when no DataProto class is at hand."""

    batch: dict[str, Any] = field(default_factory=dict)
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, Any] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta_info: Mapping[str, Any] | None = None,
    ) -> WireDataProto:
        """verl's constructor: non-tensor lists become ``dtype=object`` arrays."""
        arrays = {}
        for key, value in (non_tensors or {}).items():
            if isinstance(value, np.ndarray):
                arrays[key] = value
            else:
                arrays[key] = np.empty(len(value), dtype=object)
                arrays[key][:] = list(value)
        return cls(dict(tensors or {}), arrays, dict(meta_info or {}))

    def __len__(self) -> int:
        for value in (*self.batch.values(), *self.non_tensor_batch.values()):
            return int(value.shape[0])
        return 0


def is_dataproto(value: Any) -> bool:
    """True for a verl DataProto (by its class's name and parts) or a :class:`WireDataProto`."""
    if isinstance(value, WireDataProto):
        return True
    return type(value).__name__ == "DataProto" and all(
        hasattr(value, part) for part in ("batch", "non_tensor_batch", "meta_info")
    )


def dataproto_class(like: type | None = None) -> type:
    """The class a DataProto answer is built with: ``like`` (a DataProto argument's class),
    else the ``DataProto`` of an imported module of :data:`DATAPROTO_MODULES`, else
    :class:`WireDataProto`."""
    if like is not None:
        return like
    for name in DATAPROTO_MODULES:
        found = getattr(sys.modules.get(name), "DataProto", None)
        if isinstance(found, type):
            return found
    return WireDataProto


# -- to the wire -------------------------------------------------------------------------


def _plain(value: Any, where: str, depth: int = 0) -> Any:
    """A JSON-ready copy of a value made of JSON's own types (numpy scalars and arrays too)."""
    if depth > 100:
        raise CodecError(f"{where}: nests deeper than 100 levels")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CodecError(f"{where}: {value} has no JSON form")
        return value
    if isinstance(value, Mapping):
        if not all(isinstance(key, str) for key in value):
            raise CodecError(f"{where}: every key must be a string")
        return {key: _plain(item, f"{where}.{key}", depth + 1) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value)]
    raise CodecError(
        f"{where} is a {type(value).__name__}; a batch's non-tensor data and metadata travel as JSON "
        "(strings, numbers, booleans, null, lists, objects)"
    )


def plain_json(value: Any, where: str) -> Any:
    """A JSON-ready copy of a value made of JSON's own types (numpy scalars and arrays too),
    or a :class:`CodecError`."""
    return _plain(value, where)


def _array_document(array: Any, where: str) -> dict[str, Any]:
    array = np.asarray(array)
    if array.dtype.kind not in "biufUO":
        raise CodecError(f"{where}: a numpy array of dtype {array.dtype} has no JSON form")
    dtype = "object" if array.dtype.kind in "OU" else array.dtype.str
    data = [_plain(item, f"{where}[{i}]", 1) for i, item in enumerate(array.reshape(-1).tolist())]
    return {"dtype": dtype, "shape": list(array.shape), "data": data}


def dataproto_document(data: Any, where: str) -> tuple[dict[str, Any], dict[str, WireTensor]]:
    """A DataProto as its JSON document and its batch tensors by key."""
    tensors: dict[str, WireTensor] = {}
    if data.batch is not None:
        for key in data.batch.keys():
            if not isinstance(key, str):
                raise CodecError(f"{where}.batch: only flat string keys travel, got {key!r:.40}")
            tensors[key] = to_wire(data.batch[key], f"{where}.batch.{key}")
    document = {
        "rows": len(data),
        "batch": list(tensors),
        "non_tensor_batch": {
            key: _array_document(value, f"{where}.non_tensor_batch.{key}")
            for key, value in (data.non_tensor_batch or {}).items()
        },
        "meta_info": _plain(data.meta_info or {}, f"{where}.meta_info"),
    }
    return document, tensors


# -- from the wire -----------------------------------------------------------------------


def _array(document: Any, where: str) -> np.ndarray:
    if not isinstance(document, Mapping) or set(document) != {"dtype", "shape", "data"}:
        raise CodecError(f"{where} must be an object with dtype, shape and data")
    dtype, shape, data = document["dtype"], document["shape"], document["data"]
    if not isinstance(shape, list) or not isinstance(data, list) or len(data) != math.prod(shape):
        raise CodecError(f"{where}: data does not fill shape {shape!r:.80}")
    if dtype == "object":
        array = np.empty(len(data), dtype=object)
        for i, item in enumerate(data):  # one by one: an item that is a list stays one item
            array[i] = item
        return array.reshape(shape)
    try:
        return np.asarray(data, dtype=np.dtype(dtype)).reshape(shape)
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError(f"{where}: {exc}") from None


def build_dataproto(
    document: Any, tensors: Mapping[str, WireTensor], where: str, like: type | None = None
) -> Any:
    """The DataProto a document and its tensors describe, built with
    :func:`dataproto_class` (``like``) through its ``from_dict``."""
    if not isinstance(document, Mapping) or set(document) != _DOCUMENT_KEYS:
        raise CodecError(f"{where}: a DataProto is an object with exactly {sorted(_DOCUMENT_KEYS)}")
    rows, names = document["rows"], document["batch"]
    if not isinstance(names, list) or sorted(names) != sorted(tensors):
        raise CodecError(f"{where}.batch names {names!r:.80} but the tensors are {sorted(tensors)[:5]}")
    for name in names:
        if not tensors[name].shape or tensors[name].shape[0] != rows:
            raise CodecError(f"{where}.batch.{name}: shape {tensors[name].shape} has not {rows} rows")
    if not isinstance(document["non_tensor_batch"], Mapping) or not isinstance(document["meta_info"], Mapping):
        raise CodecError(f"{where}: non_tensor_batch and meta_info must be objects")
    arrays = {
        key: _array(value, f"{where}.non_tensor_batch.{key}") for key, value in document["non_tensor_batch"].items()
    }
    return dataproto_class(like).from_dict(
        tensors={name: to_user(tensors[name]) for name in names} or None,
        non_tensors=arrays,
        meta_info=dict(document["meta_info"]),
    )

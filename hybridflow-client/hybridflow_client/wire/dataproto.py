"""verl's DataProto on the wire, never pickled: its batch tensors travel as tensors (in
safetensors, or as JSON tensor objects in a JSON body), its non-tensor arrays and
``meta_info`` as JSON: strings, numbers, booleans, null, lists and objects of those, and
numpy arrays of them (``dtype=object`` included).

One JSON document describes a DataProto apart from its tensors::

    {"rows": 4,
     "batch": ["input_ids", "mask"],                   # its tensors' names, in order
     "non_tensor_batch": {"uid": {"dtype": "object", "shape": [4], "data": ["a", "b", "c", "d"]}},
     "meta_info": {"temperature": 0.7}}

In safetensors the document is the string metadata under the DataProto's path (an
argument name, or ``output``...) and its tensors are named ``<path>@<key>``; in a JSON
body a DataProto is ``{"__dataproto__": {<the document>, "batch": {key: tensor object}}}``.
Every count and shape is checked before anything is built; the side that decodes builds
its own DataProto of the parts (a :class:`~hybridflow_client.wire.parts.Builder`).

A DataProto is recognised by its class's name and parts, so verl's, the service library's
and :class:`WireDataProto` (for a client without either) all travel.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hybridflow_client.wire.datatypes import WireTensor
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.limits import DEFAULT_LIMITS, WireLimits
from hybridflow_client.wire.parts import Builder
from hybridflow_client.wire.tensors import is_tensor

__all__ = [
    "DATAPROTO_MODULES",
    "JSON_MARKER",
    "MEMBER",
    "WireDataProto",
    "build_dataproto",
    "dataproto_class",
    "dataproto_document",
    "is_dataproto",
    "json_items",
    "plain_json",
]

#: The key that marks a DataProto in a JSON body.
JSON_MARKER = "__dataproto__"
#: Between a DataProto's path and a tensor's key in safetensors names.
MEMBER = "@"
#: Modules whose ``DataProto`` a client builds answers with, when one of them is imported.
DATAPROTO_MODULES = ("verl.protocol", "single_controller.protocol")
_DOCUMENT_KEYS = frozenset({"rows", "batch", "non_tensor_batch", "meta_info"})
#: numpy dtypes a non-tensor array may have (object arrays hold JSON values).
_ARRAY_KINDS = "biufUO"
#: The numeric dtype strings a document may name (what ``dtype.str`` gives for them): numpy
#: parses much more (subarrays, records, dates), some of it with errors of its own.
_NUMERIC_DTYPE = re.compile(r"[<>|=]?(?:b1|[iu][1248]|f(?:2|4|8|16))")


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
    """True for a DataProto: a :class:`WireDataProto`, or an object whose class is named
    ``DataProto`` and has ``batch``, ``non_tensor_batch`` and ``meta_info``."""
    if isinstance(value, WireDataProto):
        return True
    return type(value).__name__ == "DataProto" and all(
        hasattr(value, part) for part in ("batch", "non_tensor_batch", "meta_info")
    )


def dataproto_class(like: type | None = None) -> type:
    """The class a client builds a DataProto answer with: ``like`` (a DataProto argument's
    class), else the ``DataProto`` of an imported module of :data:`DATAPROTO_MODULES`, else
    :class:`WireDataProto`."""
    if like is not None:
        return like
    for name in DATAPROTO_MODULES:
        found = getattr(sys.modules.get(name), "DataProto", None)
        if isinstance(found, type):
            return found
    return WireDataProto


# -- JSON values inside non-tensor arrays and meta_info ----------------------------------


def _plain(value: Any, where: str, depth: int, limits: WireLimits) -> Any:
    """A JSON-ready copy of a value made of JSON's own types (numpy scalars and arrays
    of them allowed)."""
    if depth > limits.max_depth:
        raise WireError(f"{where}: nests deeper than {limits.max_depth} levels")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        if not math.isfinite(value):
            raise WireError(f"{where}: {value} has no JSON form")
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.ndarray):
        return _plain(value.tolist(), where, depth + 1, limits)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise WireError(f"{where}: key {key!r:.40} is not a string")
            out[key] = _plain(item, f"{where}.{key}", depth + 1, limits)
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{where}[{i}]", depth + 1, limits) for i, item in enumerate(value)]
    raise WireError(
        f"{where} is a {type(value).__name__}; a batch's non-tensor data and metadata travel as JSON "
        "(strings, numbers, booleans, null, lists, objects)"
    )


def plain_json(value: Any, where: str, limits: WireLimits = DEFAULT_LIMITS) -> Any:
    """A JSON-ready copy of a value made of JSON's own types (numpy scalars and arrays of
    them allowed); :class:`WireError` for anything else or nesting deeper than
    ``limits.max_depth``."""
    return _plain(value, where, 0, limits)


_SCALARS = frozenset({str, int, float, bool, type(None)})


def json_items(items: list[Any], where: str, limits: WireLimits = DEFAULT_LIMITS) -> list[Any]:
    """:func:`plain_json` of a list of values, one per row, at the cost of a type check
    per scalar: only lists, objects and what is no JSON scalar are walked (and copied)."""
    return [
        item if type(item) in _SCALARS and (type(item) is not float or math.isfinite(item))
        else _plain(item, f"{where}[{i}]", 1, limits)
        for i, item in enumerate(items)
    ]


def _array_document(array: Any, where: str, limits: WireLimits) -> dict[str, Any]:
    array = np.asarray(array)
    if array.dtype.kind not in _ARRAY_KINDS:
        raise WireError(f"{where}: a numpy array of dtype {array.dtype} has no JSON form")
    if array.size > limits.max_json_values:
        raise WireError(f"{where}: {array.size} values, over limits.max_json_values")
    dtype = "object" if array.dtype.kind in "OU" else array.dtype.str
    flat = json_items(array.reshape(-1).tolist(), where, limits)
    return {"dtype": dtype, "shape": list(array.shape), "data": flat}


def _array(document: Any, where: str, limits: WireLimits) -> np.ndarray:
    if not isinstance(document, Mapping) or set(document) != {"dtype", "shape", "data"}:
        raise WireError(f"{where} must be an object with dtype, shape and data")
    shape, data, dtype = document["shape"], document["data"], document["dtype"]
    if not isinstance(shape, list) or not shape or len(shape) > limits.max_ndim or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= limits.max_tensor_elements for d in shape
    ):
        raise WireError(f"{where}: shape must be a list of sizes with a row axis, got {shape!r:.80}")
    if not isinstance(data, list):
        raise WireError(f"{where}: data must be a flat list")
    count = 1
    for d in shape:
        count *= d
        if count > limits.max_json_values:
            raise WireError(f"{where}: shape {shape} holds more than limits.max_json_values values")
    if len(data) != count:
        raise WireError(f"{where}: data has {len(data)} values but shape {shape} needs {count}")
    if dtype == "object":
        array = np.empty(count, dtype=object)
        for i, item in enumerate(data):  # one by one: an item that is a list stays one item
            array[i] = item
        return array.reshape(shape)
    if not isinstance(dtype, str) or not _NUMERIC_DTYPE.fullmatch(dtype):
        raise WireError(f"{where}: dtype {dtype!r:.40} must be numeric or 'object' (such as '<f4', '<i8', '|b1')")
    try:
        numpy_dtype = np.dtype(dtype)
    except TypeError:  # f16 where long double is not 16 bytes
        raise WireError(f"{where}: dtype {dtype!r:.40} is not known on this machine") from None
    try:
        return np.asarray(data, dtype=numpy_dtype).reshape(shape)
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"{where}: {exc}") from None


# -- whole DataProtos -------------------------------------------------------------------


def dataproto_document(data: Any, where: str, limits: WireLimits = DEFAULT_LIMITS) -> tuple[dict[str, Any], dict[str, Any]]:
    """A DataProto as its JSON document and its batch tensors by key, as the DataProto
    holds them (the encoder that writes them checks their datatypes)."""
    tensors: dict[str, Any] = {}
    if data.batch is not None:
        for key in data.batch.keys():
            value = data.batch[key]
            if not isinstance(key, str) or not (is_tensor(value) or isinstance(value, WireTensor)):
                raise WireError(f"{where}.batch: only flat string keys of tensors travel, got {key!r:.40}")
            tensors[key] = value
    document = {
        "rows": len(data),
        "batch": list(tensors),
        "non_tensor_batch": {
            key: _array_document(value, f"{where}.non_tensor_batch.{key}", limits)
            for key, value in (data.non_tensor_batch or {}).items()
        },
        "meta_info": _plain(data.meta_info or {}, f"{where}.meta_info", 0, limits),
    }
    return document, tensors


def build_dataproto(
    document: Any, tensors: Mapping[str, Any], where: str, limits: WireLimits, builder: Builder
) -> Any:
    """The DataProto a document and its tensors describe, made by ``builder`` once the
    document fits them: names, row counts, shapes, types (:class:`WireError` otherwise)."""
    if not isinstance(document, Mapping) or set(document) != _DOCUMENT_KEYS:
        raise WireError(f"{where}: a DataProto is an object with exactly {sorted(_DOCUMENT_KEYS)}")
    rows, names = document["rows"], document["batch"]
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise WireError(f"{where}.rows must be a non-negative integer")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise WireError(f"{where}.batch must list distinct tensor names")
    if sorted(names) != sorted(tensors):
        raise WireError(f"{where}.batch names {sorted(names)[:5]} but the tensors are {sorted(tensors)[:5]}")
    for name in names:
        shape = list(tensors[name].shape)
        if not shape or shape[0] != rows:
            raise WireError(f"{where}.batch.{name}: shape {shape} has not {rows} rows")
    non_tensor = document["non_tensor_batch"]
    if not isinstance(non_tensor, Mapping):
        raise WireError(f"{where}.non_tensor_batch must be an object")
    arrays = {key: _array(value, f"{where}.non_tensor_batch.{key}", limits) for key, value in non_tensor.items()}
    for key, array in arrays.items():
        if array.shape[0] != rows:
            raise WireError(f"{where}.non_tensor_batch.{key} has {array.shape[0]} rows, not {rows}")
    if not isinstance(document["meta_info"], Mapping):
        raise WireError(f"{where}.meta_info must be an object")
    return builder.dataproto({name: tensors[name] for name in names}, arrays, dict(document["meta_info"]), where)

"""Values in JSON bodies: a call's arguments out, a call's output in.

- A tensor is an OIP tensor object ``{"datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}``
  (flat row-major data; NaN and infinities as the strings "NaN", "Infinity", "-Infinity").
- Encoding (:func:`encode_json_value`): tensors and numeric numpy arrays become tensor
  objects; numpy scalars plain numbers; tuples lists; non-finite floats the strings
  above; mapping keys strings; a DataProto ``{"__dataproto__": {...}}``; a TensorDict
  ``{"__tensordict__": {...}}`` (:mod:`hybridflow_client.tensordicts`); any other object
  ``{"type": "module.Class", "repr": "..."}``.
- Decoding (:func:`decode_json_value`): tensor objects, at any depth, become tensors
  (:func:`hybridflow_client.tensors.to_user`), DataProto objects DataProtos, TensorDict
  objects TensorDicts (torch and tensordict needed); everything else is left as it is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hybridflow_client.dataproto import JSON_MARKER, build_dataproto, dataproto_document, is_dataproto
from hybridflow_client.tensordicts import (
    TENSORDICT_MARKER,
    build_tensordict,
    is_tensordict,
    map_tensor_leaves,
    tensordict_document,
)
from hybridflow_client.tensors import (
    CodecError,
    WireTensor,
    from_json,
    is_json_tensor,
    is_tensor,
    to_user,
    to_wire,
)

__all__ = ["decode_json_value", "dumps_compact", "encode_json_value", "tensor_object"]

#: Longest repr sent for a value that has no JSON form.
MAX_REPR_CHARS = 10_000
#: Deepest nesting encoded (deeper is most likely a cycle).
MAX_DEPTH = 100


def dumps_compact(value: Any) -> bytes:
    """Compact UTF-8 JSON (no NaN: the encoder spells it as a string)."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def tensor_object(tensor: WireTensor) -> dict[str, Any]:
    """An OIP JSON tensor object."""
    return {"datatype": tensor.datatype, "shape": tensor.shape, "data": tensor.json_data()}


# -- encoding ----------------------------------------------------------------------------


def _type_name(value: Any) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _opaque(value: Any) -> dict[str, str]:
    try:
        text = repr(value)
    except Exception as exc:  # a broken __repr__ must not break the request
        text = f"<{_type_name(value)} object; repr failed: {exc}>"
    if len(text) > MAX_REPR_CHARS:
        text = text[: MAX_REPR_CHARS - 3] + "..."
    return {"type": _type_name(value), "repr": text}


def _key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, (bool, int, float)):
        return json.dumps(key)
    return str(key)


def encode_json_value(value: Any) -> Any:
    """``value`` as JSON-ready Python data (see the module docstring); a tensor without a
    wire datatype, or nesting deeper than :data:`MAX_DEPTH`, is a :class:`CodecError`."""
    return _encode(value, "value", 0)


def _encode(value: Any, where: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise CodecError(f"{where}: nests deeper than {MAX_DEPTH} levels (a cycle?)")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        value = float(value)
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, np.ndarray) and value.dtype.kind not in "biuf":
        return _encode(value.tolist(), where, depth + 1) if value.dtype.kind in "OUS" else _opaque(value)
    if is_tensor(value) or isinstance(value, WireTensor):
        return tensor_object(to_wire(value, where))
    if is_dataproto(value):
        document, tensors = dataproto_document(value, where)
        batch = {name: tensor_object(tensor) for name, tensor in tensors.items()}
        return {JSON_MARKER: {**document, "batch": batch}}
    if is_tensordict(value):  # before mappings: a TensorDict is one
        document, tensors = tensordict_document(value, where)
        entries = map_tensor_leaves(document["tensors"], lambda name: tensor_object(tensors[name]))
        return {TENSORDICT_MARKER: {**document, "tensors": entries}}
    if isinstance(value, np.generic):
        item = value.item()
        return _opaque(value) if isinstance(item, np.generic) else _encode(item, where, depth + 1)
    if isinstance(value, Mapping):
        return {_key(k): _encode(v, f"{where}.{_key(k)}", depth + 1) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray, memoryview, range)):
        return [_encode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    return _opaque(value)


# -- decoding ----------------------------------------------------------------------------


def decode_json_value(value: Any, where: str = "value", dataproto_type: type | None = None) -> Any:
    """Decoded JSON with every tensor object turned into a tensor and every DataProto
    object into a DataProto (built like :func:`hybridflow_client.dataproto.build_dataproto`
    with ``dataproto_type``); ``where`` starts error messages."""
    if is_json_tensor(value):
        return to_user(from_json(value, where))
    if isinstance(value, Mapping) and set(value) == {JSON_MARKER}:
        document = value[JSON_MARKER]
        batch = document.get("batch") if isinstance(document, Mapping) else None
        if not isinstance(batch, Mapping):
            raise CodecError(f"{where}: a DataProto's batch must map names to tensor objects")
        tensors = {name: from_json(obj, f"{where}.batch.{name}") for name, obj in batch.items()}
        return build_dataproto({**document, "batch": list(batch)}, tensors, where, dataproto_type)
    if isinstance(value, Mapping) and set(value) == {TENSORDICT_MARKER}:
        return build_tensordict(value[TENSORDICT_MARKER], from_json, where)
    if isinstance(value, list):
        return [decode_json_value(v, f"{where}[{i}]", dataproto_type) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        return {k: decode_json_value(v, f"{where}.{k}", dataproto_type) for k, v in value.items()}
    return value

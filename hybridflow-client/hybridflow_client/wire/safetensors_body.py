"""safetensors bodies: named tensors and string metadata, written with the safetensors
library and read here by the format's rules.

- Reading checks the header first: the number of tensors and every shape against
  :class:`~hybridflow_client.wire.limits.WireLimits`, known dtypes, and the tensors'
  byte ranges packed back to back from 0 to the end of the body, before any tensor is
  read. A writable body (a request read into a bytearray) is viewed in place where its
  bytes lie aligned; a read-only one is copied (safetensors' own ``load`` copies every
  tensor of an in-memory body: only files get its zero-copy path).
- verl's batches travel as their tensors ``<path>@<name>`` and a JSON document, the
  metadata entry under ``<path>``: a DataProto's (:mod:`~hybridflow_client.wire.dataproto`),
  or a TensorDict's under ``__tensordict__`` (:mod:`~hybridflow_client.wire.tensordicts`).
  The header and every document share one JSON value budget, spent on all of them before
  any document is parsed.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import safetensors

from hybridflow_client.wire.dataproto import MEMBER
from hybridflow_client.wire.datatypes import WireTensor, check_shape, from_buffer, itemsize
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.limits import DEFAULT_LIMITS, WireLimits
from hybridflow_client.wire.parts import Builder
from hybridflow_client.wire.strict_json import JsonBudget, loads_strict, parse_counted
from hybridflow_client.wire.tensordicts import build_batch
from hybridflow_client.wire.tensors import to_wire

__all__ = ["build_batches", "decode_safetensors", "encode_safetensors", "read_safetensors", "split_members"]

#: The header key safetensors keeps for string metadata.
_METADATA = "__metadata__"
#: safetensors dtype names and the wire datatypes they are read as; other dtypes
#: (unsigned 16-64 bit, the 8-bit floats) have no wire datatype and are refused.
_DATATYPE_OF_SAFETENSORS = {
    "BOOL": "BOOL", "U8": "UINT8", "I8": "INT8", "I16": "INT16", "I32": "INT32", "I64": "INT64",
    "F16": "FP16", "BF16": "BF16", "F32": "FP32", "F64": "FP64",
}
#: The dtype names the safetensors library's serializer takes, by wire datatype.
_SERIALIZER_DTYPE = {
    "BOOL": "bool", "UINT8": "uint8", "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64",
    "FP16": "float16", "BF16": "bfloat16", "FP32": "float32", "FP64": "float64",
}
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


def encode_safetensors(named: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> bytes:
    """A safetensors body of named tensors (anything :func:`~hybridflow_client.wire.tensors.to_wire`
    takes) and string metadata: each tensor's bytes copied once, into the body."""
    arrays: dict[str, tuple[str, np.ndarray]] = {}
    for name, value in named.items():
        if not isinstance(name, str):
            raise WireError(f"tensor names must be strings, got {name!r}")
        tensor = to_wire(value, repr(name))
        arrays[name] = (tensor.datatype, tensor.array.astype(tensor.array.dtype.newbyteorder("<"), copy=False))
    specs = {
        name: safetensors.TensorSpec(dtype=_SERIALIZER_DTYPE[datatype], shape=list(array.shape),
                                     data_ptr=array.ctypes.data, data_len=array.nbytes)
        for name, (datatype, array) in arrays.items()
    }
    # the arrays stay referenced (in ``arrays``) while the serializer reads their memory
    return bytes(safetensors.serialize(specs, metadata=dict(metadata) if metadata else None))


def _layout(header: Any, data_size: int, limits: WireLimits) -> list[tuple[int, int, str, str, list[int]]]:
    """``(begin, end, name, datatype, shape)`` of every tensor, in data order, with the
    rules of the format checked before any byte is read: known dtypes, shapes within
    ``limits``, each tensor's byte range as long as its shape needs, and the ranges packed
    back to back from 0 to the end of the body, with no gap or overlap."""
    if not isinstance(header, dict):
        raise WireError("safetensors header is not a JSON object")
    count = len(header) - (_METADATA in header)
    if count > limits.max_tensors:
        raise WireError(
            f"safetensors body holds {count} tensors, over the limit of {limits.max_tensors} (limits.max_tensors)"
        )
    entries = []
    for name, entry in header.items():
        if name == _METADATA:
            continue
        label = f"safetensors tensor {name!r:.100}"
        if not isinstance(entry, dict) or not _ENTRY_KEYS <= set(entry):
            raise WireError(f"{label} needs dtype, shape and data_offsets")
        dtype = entry["dtype"]
        datatype = _DATATYPE_OF_SAFETENSORS.get(dtype) if isinstance(dtype, str) else None
        if datatype is None:
            raise WireError(
                f"{label}: dtype {dtype!r:.40} has no wire datatype; use one of {', '.join(_DATATYPE_OF_SAFETENSORS)}"
            )
        shape = check_shape(entry["shape"], label, limits)
        offsets = entry["data_offsets"]
        if not (
            isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
        ):
            raise WireError(f"{label}: data_offsets must be two non-negative integers, got {offsets!r:.80}")
        begin, end = offsets
        needed = math.prod(shape) * itemsize(datatype)
        if end - begin != needed:
            raise WireError(f"{label}: data_offsets {offsets} hold {end - begin} bytes but shape {shape} of {dtype} needs {needed}")
        entries.append((begin, end, name, datatype, shape))
    entries.sort()
    position = 0
    for begin, end, name, _, _ in entries:
        if begin != position:
            raise WireError(
                f"safetensors tensor {name!r:.100} starts at data byte {begin}, not {position} where the one "
                "before it ends (tensors must be packed without gaps or overlaps)"
            )
        position = end
    if position != data_size:
        raise WireError(f"safetensors body has {data_size} bytes of tensor data but its header declares {position}")
    return entries


def read_safetensors(
    body: bytes | bytearray | memoryview, limits: WireLimits = DEFAULT_LIMITS, budget: JsonBudget | None = None
) -> tuple[dict[str, WireTensor], dict[str, str]]:
    """The named tensors of a safetensors body, in data order, and its string metadata;
    a truncated or malformed body, one over ``limits``, or a dtype without a wire datatype
    is a :class:`WireError`. ``budget``: the body's JSON value budget, when its metadata
    documents are to spend from it too."""
    view = memoryview(body).cast("B")
    if len(view) < 8:
        raise WireError(f"safetensors body has {len(view)} bytes, fewer than its 8-byte header length")
    (header_length,) = struct.unpack("<Q", view[:8])
    if header_length > len(view) - 8:
        raise WireError(
            f"safetensors header claims {header_length} bytes but the body has {len(view) - 8} after the length"
        )
    header = loads_strict(view[8 : 8 + header_length], "safetensors header", limits, budget)
    data = view[8 + header_length :]
    layout = _layout(header, len(data), limits)
    metadata = header.get(_METADATA) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise WireError("safetensors metadata must map names to strings")
    named = {
        name: from_buffer(data[begin:end], datatype, shape, f"safetensors tensor {name!r:.100}")
        for begin, end, name, datatype, shape in layout
    }
    return named, metadata


def split_members(
    named: Mapping[str, WireTensor], metadata: Mapping[str, str], limits: WireLimits
) -> tuple[dict[str, WireTensor], dict[str, dict[str, WireTensor]]]:
    """A body's tensors split into plain ones and each batch's (tensors ``<path>@<key>``,
    the document under ``<path>`` in the metadata), by path; nothing parsed."""
    if len(metadata) > limits.max_tensors:
        raise WireError(f"safetensors metadata holds {len(metadata)} batches, over limits.max_tensors")
    plain: dict[str, WireTensor] = {}
    members: dict[str, dict[str, WireTensor]] = {}
    for name, tensor in named.items():
        path, member, key = name.partition(MEMBER)
        if member:
            members.setdefault(path, {})[key] = tensor
        else:
            plain[name] = tensor
    strays = sorted(set(members) - set(metadata))
    if strays:
        raise WireError(f"tensors {strays[0]!r:.100}{MEMBER}... belong to no batch: no metadata names it")
    both = next((path for path in metadata if path in plain), None)
    if both is not None:
        raise WireError(f"{both!r:.100} is both a tensor and a batch")
    return plain, members


def build_batches(
    metadata: Mapping[str, str], members: Mapping[str, Mapping[str, WireTensor]], limits: WireLimits,
    budget: JsonBudget, builder: Builder,
) -> dict[str, Any]:
    """The DataProtos and TensorDicts the metadata describes, made by ``builder``. Every
    document is counted against the body's one budget before any is parsed, so a body
    over it is refused without parsing."""
    counted = {path: budget.spend(text, f"batch {path!r:.100}") for path, text in metadata.items()}
    return {
        path: build_batch(parse_counted(data, f"batch {path!r:.100}"), members.get(path, {}), path, limits, builder)
        for path, data in counted.items()
    }


def decode_safetensors(
    body: bytes | bytearray, limits: WireLimits = DEFAULT_LIMITS, builder: Builder | None = None
) -> dict[str, Any]:
    """Named tensors of a safetensors body, made by ``builder`` (as decoded when None)."""
    named = read_safetensors(body, limits)[0]
    return named if builder is None else {name: builder.tensor(tensor) for name, tensor in named.items()}

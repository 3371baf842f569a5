"""safetensors bodies: a call's keyword arguments out, a call's output in.

- A call body carries keyword arguments only: a tensor under its name, a list's items
  under ``name.0``, ``name.1``, ... (numbers and lists of numbers become tensors with
  ``torch.tensor``'s dtype rules), a DataProto as its tensors ``name@key`` and its JSON
  document in the metadata under ``name``, a TensorDict likewise, its document under
  ``{"__tensordict__": ...}`` (:mod:`hybridflow_client.tensordicts`).
- An output body holds dotted paths under ``output``: list items by index, mapping keys
  percent-escaped (``.`` is ``%2E``, ``%`` is ``%25``, a key of digits has its first digit
  escaped, the empty key is ``%``). It comes back as tensors, lists, and dicts with their
  keys in sorted order (tuples come back as lists).

Bodies are written by ``safetensors.numpy`` and read here with numpy (the header, then one
copy of each tensor's bytes), so that the metadata and BF16 are read too.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from typing import Any

import safetensors
import safetensors.numpy

from hybridflow_client.dataproto import MEMBER, build_dataproto, dataproto_document, is_dataproto
from hybridflow_client.json_codec import dumps_compact
from hybridflow_client.tensordicts import (
    TENSORDICT_MARKER,
    is_tensordict,
    tensordict_document,
    tensordict_from_members,
)
from hybridflow_client.tensors import CodecError, WireTensor, check_shape, from_buffer, to_user, to_wire

__all__ = ["decode_output_body", "encode_call_body", "encode_safetensors", "read_safetensors"]

_METADATA = "__metadata__"
#: safetensors dtype names and the OIP datatypes they are.
_DATATYPE_OF_DTYPE = {
    "BOOL": "BOOL", "U8": "UINT8", "I8": "INT8", "I16": "INT16", "I32": "INT32", "I64": "INT64",
    "F16": "FP16", "BF16": "BF16", "F32": "FP32", "F64": "FP64",
}
_INDEX = re.compile(r"^(0|[1-9][0-9]*)$")
_ESCAPE = re.compile(r"%([0-9A-F]{2})")


def encode_safetensors(named: Mapping[str, WireTensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """A safetensors body of named tensors and string metadata."""
    metadata = dict(metadata) if metadata else None
    if not any(tensor.datatype == "BF16" for tensor in named.values()):
        return safetensors.numpy.save({name: tensor.array for name, tensor in named.items()}, metadata=metadata)
    # numpy has no bfloat16 dtype: BF16 words are handed to the serializer under its name.
    arrays = {name: tensor.array.astype(tensor.array.dtype.newbyteorder("<")) for name, tensor in named.items()}
    specs = {
        name: safetensors.TensorSpec(
            dtype="bfloat16" if named[name].datatype == "BF16" else array.dtype.name,
            shape=list(array.shape), data_ptr=array.ctypes.data, data_len=array.nbytes,
        )
        for name, array in arrays.items()
    }
    return bytes(safetensors.serialize(specs, metadata=metadata))


def read_safetensors(body: bytes) -> tuple[dict[str, WireTensor], dict[str, str]]:
    """The named tensors of a safetensors body and its string metadata."""
    view = memoryview(body).cast("B")
    if len(view) < 8:
        raise CodecError(f"safetensors body has {len(view)} bytes, fewer than its 8-byte header length")
    (length,) = struct.unpack("<Q", view[:8])
    if length > len(view) - 8:
        raise CodecError(f"safetensors header claims {length} bytes but the body has {len(view) - 8}")
    try:
        header = json.loads(bytes(view[8 : 8 + length]))
    except ValueError as exc:
        raise CodecError(f"safetensors header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CodecError("safetensors header is not a JSON object")
    data = view[8 + length :]
    metadata = header.pop(_METADATA, None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CodecError("safetensors metadata must map names to strings")
    named = {}
    for name, entry in header.items():
        label = f"safetensors tensor {name!r:.100}"
        if not isinstance(entry, dict) or entry.get("dtype") not in _DATATYPE_OF_DTYPE:
            raise CodecError(f"{label}: dtype {entry.get('dtype') if isinstance(entry, dict) else None!r:.40} "
                             "has no wire datatype")
        offsets = entry.get("data_offsets")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= len(data)):
            raise CodecError(f"{label}: data_offsets {offsets!r:.80} do not fit {len(data)} bytes of data")
        datatype, shape = _DATATYPE_OF_DTYPE[entry["dtype"]], check_shape(entry.get("shape"), label)
        named[name] = from_buffer(data[offsets[0] : offsets[1]], datatype, shape, label)
    return named, metadata


# -- calls -------------------------------------------------------------------------------


def _argument_name(name: Any) -> str:
    if not isinstance(name, str) or not name.isidentifier():
        raise CodecError(f"keyword {name!r} is not a valid argument name")
    return name


def encode_call_body(kwargs: Mapping[str, Any]) -> bytes:
    """A safetensors call body of keyword arguments (see the module docstring)."""
    named: dict[str, WireTensor] = {}
    metadata: dict[str, str] = {}
    for name, value in kwargs.items():
        name = _argument_name(name)
        if is_dataproto(value):
            document, tensors = dataproto_document(value, f"argument {name!r}")
            metadata[name] = dumps_compact(document).decode()
            named.update({f"{name}{MEMBER}{key}": tensor for key, tensor in tensors.items()})
        elif is_tensordict(value):
            document, tensors = tensordict_document(value, f"argument {name!r}")
            metadata[name] = dumps_compact({TENSORDICT_MARKER: document}).decode()
            named.update({f"{name}{MEMBER}{key}": tensor for key, tensor in tensors.items()})
        elif isinstance(value, (list, tuple)):
            if not value:
                raise CodecError(f"argument {name!r} is an empty list, which safetensors cannot carry")
            named.update({f"{name}.{i}": to_wire(item, f"argument {name}[{i}]") for i, item in enumerate(value)})
        else:
            named[name] = to_wire(value, f"argument {name!r}")
    return encode_safetensors(named, metadata)


# -- outputs -----------------------------------------------------------------------------


def _unescape(part: str) -> str:
    return "" if part == "%" else _ESCAPE.sub(lambda match: chr(int(match.group(1), 16)), part)


class _Leaf:
    """A decoded value in the tree of paths (a dict there is always a container)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def decode_output_body(body: bytes, prefix: str = "output", dataproto_type: type | None = None) -> Any:
    """The output of a safetensors answer: a tensor, or lists and dicts of them (and of
    DataProtos, built with ``dataproto_type``: see :mod:`hybridflow_client.dataproto`, and
    of TensorDicts)."""
    named, metadata = read_safetensors(body)
    members: dict[str, dict[str, WireTensor]] = {path: {} for path in metadata}
    leaves: dict[str, Any] = {}
    for name, tensor in named.items():
        path, _, key = name.partition(MEMBER)
        if path in members and key:
            members[path][key] = tensor
        else:
            leaves[name] = to_user(tensor)
    for path, text in metadata.items():
        try:
            document = json.loads(text)
        except ValueError as exc:
            raise CodecError(f"batch {path!r:.100}: its document is not JSON: {exc}") from None
        if isinstance(document, dict) and set(document) == {TENSORDICT_MARKER}:
            leaves[path] = tensordict_from_members(document[TENSORDICT_MARKER], members[path], path)
        else:
            leaves[path] = build_dataproto(document, members[path], path, dataproto_type)
    if not leaves:
        raise CodecError("the answer holds no tensors")
    if prefix in leaves:
        if len(leaves) > 1:
            raise CodecError(f"{prefix!r} is both a tensor and a container")
        return leaves[prefix]
    tree: dict[str, Any] = {}
    for name, leaf in leaves.items():
        if not name.startswith(prefix + "."):
            raise CodecError(f"tensor name {name!r:.100} is not under {prefix!r}")
        *parents, last = name[len(prefix) + 1 :].split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
            if isinstance(node, _Leaf):
                raise CodecError(f"{name!r:.100} nests under a tensor")
        if last in node:
            raise CodecError(f"{name!r:.100} is both a tensor and a container")
        node[last] = _Leaf(leaf)
    return _build(tree, prefix)


def _build(node: dict[str, Any], path: str) -> Any:
    values = {
        part: child.value if isinstance(child, _Leaf) else _build(child, f"{path}.{part}")
        for part, child in node.items()
    }
    indexed = [bool(_INDEX.match(part)) for part in values]
    if all(indexed):
        if set(values) != {str(i) for i in range(len(values))}:
            raise CodecError(f"{path}: list items do not run from 0 with no gap")
        return [values[str(i)] for i in range(len(values))]
    if any(indexed):
        raise CodecError(f"{path} mixes list indices and mapping keys")
    return {_unescape(part): values[part] for part in sorted(values)}


"""safetensors bodies: a call's keyword arguments in, a method's output out.

- Calls (:func:`pack_call`) carry keyword arguments only: a tensor under its name, a list
  under ``name.0``, ``name.1``, ... Numbers and numpy arrays are sent as tensors
  (``torch.tensor(value)``'s dtype rules), so they come back as tensors.
- Outputs (:func:`pack_output`) use dotted paths under ``output``: list items by index,
  mapping keys percent-escaped (``.`` is ``%2E``, ``%`` is ``%25``, a key made only of
  digits has its first digit escaped, the empty key is ``%``) so that keys such as
  ``gate_up_proj.weight`` survive the round trip. Tuples come back as lists.
- Decoding reads the header first and checks the number of tensors and every shape
  against :class:`wire.limits.WireLimits` before the tensors are loaded; list indices are
  checked in work proportional to the number of tensors, never to an index's value. The
  header and every DataProto document in it share one JSON value budget, spent on all of
  them before any document is parsed, and a call's names are checked before that.
- verl's batches travel as their tensors ``<path>@<name>`` and a JSON document, the
  metadata entry under ``<path>``: a DataProto's (:mod:`wire.dataproto`), or a TensorDict's
  under ``__tensordict__`` (:mod:`wire.tensordicts`).
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np
import torch

from hybridflow.wire.dataproto import MEMBER
from hybridflow.wire.dtypes import (
    check_shape,
    datatype_of,
    itemsize,
    numpy_to_torch,
    plain_cpu,
    tensor_from_buffer,
)
from hybridflow.wire.errors import TooLargeForLoop, WireError
from hybridflow.wire.json_tensors import is_json_tensor, json_to_tensor, type_name
from hybridflow.wire.limits import DEFAULT_LIMITS, WireLimits
from hybridflow.wire.strict_json import JsonBudget, dumps_compact, loads_strict, parse_counted
from hybridflow.wire.tensordicts import batch_document, build_batch

__all__ = [
    "decode_call_body",
    "decode_output_body",
    "decode_safetensors",
    "encode_call_body",
    "encode_output_body",
    "encode_safetensors",
    "pack_call",
    "pack_output",
    "unpack_call",
    "unpack_output",
]

T = TypeVar("T")

_KEYWORD_ITEM = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\.(0|[1-9][0-9]*)$")
_INDEX = re.compile(r"^(0|[1-9][0-9]*)$")
_ESCAPE = re.compile(r"%([0-9A-F]{2})")
#: The header key safetensors keeps for string metadata.
_METADATA = "__metadata__"


def encode_safetensors(named: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """A safetensors body of named tensors (detached, on CPU, contiguous; tensors that
    share memory are copied, as the format needs one owner per byte range)."""
    from safetensors.torch import save

    plain: dict[str, torch.Tensor] = {}
    owners: set[int] = set()
    for name, tensor in named.items():
        if not isinstance(name, str):
            raise WireError(f"tensor names must be strings, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise WireError(f"{name!r} is a {type(tensor).__name__}, not a tensor")
        tensor = plain_cpu(tensor, repr(name)).contiguous()
        if tensor.numel():
            storage = tensor.untyped_storage()
            if storage.data_ptr() in owners or storage.nbytes() != tensor.nbytes:
                tensor = tensor.clone()  # a view of a larger buffer, or the same buffer twice
            owners.add(tensor.untyped_storage().data_ptr())
        plain[name] = tensor
    return save(plain, metadata=dict(metadata) if metadata else None)


#: safetensors dtype names and the wire datatypes they are read as; other dtypes
#: (unsigned 16-64 bit, the 8-bit floats) have no wire datatype and are refused.
_DATATYPE_OF_SAFETENSORS = {
    "BOOL": "BOOL", "U8": "UINT8", "I8": "INT8", "I16": "INT16", "I32": "INT32", "I64": "INT64",
    "F16": "FP16", "BF16": "BF16", "F32": "FP32", "F64": "FP64",
}
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


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


def _read(
    body: bytes | bytearray, limits: WireLimits, budget: JsonBudget | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The named tensors of a safetensors body and its string metadata. The tensors are
    views of a writable body (a request read into a bytearray), copies of a read-only one.
    safetensors' own ``load`` copies every tensor out of an in-memory body (only files get
    its zero-copy path), so the body is read here, by the format's rules, with numpy."""
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
        name: tensor_from_buffer(data[begin:end], datatype, shape, f"safetensors tensor {name!r:.100}")
        for begin, end, name, datatype, shape in layout
    }
    return named, metadata


def decode_safetensors(body: bytes | bytearray, limits: WireLimits = DEFAULT_LIMITS) -> dict[str, torch.Tensor]:
    """Named tensors of a safetensors body; a truncated or malformed body, one over
    ``limits``, or a dtype without a wire datatype raises :class:`WireError`."""
    return _read(body, limits)[0]


def _members(
    named: Mapping[str, torch.Tensor], metadata: Mapping[str, str], limits: WireLimits
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """A body's tensors split into plain ones and each batch's (tensors ``<path>@<key>``,
    the document under ``<path>`` in the metadata), by path; nothing parsed."""
    if len(metadata) > limits.max_tensors:
        raise WireError(f"safetensors metadata holds {len(metadata)} batches, over limits.max_tensors")
    plain: dict[str, torch.Tensor] = {}
    members: dict[str, dict[str, torch.Tensor]] = {}
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


def _build_dataprotos(
    metadata: Mapping[str, str], members: Mapping[str, Mapping[str, torch.Tensor]], limits: WireLimits,
    budget: JsonBudget,
) -> dict[str, Any]:
    """The DataProtos and TensorDicts the metadata describes. Every document is counted
    against the body's one budget before any is parsed, so a body over it is refused
    without parsing."""
    counted = {path: budget.spend(text, f"batch {path!r:.100}") for path, text in metadata.items()}
    return {
        path: build_batch(parse_counted(data, f"batch {path!r:.100}"), members.get(path, {}), path, limits)
        for path, data in counted.items()
    }


def _in_index_order(items: Mapping[str, T], name: str, label: str) -> list[T]:
    """Items keyed by decimal indices without leading zeros, in index order; the indices
    must be exactly 0..n-1. An index with more digits than n - 1 is out of range without
    being converted, so the work is proportional to the number of items."""
    count = len(items)
    width = len(str(count - 1))
    present = sorted(int(index) for index in items if len(index) <= width and int(index) < count)
    if len(present) == count:  # n distinct indices below n: exactly 0..n-1
        return [items[str(i)] for i in range(count)]
    missing = next((i for i, index in enumerate(present) if index != i), len(present))
    raise WireError(f"{label}: items {name}.N do not run from 0 with no gap (missing {name}.{missing})")


def _as_tensor(value: Any, label: str) -> torch.Tensor:
    """A tensor from a tensor, numpy array, number or (nested) list of numbers."""
    if isinstance(value, torch.Tensor):
        return plain_cpu(value, label)
    if isinstance(value, np.ndarray):
        return numpy_to_torch(value, label)
    if is_json_tensor(value):
        return json_to_tensor(value, label)
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, (bool, int, float)) or isinstance(value, list):
        try:
            tensor = torch.tensor(value)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise WireError(f"{label}: cannot make a tensor of {value!r:.80}: {exc}") from None
        datatype_of(tensor.dtype, label)
        return tensor
    raise WireError(
        f"{label} is a {type(value).__name__}; safetensors calls carry only tensors, numbers, "
        "and lists of them (send other values as JSON)"
    )


def pack_call(kwargs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Keyword arguments as named tensors for a safetensors call body: a tensor (or numpy
    array, number, JSON tensor object) under its name, a list or tuple under ``name.0``,
    ``name.1``, ... (each item converted likewise; a list of numbers gives one 0-d tensor
    per item, so ``x=[1, 1, 1, 1]`` is four items, as the tutorial's execute_all needs)."""
    named: dict[str, torch.Tensor] = {}
    for name, value in kwargs.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise WireError(f"keyword {name!r} is not a valid argument name")
        if isinstance(value, (list, tuple)):
            if not value:
                raise WireError(f"argument {name!r} is an empty list, which safetensors cannot carry")
            for i, item in enumerate(value):
                named[f"{name}.{i}"] = _as_tensor(item, f"argument {name}[{i}]")
        else:
            named[name] = _as_tensor(value, f"argument {name!r}")
    return named


def unpack_call(named: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Keyword arguments from a safetensors call body (the inverse of :func:`pack_call`):
    ``x`` is a tensor; ``x.0`` .. ``x.N`` is a list, whose indices must run from 0 with no
    gap; any other name is an error."""
    kwargs: dict[str, Any] = {}
    lists: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named.items():
        match = _KEYWORD_ITEM.match(name)
        if match:
            lists.setdefault(match.group(1), {})[match.group(2)] = tensor
        elif name.isidentifier():
            kwargs[name] = tensor
        else:
            raise WireError(
                f"tensor name {name!r:.100} is neither an argument name nor a list item such as 'x.0'"
            )
    for base, items in lists.items():
        if base in kwargs:
            raise WireError(f"argument {base!r} is given both as a tensor and as list items {base}.N")
        kwargs[base] = _in_index_order(items, base, f"list argument {base!r}")
    return kwargs


def encode_call_body(kwargs: Mapping[str, Any]) -> bytes:
    """A safetensors call body of keyword arguments: :func:`pack_call`'s tensors, and each
    DataProto or TensorDict argument as its tensors (``name@key``) and its JSON document
    (the metadata under ``name``)."""
    plain, named, metadata = {}, {}, {}
    for name, value in kwargs.items():
        batch = batch_document(value, f"argument {name!r}")
        if batch is not None:
            if not isinstance(name, str) or not name.isidentifier():
                raise WireError(f"keyword {name!r} is not a valid argument name")
            document, tensors = batch
            metadata[name] = dumps_compact(document).decode()
            named.update({f"{name}{MEMBER}{key}": tensor for key, tensor in tensors.items()})
        else:
            plain[name] = value
    named.update(pack_call(plain))
    return encode_safetensors(named, metadata)


def decode_call_body(body: bytes | bytearray, limits: WireLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Keyword arguments of a safetensors call body (:func:`encode_call_body`'s inverse).
    Every name is checked before any batch's document is parsed."""
    budget = JsonBudget(limits)
    named, metadata = _read(body, limits, budget)
    plain, members = _members(named, metadata, limits)
    kwargs = unpack_call(plain)
    for name in metadata:
        if not name.isidentifier():
            raise WireError(f"batch argument {name!r:.100} is not a valid argument name")
        if name in kwargs:
            raise WireError(f"argument {name!r} is given both as a batch and as tensors")
    kwargs.update(_build_dataprotos(metadata, members, limits, budget))
    return kwargs


def _escape_key(key: Any, where: str) -> str:
    if not isinstance(key, str):
        if isinstance(key, bool) or not isinstance(key, int):
            raise WireError(f"{where}: key {key!r} is not a string")
        key = str(key)
    if key == "":
        return "%"
    escaped = key.replace("%", "%25").replace(".", "%2E")
    if escaped.isdigit():
        escaped = f"%{ord(escaped[0]):02X}{escaped[1:]}"
    return escaped


def _unescape_key(part: str) -> str:
    if part == "%":
        return ""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), part)


def pack_output(
    output: Any, prefix: str = "output", limits: WireLimits = DEFAULT_LIMITS, metadata: dict[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """A collected output as named tensors for a safetensors answer: a tensor (or numpy
    array, or number) is ``output``; list items are ``output.0``, ``output.1``, ...; mapping
    values are ``output.<escaped key>``, recursively (``output.0.gate_up_proj%2Eweight``);
    a DataProto at a path is its tensors ``<path>@<key>`` and its document in
    ``metadata[<path>]`` (give a dict to fill). None, strings, other objects and empty
    containers raise :class:`WireError`."""
    named: dict[str, torch.Tensor] = {}
    _pack(output, prefix, named, 0, limits.max_depth, metadata)
    return named


def encode_output_body(output: Any, limits: WireLimits = DEFAULT_LIMITS, loop_bytes: int | None = None) -> bytes:
    """A safetensors answer of a collected output (DataProtos and TensorDicts included);
    :class:`TooLargeForLoop` before any byte is copied when its tensors hold more than
    ``loop_bytes``."""
    metadata: dict[str, str] = {}
    named = pack_output(output, limits=limits, metadata=metadata)
    if loop_bytes is not None and sum(t.numel() * t.element_size() for t in named.values()) > loop_bytes:
        raise TooLargeForLoop()
    return encode_safetensors(named, metadata)


def decode_output_body(body: bytes, prefix: str = "output", limits: WireLimits = DEFAULT_LIMITS) -> Any:
    """The output of a safetensors answer (:func:`encode_output_body`'s inverse)."""
    budget = JsonBudget(limits)
    named, metadata = _read(body, limits, budget)
    plain, members = _members(named, metadata, limits)
    return unpack_output({**plain, **_build_dataprotos(metadata, members, limits, budget)}, prefix, limits)


def _pack(
    value: Any, path: str, named: dict[str, torch.Tensor], depth: int, max_depth: int, metadata: dict | None
) -> None:
    if depth > max_depth:
        raise WireError(f"{path}: nests deeper than {max_depth} levels")
    if (batch := batch_document(value, path)) is not None:  # first: a TensorDict is a Mapping
        if metadata is None:
            raise WireError(f"{path} is a batch: encode the answer with encode_output_body")
        document, tensors = batch
        metadata[path] = dumps_compact(document).decode()
        named.update({f"{path}{MEMBER}{key}": tensor for key, tensor in tensors.items()})
    elif isinstance(value, (list, tuple)):
        if not value:
            raise WireError(f"{path} is an empty list, which safetensors cannot carry")
        for i, item in enumerate(value):
            _pack(item, f"{path}.{i}", named, depth + 1, max_depth, metadata)
    elif isinstance(value, Mapping):
        if not value:
            raise WireError(f"{path} is an empty mapping, which safetensors cannot carry")
        for key, item in value.items():
            _pack(item, f"{path}.{_escape_key(key, path)}", named, depth + 1, max_depth, metadata)
    elif isinstance(value, (torch.Tensor, np.ndarray, np.generic, bool, int, float)):
        named[path] = _as_tensor(value, path)
    else:
        raise WireError(f"{path} is {type_name(value)}, which safetensors cannot carry")


def unpack_output(
    named: Mapping[str, torch.Tensor], prefix: str = "output", limits: WireLimits = DEFAULT_LIMITS
) -> Any:
    """The output :func:`pack_output` packed: a tensor, or lists and dicts of tensors
    (dict keys in sorted order: safetensors does not keep the original order)."""
    if not named:
        raise WireError("the answer holds no tensors")
    tree: dict[str, Any] = {}
    leaf = object()
    root: Any = None
    for name, tensor in named.items():
        if name == prefix:
            root = tensor
            continue
        if not name.startswith(prefix + "."):
            raise WireError(f"tensor name {name!r:.100} is not under {prefix!r}")
        node = tree
        parts = name[len(prefix) + 1 :].split(".")
        if len(parts) > limits.max_depth:
            raise WireError(f"tensor name {name!r:.100} nests deeper than {limits.max_depth} levels")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise WireError(f"{name!r} nests under a tensor of the same name")
            node = child
        if parts[-1] in node:
            raise WireError(f"{name!r} is both a tensor and a container")
        node[parts[-1]] = (leaf, tensor)
    if root is not None:
        if tree:
            raise WireError(f"{prefix!r} is both a tensor and a container")
        return root

    def build(node: dict[str, Any], path: str) -> Any:
        values = {
            part: child[1] if isinstance(child, tuple) and child[0] is leaf else build(child, f"{path}.{part}")
            for part, child in node.items()
        }
        indexed = [bool(_INDEX.match(part)) for part in values]
        if all(indexed):
            return _in_index_order(values, path, path)
        if any(indexed):
            raise WireError(f"{path} mixes list indices and mapping keys")
        return {_unescape_key(part): values[part] for part in sorted(values)}

    return build(tree, prefix)

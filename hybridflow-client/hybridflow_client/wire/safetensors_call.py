"""The safetensors format of calls and answers (``application/x-safetensors``).

- A call (:func:`encode_call_body`) carries keyword arguments only: a tensor under its
  name, a list under ``name.0``, ``name.1``, ... (numbers and lists of numbers become
  tensors with ``torch.tensor``'s dtype rules, so ``x=[1, 1, 1, 1]`` is four 0-d tensors,
  as the tutorial's execute_all needs), a DataProto or TensorDict as its tensors
  ``name@key`` and its document in the metadata under ``name``.
- An answer (:func:`encode_output_body`) holds dotted paths under ``output``: list items by
  index, mapping keys percent-escaped (``.`` is ``%2E``, ``%`` is ``%25``, a key made only
  of digits has its first digit escaped, the empty key is ``%``) so that keys such as
  ``gate_up_proj.weight`` survive; batches at their paths as in a call. It comes back as
  tensors, lists, and dicts with their keys in sorted order (tuples come back as lists).
- Decoding reads the body by :mod:`~hybridflow_client.wire.safetensors_body`'s rules; list
  indices are checked in work proportional to the number of tensors, never to an index's
  value, and a call's names are checked before any batch's document is parsed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from hybridflow_client.wire.builders import CLIENT_BUILDER
from hybridflow_client.wire.dataproto import MEMBER
from hybridflow_client.wire.datatypes import WireTensor
from hybridflow_client.wire.errors import TooLargeForLoop, WireError
from hybridflow_client.wire.formats import SAFETENSORS
from hybridflow_client.wire.json_values import type_name
from hybridflow_client.wire.limits import CLIENT_LIMITS, DEFAULT_LIMITS, WireLimits
from hybridflow_client.wire.parts import Builder
from hybridflow_client.wire.safetensors_body import (
    build_batches,
    encode_safetensors,
    read_safetensors,
    split_members,
)
from hybridflow_client.wire.strict_json import JsonBudget, dumps_compact
from hybridflow_client.wire.tensor_objects import is_json_tensor
from hybridflow_client.wire.tensordicts import batch_document
from hybridflow_client.wire.tensors import is_tensor, tensor_nbytes, to_wire

__all__ = [
    "FORMAT",
    "SafetensorsCall",
    "decode_call_body",
    "decode_output_body",
    "encode_call_body",
    "encode_output_body",
    "pack_call",
    "pack_output",
    "unpack_call",
    "unpack_output",
]

T = TypeVar("T")

_KEYWORD_ITEM = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\.(0|[1-9][0-9]*)$")
_INDEX = re.compile(r"^(0|[1-9][0-9]*)$")
_ESCAPE = re.compile(r"%([0-9A-F]{2})")
#: What a safetensors body carries as one tensor (numbers become 0-d tensors).
_TENSOR_LIKE = (WireTensor, np.ndarray, np.generic, bool, int, float)


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


# -- calls -------------------------------------------------------------------------------


def _argument_tensor(value: Any, label: str) -> WireTensor:
    if not (isinstance(value, (*_TENSOR_LIKE, list, tuple)) or is_tensor(value) or is_json_tensor(value)):
        raise WireError(
            f"{label} is a {type(value).__name__}; safetensors calls carry only tensors, numbers, "
            "and lists of them (send other values as JSON)"
        )
    return to_wire(value, label)


def pack_call(kwargs: Mapping[str, Any]) -> dict[str, WireTensor]:
    """Keyword arguments as named tensors for a safetensors call body: a tensor (or numpy
    array, number, JSON tensor object) under its name, a list or tuple under ``name.0``,
    ``name.1``, ... (each item converted likewise)."""
    named: dict[str, WireTensor] = {}
    for name, value in kwargs.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise WireError(f"keyword {name!r} is not a valid argument name")
        if isinstance(value, (list, tuple)):
            if not value:
                raise WireError(f"argument {name!r} is an empty list, which safetensors cannot carry")
            for i, item in enumerate(value):
                named[f"{name}.{i}"] = _argument_tensor(item, f"argument {name}[{i}]")
        else:
            named[name] = _argument_tensor(value, f"argument {name!r}")
    return named


def unpack_call(named: Mapping[str, T]) -> dict[str, T | list[T]]:
    """Keyword arguments from a safetensors call body's tensors (the inverse of
    :func:`pack_call`): ``x`` is a tensor; ``x.0`` .. ``x.N`` is a list, whose indices must
    run from 0 with no gap; any other name is an error."""
    kwargs: dict[str, Any] = {}
    lists: dict[str, dict[str, T]] = {}
    for name, tensor in named.items():
        match = _KEYWORD_ITEM.match(name)
        if match:
            lists.setdefault(match.group(1), {})[match.group(2)] = tensor
        elif name.isidentifier():
            kwargs[name] = tensor
        else:
            raise WireError(f"tensor name {name!r:.100} is neither an argument name nor a list item such as 'x.0'")
    for base, items in lists.items():
        if base in kwargs:
            raise WireError(f"argument {base!r} is given both as a tensor and as list items {base}.N")
        kwargs[base] = _in_index_order(items, base, f"list argument {base!r}")
    return kwargs


def encode_call_body(kwargs: Mapping[str, Any], limits: WireLimits = CLIENT_LIMITS) -> bytes:
    """A safetensors call body of keyword arguments: :func:`pack_call`'s tensors, and each
    DataProto or TensorDict argument as its tensors (``name@key``) and its JSON document
    (the metadata under ``name``)."""
    plain, named, metadata = {}, {}, {}
    for name, value in kwargs.items():
        batch = batch_document(value, f"argument {name!r}", limits)
        if batch is not None:
            if not isinstance(name, str) or not name.isidentifier():
                raise WireError(f"keyword {name!r} is not a valid argument name")
            document, tensors = batch
            metadata[name] = dumps_compact(document).decode()
            named.update({f"{name}{MEMBER}{key}": to_wire(t, f"{name}{MEMBER}{key}") for key, t in tensors.items()})
        else:
            plain[name] = value
    named.update(pack_call(plain))
    return encode_safetensors(named, metadata)


def _built(value: Any, builder: Builder) -> Any:
    return [builder.tensor(item) for item in value] if isinstance(value, list) else builder.tensor(value)


def decode_call_body(
    body: bytes | bytearray, limits: WireLimits = DEFAULT_LIMITS, builder: Builder = CLIENT_BUILDER
) -> dict[str, Any]:
    """Keyword arguments of a safetensors call body (:func:`encode_call_body`'s inverse),
    made by ``builder``. Every name is checked before any batch's document is parsed."""
    budget = JsonBudget(limits)
    named, metadata = read_safetensors(body, limits, budget)
    plain, members = split_members(named, metadata, limits)
    kwargs = {name: _built(value, builder) for name, value in unpack_call(plain).items()}
    for name in metadata:
        if not name.isidentifier():
            raise WireError(f"batch argument {name!r:.100} is not a valid argument name")
        if name in kwargs:
            raise WireError(f"argument {name!r} is given both as a batch and as tensors")
    kwargs.update(build_batches(metadata, members, limits, budget, builder))
    return kwargs


# -- answers -----------------------------------------------------------------------------


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
) -> dict[str, Any]:
    """A collected output as named tensors (as the output holds them) for a safetensors
    answer: a tensor (or numpy array, or number) is ``output``; list items are
    ``output.0``, ``output.1``, ...; mapping values ``output.<escaped key>``, recursively
    (``output.0.gate_up_proj%2Eweight``); a DataProto or TensorDict at a path is its
    tensors ``<path>@<key>`` and its document in ``metadata[<path>]`` (give a dict to
    fill). None, strings, other objects and empty containers raise :class:`WireError`."""
    named: dict[str, Any] = {}
    _pack(output, prefix, named, 0, limits, metadata)
    return named


def _pack(value: Any, path: str, named: dict[str, Any], depth: int, limits: WireLimits, metadata: dict | None) -> None:
    if depth > limits.max_depth:
        raise WireError(f"{path}: nests deeper than {limits.max_depth} levels")
    if (batch := batch_document(value, path, limits)) is not None:  # first: a TensorDict is a Mapping
        if metadata is None:
            raise WireError(f"{path} is a batch: encode the answer with encode_output_body")
        document, tensors = batch
        metadata[path] = dumps_compact(document).decode()
        named.update({f"{path}{MEMBER}{key}": tensor for key, tensor in tensors.items()})
    elif isinstance(value, _TENSOR_LIKE) or is_tensor(value):
        named[path] = value
    elif isinstance(value, (list, tuple)):
        if not value:
            raise WireError(f"{path} is an empty list, which safetensors cannot carry")
        for i, item in enumerate(value):
            _pack(item, f"{path}.{i}", named, depth + 1, limits, metadata)
    elif isinstance(value, Mapping):
        if not value:
            raise WireError(f"{path} is an empty mapping, which safetensors cannot carry")
        for key, item in value.items():
            _pack(item, f"{path}.{_escape_key(key, path)}", named, depth + 1, limits, metadata)
    else:
        raise WireError(f"{path} is {type_name(value)}, which safetensors cannot carry")


def encode_output_body(output: Any, limits: WireLimits = DEFAULT_LIMITS, loop_bytes: int | None = None) -> bytes:
    """A safetensors answer of a collected output (DataProtos and TensorDicts included);
    :class:`TooLargeForLoop` before any tensor is converted or copied when its tensors
    hold more than ``loop_bytes``."""
    metadata: dict[str, str] = {}
    named = pack_output(output, limits=limits, metadata=metadata)
    if loop_bytes is not None and sum(tensor_nbytes(value) for value in named.values()) > loop_bytes:
        raise TooLargeForLoop()
    return encode_safetensors({path: to_wire(value, path) for path, value in named.items()}, metadata)


def unpack_output(named: Mapping[str, Any], prefix: str = "output", limits: WireLimits = DEFAULT_LIMITS) -> Any:
    """The output :func:`pack_output` packed: a value, or lists and dicts of them (dict
    keys in sorted order: safetensors does not keep the original order)."""
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
                raise WireError(f"{name!r:.100} nests under a tensor of the same name")
            node = child
        if parts[-1] in node:
            raise WireError(f"{name!r:.100} is both a tensor and a container")
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


def decode_output_body(
    body: bytes | bytearray, prefix: str = "output", limits: WireLimits = DEFAULT_LIMITS,
    builder: Builder = CLIENT_BUILDER,
) -> Any:
    """The output of a safetensors answer (:func:`encode_output_body`'s inverse), made by
    ``builder``."""
    budget = JsonBudget(limits)
    named, metadata = read_safetensors(body, limits, budget)
    plain, members = split_members(named, metadata, limits)
    batches = build_batches(metadata, members, limits, budget, builder)
    return unpack_output({**{name: builder.tensor(t) for name, t in plain.items()}, **batches}, prefix, limits)


class SafetensorsCall:
    """The safetensors format (:class:`~hybridflow_client.wire.formats.CallFormat`): keyword
    arguments only; an answer carries the output alone."""

    media_type = SAFETENSORS

    def encode_call(self, args: Sequence[Any], kwargs: Mapping[str, Any], limits: WireLimits = CLIENT_LIMITS) -> bytes:
        if args:
            raise WireError("a binary (safetensors) call carries keyword arguments only: pass them by name, e.g. x=[x]")
        return encode_call_body(kwargs, limits)

    def decode_call(self, body: bytes | bytearray, limits: WireLimits, builder: Builder) -> tuple[list, dict]:
        return [], decode_call_body(body, limits, builder)

    def encode_answer(
        self, output: Any, envelope: Mapping[str, Any], limits: WireLimits, loop_bytes: int | None = None
    ) -> bytes:
        return encode_output_body(output, limits, loop_bytes)

    def decode_answer(self, body: bytes | bytearray, limits: WireLimits, builder: Builder) -> dict[str, Any]:
        return {"output": decode_output_body(body, "output", limits, builder)}


FORMAT = SafetensorsCall()

"""Values in JSON bodies: walking a call's arguments or an output's nested values to
encode or decode the tensors and batches in them.

- Encoding (:func:`encode_json_value`): tensors (torch, numeric numpy) become OIP tensor
  objects (:mod:`~hybridflow_client.wire.tensor_objects`); numpy scalars plain numbers;
  tuples lists; non-finite floats the strings "NaN", "Infinity", "-Infinity"; mapping keys
  strings; a DataProto ``{"__dataproto__": ...}``; a TensorDict ``{"__tensordict__": ...}``;
  any other object ``{"type": "module.Class", "repr": "..."}`` (repr cut to
  :data:`MAX_REPR_CHARS`).
- Decoding (:func:`decode_json_value`): tensor objects, at any depth, become the side's
  tensors, DataProto and TensorDict objects its batches (a
  :class:`~hybridflow_client.wire.parts.Builder` makes them); everything else is left as
  it is. The tensors, values and depth are counted against the limits first.
- :func:`json_value_count` tells, without encoding, how large an answer's JSON would be.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hybridflow_client.wire.builders import CLIENT_BUILDER
from hybridflow_client.wire.dataproto import JSON_MARKER, build_dataproto, dataproto_document, is_dataproto
from hybridflow_client.wire.datatypes import WireTensor, spell_float
from hybridflow_client.wire.errors import AnswerTooLarge, TooLargeForLoop, WireError
from hybridflow_client.wire.limits import DEFAULT_LIMITS, WireLimits
from hybridflow_client.wire.parts import Builder
from hybridflow_client.wire.tensor_objects import from_json, is_json_tensor, tensor_object
from hybridflow_client.wire.tensordicts import (
    TENSORDICT_MARKER,
    build_tensordict,
    is_tensordict,
    map_tensor_leaves,
    tensordict_document,
)
from hybridflow_client.wire.tensors import element_count, is_tensor, to_wire

__all__ = [
    "MAX_REPR_CHARS",
    "check_json_output",
    "decode_json_value",
    "encode_json_value",
    "json_value_count",
    "type_name",
]

#: Longest repr kept for a value that has no JSON form.
MAX_REPR_CHARS = 10_000


# -- decoding ----------------------------------------------------------------------------


def _census(value: Any, where: str, limits: WireLimits) -> None:
    """Count the tensor objects and values of decoded JSON, and its depth, before anything
    is built; stop at the first limit passed. Work is one step per value."""
    tensors, values = 0, 1
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, Mapping):
            if is_json_tensor(node):
                tensors += 1
                if tensors > limits.max_tensors:
                    raise WireError(f"{where} holds more than {limits.max_tensors} tensors (limits.max_tensors)")
            children = node.values()
        else:
            children = node
        values += len(children)
        if values > limits.max_json_values:
            raise WireError(
                f"{where} holds more than {limits.max_json_values} values (limits.max_json_values); "
                "send large tensors as safetensors or OIP binary data"
            )
        for child in children:
            if isinstance(child, (list, tuple, Mapping)):
                if depth + 1 > limits.max_depth:
                    raise WireError(f"{where}: nests deeper than {limits.max_depth} levels")
                stack.append((child, depth + 1))


def decode_json_value(
    value: Any, where: str = "value", limits: WireLimits = DEFAULT_LIMITS, builder: Builder = CLIENT_BUILDER
) -> Any:
    """Parsed JSON with every tensor object (at any depth of lists and objects) and every
    batch made into the side's values by ``builder``; everything else is returned as it
    is. ``where`` prefixes error messages, e.g. ``kwargs.x[1]: data has 3 values but shape
    [2, 2] needs 4``. The tensors, values and depth are checked against ``limits`` first."""
    if isinstance(value, (list, tuple, Mapping)):
        _census(value, where, limits)
    return _Decoder(limits, builder).decode(value, where)


class _Decoder:
    def __init__(self, limits: WireLimits, builder: Builder) -> None:
        self.limits, self.builder = limits, builder

    def decode(self, value: Any, where: str) -> Any:
        if is_json_tensor(value):
            return self.builder.tensor(from_json(value, where, self.limits))
        if isinstance(value, Mapping) and set(value) == {JSON_MARKER}:
            return self.dataproto(value[JSON_MARKER], where)
        if isinstance(value, Mapping) and set(value) == {TENSORDICT_MARKER}:
            return build_tensordict(value[TENSORDICT_MARKER], self.leaf, where, self.limits, self.builder)
        if isinstance(value, list):
            return [self.decode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            return {k: self.decode(v, f"{where}.{k}") for k, v in value.items()}
        return value

    def dataproto(self, document: Any, where: str) -> Any:
        """A DataProto from its JSON form: the document with ``batch`` mapping each
        tensor's name to its tensor object."""
        if not isinstance(document, Mapping) or not isinstance(document.get("batch"), Mapping):
            raise WireError(f"{where}: a DataProto's batch must map names to tensor objects")
        batch = document["batch"]
        tensors = {name: from_json(obj, f"{where}.batch.{name}", self.limits) for name, obj in batch.items()}
        return build_dataproto({**document, "batch": list(batch)}, tensors, where, self.limits, self.builder)

    def leaf(self, obj: Any, label: str) -> WireTensor:
        """A TensorDict's tensor in a JSON body: a tensor object."""
        if not is_json_tensor(obj):
            raise WireError(f"{label} must be a tensor object (datatype, shape, data)")
        return from_json(obj, label, self.limits)


# -- encoding ----------------------------------------------------------------------------


def _json_key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, (bool, int, float)):
        return json.dumps(key)
    return str(key)


def type_name(value: Any) -> str:
    """``module.Class`` of a value (just ``Class`` for builtins)."""
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _opaque(value: Any) -> dict[str, str]:
    try:
        text = repr(value)
    except Exception as exc:  # a broken __repr__ must not break the body
        text = f"<{type_name(value)} object; repr failed: {exc}>"
    if len(text) > MAX_REPR_CHARS:
        text = text[: MAX_REPR_CHARS - 3] + "..."
    return {"type": type_name(value), "repr": text}


def _is_sequence(value: Any) -> bool:
    """Lists, tuples and other sequences encoded as JSON lists (not bytes or ranges)."""
    return isinstance(value, (list, tuple)) or (
        isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray, memoryview, range))
    )


def encode_json_value(
    value: Any, limits: WireLimits = DEFAULT_LIMITS, loop_values: int | None = None, where: str = "output"
) -> Any:
    """A value as JSON-ready Python data (see the module docstring). One walk that counts
    as it encodes (as :func:`json_value_count` counts): :class:`AnswerTooLarge` past
    ``limits.max_json_output_values`` values (pointing to safetensors), :class:`WireError`
    for a tensor without a wire datatype or nesting deeper than ``limits.max_depth``;
    :class:`TooLargeForLoop` once the count passes ``loop_values`` (before that tensor's
    values are made), so an event loop encodes a small answer at once and hands a large
    one to a thread."""
    return _Encoder(limits, loop_values).encode(value, where, 0)


class _Encoder:
    def __init__(self, limits: WireLimits, loop_values: int | None) -> None:
        self.limits = limits
        self.loop_values = loop_values
        self.count = 0

    def take(self, values: int) -> None:
        self.count += values
        if self.count > self.limits.max_json_output_values:
            raise AnswerTooLarge(
                f"the answer would be more than {self.limits.max_json_output_values} JSON values "
                "(limits.max_json_output_values); ask for it as safetensors (Accept: application/x-safetensors) "
                "or OIP binary data"
            )
        if self.loop_values is not None and self.count > self.loop_values:
            raise TooLargeForLoop()

    def tensor(self, tensor: Any, where: str) -> dict[str, Any]:
        self.take(element_count(tensor) if isinstance(tensor, WireTensor) or is_tensor(tensor) else 1)
        return tensor_object(to_wire(tensor, where))

    def encode(self, value: Any, where: str, depth: int) -> Any:
        if depth > self.limits.max_depth:
            raise WireError(f"{where}: nests deeper than {self.limits.max_depth} levels (a cycle?)")
        if isinstance(value, WireTensor) or is_tensor(value):
            return self.tensor(value, where)
        self.take(1)
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return spell_float(float(value))
        if is_dataproto(value):
            document, tensors = dataproto_document(value, where, self.limits)
            batch = {name: self.tensor(t, f"{where}.batch.{name}") for name, t in tensors.items()}
            return {JSON_MARKER: {**document, "batch": batch}}
        if is_tensordict(value):
            document, tensors = tensordict_document(value, where, self.limits)
            entries = map_tensor_leaves(document["tensors"], lambda name: self.tensor(tensors[name], f"{where}.{name}"))
            return {TENSORDICT_MARKER: {**document, "tensors": entries}}
        if isinstance(value, np.ndarray):
            return self.encode(value.tolist(), where, depth + 1) if value.dtype.kind in "OUS" else _opaque(value)
        if isinstance(value, np.generic):
            item = value.item()
            return _opaque(value) if isinstance(item, np.generic) else self.encode(item, where, depth + 1)
        if isinstance(value, Mapping):
            return {_json_key(k): self.encode(v, f"{where}.{_json_key(k)}", depth + 1) for k, v in value.items()}
        if _is_sequence(value):
            return [self.encode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
        return _opaque(value)


def json_value_count(value: Any, stop_above: int | None = None, max_depth: int = DEFAULT_LIMITS.max_depth) -> int:
    """How many JSON values :func:`encode_json_value` would make of ``value``, without
    encoding it: a tensor counts its elements, every other value (list and mapping
    included) one. Stops once the count passes ``stop_above`` (the number returned is then
    only known to be over it); nesting deeper than ``max_depth`` (a cycle) is a
    :class:`WireError`."""
    count = 1
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack and (stop_above is None or count <= stop_above):
        node, depth = stack.pop()
        if isinstance(node, WireTensor) or is_tensor(node):
            count += element_count(node) - 1
            continue
        if isinstance(node, np.ndarray):
            count += node.size - 1
            continue
        if is_dataproto(node):
            batch = [] if node.batch is None else [node.batch[k] for k in node.batch.keys()]
            count += sum(element_count(t) for t in batch if isinstance(t, WireTensor) or is_tensor(t))
            count += sum(np.asarray(a).size for a in (node.non_tensor_batch or {}).values())
            continue
        if is_tensordict(node):  # its tensors' elements; its Python values one each at least
            leaves = [node.get(key) for key in node.keys()]
            count += sum(t.numel() if is_tensor(t) else max(1, t.numel()) for t in leaves)
            continue
        if isinstance(node, Mapping):
            children: Any = node.values()
        elif _is_sequence(node):
            children = node
        else:
            continue
        count += len(children)
        if stop_above is not None and count > stop_above:
            break
        for child in children:
            if isinstance(child, (np.ndarray, Mapping, WireTensor)) or is_tensor(child) or _is_sequence(child):
                if depth + 1 > max_depth:
                    raise WireError(f"output: nests deeper than {max_depth} levels (a cycle?)")
                stack.append((child, depth + 1))
    return count


def check_json_output(value: Any, limits: WireLimits = DEFAULT_LIMITS) -> int:
    """The number of JSON values an answer would make (see :func:`json_value_count`), or a
    :class:`WireError` pointing to safetensors when it is over
    ``limits.max_json_output_values``. Call it before :func:`encode_json_value`."""
    count = json_value_count(value, limits.max_json_output_values, limits.max_depth)
    if count > limits.max_json_output_values:
        raise WireError(
            f"the answer would be more than {limits.max_json_output_values} JSON values "
            "(limits.max_json_output_values); ask for it as safetensors (Accept: application/x-safetensors) "
            "or OIP binary data"
        )
    return count

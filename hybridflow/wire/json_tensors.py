"""Tensors in JSON: Open Inference Protocol (OIP, KServe v2) tensor objects, and walking a
call's or an output's nested values to decode or encode them.

- A JSON tensor object is ``{"datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}``:
  ``data`` is flat and row-major; nested lists are accepted and flattened (only the
  number of values is checked against ``shape``). ``name`` and ``parameters`` may be
  present as well.
- JSON has no NaN or infinity. Float data therefore spells them as the strings ``"NaN"``,
  ``"Infinity"`` and ``"-Infinity"``, both ways; a bare non-finite float is rejected.
  Values must fit the datatype: an integer outside its range, a fraction for an integer
  datatype, or a finite number that would overflow to infinity in FP16/BF16/FP32 is an
  error. Integer datatypes accept floats with an integral value (``3.0``).
- Outputs encoded by :func:`encode_json_value`: tensors and numeric numpy arrays become
  tensor objects; numpy scalars become plain numbers; tuples become lists; non-finite
  floats become the strings above; mapping keys become strings; any other object becomes
  ``{"type": "module.Class", "repr": "..."}`` (repr cut to :data:`MAX_REPR_CHARS`).
  :func:`decode_json_value` turns tensor objects back into torch tensors and leaves
  everything else as it is.
- verl's batches, both ways: a DataProto is ``{"__dataproto__": ...}``
  (:mod:`wire.dataproto`), a TensorDict ``{"__tensordict__": ...}`` (:mod:`wire.tensordicts`).
- Bounds (:class:`wire.limits.WireLimits`): :func:`decode_json_value` counts the tensors
  and values of the whole value, and its depth, before it builds any tensor;
  :func:`json_value_count` tells, without encoding, how large an answer's JSON would be.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hybridflow.wire.dataproto import JSON_MARKER, build_dataproto, dataproto_document, is_dataproto
from hybridflow.wire.dtypes import DATATYPE_OF, check_shape, numpy_to_torch, plain_cpu, torch_dtype
from hybridflow.wire.errors import AnswerTooLarge, TooLargeForLoop, WireError
from hybridflow.wire.limits import DEFAULT_LIMITS, WireLimits
from hybridflow.wire.tensordicts import (
    TENSORDICT_MARKER,
    build_tensordict,
    is_tensordict,
    map_tensor_leaves,
    tensordict_document,
)

__all__ = [
    "MAX_REPR_CHARS",
    "check_json_output",
    "decode_json_value",
    "encode_json_value",
    "is_json_tensor",
    "json_data",
    "json_to_tensor",
    "json_value_count",
    "tensor_to_json",
]

#: Longest repr kept for an output that is not JSON.
MAX_REPR_CHARS = 10_000

#: How float data spells the values JSON cannot hold.
_NON_FINITE_IN = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

_TENSOR_KEYS = frozenset({"datatype", "shape", "data"})
_TENSOR_OPTIONAL_KEYS = frozenset({"name", "parameters"})


def is_json_tensor(obj: Any) -> bool:
    """True for a mapping whose keys are exactly datatype, shape and data, plus
    optionally name and parameters (the values are checked by :func:`json_to_tensor`)."""
    if not isinstance(obj, Mapping):
        return False
    keys = set(obj)
    return _TENSOR_KEYS <= keys and keys <= _TENSOR_KEYS | _TENSOR_OPTIONAL_KEYS


# -- decoding ----------------------------------------------------------------------------


def _flatten(data: Any, label: str, max_depth: int) -> list:
    """Row-major values of a flat or nested list."""
    if not isinstance(data, (list, tuple)):
        raise WireError(f"{label}: data must be a list, got {type(data).__name__}")
    if not any(isinstance(item, (list, tuple)) for item in data):
        return list(data)
    flat: list = []
    stack: list[tuple[Sequence, int]] = [(data, 0)]
    while stack:
        items, start = stack.pop()
        for i in range(start, len(items)):
            item = items[i]
            if isinstance(item, (list, tuple)):
                if len(stack) >= max_depth:
                    raise WireError(f"{label}: data nests deeper than {max_depth} levels")
                stack.append((items, i + 1))
                stack.append((item, 0))
                break
            flat.append(item)
    return flat


def _first_bad(values: list, ok) -> tuple[int, Any]:
    for i, value in enumerate(values):
        if not ok(value):
            return i, value
    raise AssertionError("no bad value")  # pragma: no cover - callers check first


def _bool_data(values: list, label: str) -> torch.Tensor:
    if not all(type(v) is bool for v in values):
        i, bad = _first_bad(values, lambda v: type(v) is bool)
        raise WireError(f"{label}: BOOL data must be true or false, got {bad!r} at index {i}")
    return torch.tensor(values, dtype=torch.bool)


def _int_data(values: list, datatype: str, dtype: torch.dtype, label: str) -> torch.Tensor:
    kinds = {type(v) for v in values}
    if not kinds <= {int, float}:
        i, bad = _first_bad(values, lambda v: type(v) in (int, float))
        raise WireError(f"{label}: {datatype} data must be integers, got {bad!r} at index {i}")
    if float in kinds:
        converted = []
        for i, value in enumerate(values):
            if type(value) is float:
                if not value.is_integer():
                    raise WireError(f"{label}: {datatype} data must be integers, got {value!r} at index {i}")
                value = int(value)
            converted.append(value)
        values = converted
    info = torch.iinfo(dtype)
    if values:
        low, high = min(values), max(values)
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise WireError(f"{label}: value {bad} is out of range for {datatype} ({info.min}..{info.max})")
    return torch.tensor(values, dtype=dtype)


def _non_finite_error(label: str, value: Any, index: int) -> WireError:
    return WireError(
        f"{label}: non-finite value {value!r} at index {index}; JSON has no NaN or infinity, "
        'write it as the string "NaN", "Infinity" or "-Infinity"'
    )


def _float_data(values: list, datatype: str, dtype: torch.dtype, label: str) -> torch.Tensor:
    kinds = {type(v) for v in values}
    if not kinds <= {int, float, str}:
        i, bad = _first_bad(values, lambda v: type(v) in (int, float, str))
        raise WireError(f"{label}: {datatype} data must be numbers, got {bad!r} at index {i}")
    try:
        if str in kinds:
            converted = []
            for i, value in enumerate(values):
                if type(value) is str:
                    if value not in _NON_FINITE_IN:
                        raise WireError(
                            f'{label}: {datatype} data must be numbers (or "NaN", "Infinity", "-Infinity"), '
                            f"got {value!r:.80} at index {i}"
                        )
                    value = _NON_FINITE_IN[value]
                elif type(value) is float and not math.isfinite(value):
                    raise _non_finite_error(label, value, i)
                converted.append(value)
            array = np.asarray(converted, dtype=np.float64)
        else:
            array = np.asarray(values, dtype=np.float64)
            if float in kinds and not np.isfinite(array).all():
                i = int(np.flatnonzero(~np.isfinite(array))[0])
                raise _non_finite_error(label, values[i], i)
    except OverflowError:
        raise WireError(f"{label}: a value is out of range for {datatype}") from None
    source = torch.from_numpy(array)
    tensor = source.to(dtype)
    if dtype is not torch.float64:
        overflow = torch.isinf(tensor) & torch.isfinite(source)
        if bool(overflow.any()):
            i = int(torch.nonzero(overflow)[0, 0])
            raise WireError(
                f"{label}: value {values[i]!r} at index {i} is out of range for {datatype} "
                f"(largest is {torch.finfo(dtype).max})"
            )
    return tensor


def json_to_tensor(
    obj: Mapping[str, Any], label: str | None = None, limits: WireLimits = DEFAULT_LIMITS
) -> torch.Tensor:
    """A torch tensor from an OIP JSON tensor object, after checking its datatype, shape,
    number of values and their range. ``label`` names the tensor in error messages
    (default: ``input 'NAME'`` when the object has a name, else ``tensor``)."""
    if not isinstance(obj, Mapping):
        raise WireError(f"{label or 'tensor'}: a tensor must be an object, got {type(obj).__name__}")
    if label is None:
        label = f"input {obj['name']!r}" if isinstance(obj.get("name"), str) else "tensor"
    for key in ("datatype", "shape", "data"):
        if key not in obj:
            raise WireError(f"{label}: missing {key!r}")
    datatype = obj["datatype"]
    dtype = torch_dtype(datatype, label)
    shape = check_shape(obj["shape"], label, limits)
    values = _flatten(obj["data"], label, limits.max_depth)
    needed = math.prod(shape)
    if len(values) != needed:
        raise WireError(f"{label}: data has {len(values)} values but shape {shape} needs {needed}")
    if dtype is torch.bool:
        flat = _bool_data(values, label)
    elif dtype.is_floating_point:
        flat = _float_data(values, datatype, dtype, label)
    else:
        flat = _int_data(values, datatype, dtype, label)
    return flat.reshape(shape)


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
                    raise WireError(
                        f"{where} holds more than {limits.max_tensors} tensors (limits.max_tensors)"
                    )
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


def decode_json_value(value: Any, where: str = "value", limits: WireLimits = DEFAULT_LIMITS) -> Any:
    """Decoded JSON data with every tensor object (at any depth of lists and objects)
    turned into a torch tensor; everything else is returned as it is. ``where`` prefixes
    error messages, e.g. ``kwargs.x[1]: data has 3 values but shape [2, 2] needs 4``.
    The tensors, values and depth are checked against ``limits`` first."""
    if isinstance(value, (list, tuple, Mapping)):
        _census(value, where, limits)
    return _decode(value, where, limits)


def _decode(value: Any, where: str, limits: WireLimits) -> Any:
    if is_json_tensor(value):
        return json_to_tensor(value, where, limits)
    if isinstance(value, Mapping) and set(value) == {JSON_MARKER}:
        return _decode_dataproto(value[JSON_MARKER], where, limits)
    if isinstance(value, Mapping) and set(value) == {TENSORDICT_MARKER}:
        return build_tensordict(value[TENSORDICT_MARKER], lambda obj, label: _leaf(obj, label, limits), where, limits)
    if isinstance(value, list):
        return [_decode(v, f"{where}[{i}]", limits) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        return {k: _decode(v, f"{where}.{k}", limits) for k, v in value.items()}
    return value


def _decode_dataproto(document: Any, where: str, limits: WireLimits) -> Any:
    """A DataProto from its JSON form: the document with ``batch`` mapping each tensor's
    name to its tensor object."""
    if not isinstance(document, Mapping) or not isinstance(document.get("batch"), Mapping):
        raise WireError(f"{where}: a DataProto's batch must map names to tensor objects")
    batch = document["batch"]
    tensors = {name: json_to_tensor(obj, f"{where}.batch.{name}", limits) for name, obj in batch.items()}
    return build_dataproto({**document, "batch": list(batch)}, tensors, where, limits)


def _leaf(obj: Any, label: str, limits: WireLimits) -> torch.Tensor:
    """A TensorDict's tensor in a JSON body: a tensor object."""
    if not is_json_tensor(obj):
        raise WireError(f"{label} must be a tensor object (datatype, shape, data)")
    return json_to_tensor(obj, label, limits)


# -- encoding ----------------------------------------------------------------------------


def _non_finite_out(value: float) -> float | str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def json_data(tensor: torch.Tensor) -> list:
    """Flat row-major JSON values of a CPU tensor with a wire datatype."""
    flat = tensor.reshape(-1)
    values = flat.tolist()
    if flat.dtype.is_floating_point and flat.numel() and not bool(torch.isfinite(flat).all()):
        values = [_non_finite_out(v) for v in values]
    return values


def tensor_to_json(tensor: torch.Tensor, name: str | None = None) -> dict[str, Any]:
    """An OIP JSON tensor object (with ``name`` first when given)."""
    label = f"output {name!r}" if name is not None else "tensor"
    tensor = plain_cpu(tensor, label)
    obj: dict[str, Any] = {} if name is None else {"name": name}
    obj.update(datatype=DATATYPE_OF[tensor.dtype], shape=list(tensor.shape), data=json_data(tensor))
    return obj


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
    except Exception as exc:  # a broken __repr__ must not break the answer
        text = f"<{type_name(value)} object; repr failed: {exc}>"
    if len(text) > MAX_REPR_CHARS:
        text = text[: MAX_REPR_CHARS - 3] + "..."
    return {"type": type_name(value), "repr": text}


def _is_sequence(value: Any) -> bool:
    """Lists, tuples and other sequences encoded as JSON lists (not bytes or ranges)."""
    return isinstance(value, (list, tuple)) or (
        isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray, memoryview, range))
    )


def encode_json_value(value: Any, limits: WireLimits = DEFAULT_LIMITS, loop_values: int | None = None) -> Any:
    """A value (typically a method's collected output) as JSON-ready Python data; see the
    module docstring for the rules. One walk that counts as it encodes (as
    :func:`json_value_count` counts): :class:`WireError` for an answer of more than
    ``limits.max_json_output_values`` values (pointing to safetensors), a tensor without a
    wire datatype or nesting deeper than ``limits.max_depth``; :class:`TooLargeForLoop`
    once the count passes ``loop_values`` (before that tensor's values are made), so an
    event loop encodes a small answer at once and hands a large one to a thread."""
    return _Encoder(limits, loop_values).encode(value, "output", 0)


class _Encoder:
    def __init__(self, limits: WireLimits, loop_values: int | None) -> None:
        self.max_values = limits.max_json_output_values
        self.max_depth = limits.max_depth
        self.loop_values = loop_values
        self.count = 0

    def take(self, values: int) -> None:
        self.count += values
        if self.count > self.max_values:
            raise AnswerTooLarge(
                f"the answer would be more than {self.max_values} JSON values "
                "(limits.max_json_output_values); ask for it as safetensors (Accept: application/x-safetensors) "
                "or OIP binary data"
            )
        if self.loop_values is not None and self.count > self.loop_values:
            raise TooLargeForLoop()

    def tensor(self, tensor: torch.Tensor, where: str) -> dict[str, Any]:
        self.take(tensor.numel())
        return tensor_to_json(plain_cpu(tensor, where))

    def encode(self, value: Any, where: str, depth: int) -> Any:
        if depth > self.max_depth:
            raise WireError(f"{where}: nests deeper than {self.max_depth} levels (a cycle?)")
        if isinstance(value, torch.Tensor):
            return self.tensor(value, where)
        self.take(1)
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return _non_finite_out(float(value))
        if is_dataproto(value):
            document, tensors = dataproto_document(value, where)
            batch = {name: self.tensor(t, f"{where}.batch.{name}") for name, t in tensors.items()}
            return {JSON_MARKER: {**document, "batch": batch}}
        if is_tensordict(value):
            document, tensors = tensordict_document(value, where)
            entries = map_tensor_leaves(document["tensors"], lambda name: self.tensor(tensors[name], where))
            return {TENSORDICT_MARKER: {**document, "tensors": entries}}
        if isinstance(value, np.ndarray):
            if value.dtype.kind in "biuf":
                return self.tensor(numpy_to_torch(value, where), where)
            if value.dtype.kind in "OUS":
                return self.encode(value.tolist(), where, depth + 1)
            return _opaque(value)
        if isinstance(value, np.generic):
            item = value.item()
            return _opaque(value) if isinstance(item, np.generic) else self.encode(item, where, depth + 1)
        if isinstance(value, Mapping):
            return {
                _json_key(k): self.encode(v, f"{where}.{_json_key(k)}", depth + 1) for k, v in value.items()
            }
        if _is_sequence(value):
            return [self.encode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
        return _opaque(value)


def json_value_count(
    value: Any, stop_above: int | None = None, max_depth: int = DEFAULT_LIMITS.max_depth
) -> int:
    """How many JSON values :func:`encode_json_value` would make of ``value``, without
    encoding it: a tensor or numeric array counts its elements, every other value (list and
    mapping included) one. Stops once the count passes ``stop_above`` (the number returned
    is then only known to be over it); nesting deeper than ``max_depth`` (a cycle) is a
    :class:`WireError`."""
    count = 1
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack and (stop_above is None or count <= stop_above):
        node, depth = stack.pop()
        if isinstance(node, torch.Tensor):
            count += node.numel() - 1
            continue
        if isinstance(node, np.ndarray):
            count += node.size - 1
            continue
        if is_dataproto(node):
            batch = [] if node.batch is None else [node.batch[k] for k in node.batch.keys()]
            count += sum(t.numel() for t in batch if isinstance(t, torch.Tensor))
            count += sum(a.size for a in node.non_tensor_batch.values())
            continue
        if is_tensordict(node):  # its tensors' elements; its Python values one each at least
            leaves = [node.get(key) for key in node.keys()]
            count += sum(t.numel() if isinstance(t, torch.Tensor) else max(1, t.numel()) for t in leaves)
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
            if isinstance(child, (torch.Tensor, np.ndarray, Mapping)) or _is_sequence(child):
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

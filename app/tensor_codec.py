"""Tensors on the wire, without Ray: Open Inference Protocol (OIP, KServe v2) JSON tensor
objects, safetensors bodies, and the OIP binary tensor data extension.

Bytes from clients are only ever parsed as JSON, safetensors or raw little-endian numbers;
nothing here unpickles.

Conventions (the decisions the wire format leaves open)

- A JSON tensor object is ``{"datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}``:
  ``data`` is flat and row-major; nested lists are accepted and flattened (only the
  number of values is checked against ``shape``). ``name`` and ``parameters`` may be
  present as well.
- Datatypes: BOOL, UINT8, INT8, INT16, INT32, INT64, FP16, BF16, FP32, FP64. BF16 travels
  as floats in JSON (rounded to bfloat16 on the way in); in binary it is the raw 2 bytes.
- JSON has no NaN or infinity. Float data therefore spells them as the strings ``"NaN"``,
  ``"Infinity"`` and ``"-Infinity"``, both ways; a bare non-finite float is rejected.
  Values must fit the datatype: an integer outside its range, a fraction for an integer
  datatype, or a finite number that would overflow to infinity in FP16/BF16/FP32 is an
  error. Integer datatypes accept floats with an integral value (``3.0``).
- Method outputs encoded by :func:`encode_json_value`: tensors and numeric numpy arrays
  become tensor objects; numpy scalars become plain numbers; tuples become lists;
  non-finite floats become the strings above; mapping keys become strings; any other
  object becomes ``{"type": "module.Class", "repr": "..."}`` (repr cut to
  :data:`MAX_REPR_CHARS`). :func:`decode_json_value` turns tensor objects back into
  torch tensors and leaves everything else as it is.
- safetensors calls (:func:`pack_call`) carry keyword arguments only: a tensor under its
  name, a list under ``name.0``, ``name.1``, ... Numbers and numpy arrays are sent as
  tensors (``torch.tensor(value)``'s dtype rules), so they come back as tensors.
- Outputs in safetensors (:func:`pack_output`) use dotted paths under ``output``: list
  items by index, mapping keys percent-escaped (``.`` is ``%2E``, ``%`` is ``%25``, a key
  made only of digits has its first digit escaped, the empty key is ``%``) so that keys
  such as ``gate_up_proj.weight`` survive the round trip. Tuples come back as lists.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "DATATYPES",
    "DATATYPE_OF",
    "MAX_REPR_CHARS",
    "TensorCodecError",
    "build_infer_request",
    "build_infer_response",
    "check_shape",
    "datatype_of",
    "decode_json_value",
    "decode_safetensors",
    "encode_json_value",
    "encode_safetensors",
    "is_json_tensor",
    "itemsize",
    "json_to_tensor",
    "pack_call",
    "pack_output",
    "parse_infer_request",
    "parse_infer_response",
    "tensor_to_json",
    "torch_dtype",
    "unpack_call",
    "unpack_output",
]

#: OIP datatype name -> torch dtype, for every datatype this service speaks.
DATATYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "UINT8": torch.uint8,
    "INT8": torch.int8,
    "INT16": torch.int16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "FP16": torch.float16,
    "BF16": torch.bfloat16,
    "FP32": torch.float32,
    "FP64": torch.float64,
}
#: torch dtype -> OIP datatype name.
DATATYPE_OF: dict[torch.dtype, str] = {dtype: name for name, dtype in DATATYPES.items()}

#: Little-endian numpy dtypes of the binary layout (BF16 is read as raw 16-bit words).
_WIRE_NUMPY: dict[str, str] = {
    "BOOL": "|u1",
    "UINT8": "|u1",
    "INT8": "|i1",
    "INT16": "<i2",
    "INT32": "<i4",
    "INT64": "<i8",
    "FP16": "<f2",
    "BF16": "<i2",
    "FP32": "<f4",
    "FP64": "<f8",
}

#: How float data spells the values JSON cannot hold.
_NON_FINITE_IN = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

#: Longest repr kept for an output that is not JSON.
MAX_REPR_CHARS = 10_000
#: Deepest nesting walked in a value (deeper is most likely a cycle).
MAX_DEPTH = 100
#: Most dimensions, and the largest single dimension, a shape may have.
MAX_NDIM = 64
MAX_DIM = 1 << 62

_KEYWORD_ITEM = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\.(0|[1-9][0-9]*)$")
_INDEX = re.compile(r"^(0|[1-9][0-9]*)$")
_ESCAPE = re.compile(r"%([0-9A-F]{2})")


class TensorCodecError(ValueError):
    """A value on the wire that cannot be decoded, or a value that cannot be encoded."""


# -- datatypes and shapes ------------------------------------------------------------


def torch_dtype(datatype: Any, label: str = "tensor") -> torch.dtype:
    """The torch dtype of an OIP datatype name."""
    if isinstance(datatype, str) and datatype in DATATYPES:
        return DATATYPES[datatype]
    if datatype == "BYTES":
        raise TensorCodecError(f"{label}: datatype BYTES (strings) is not supported; use {', '.join(DATATYPES)}")
    raise TensorCodecError(f"{label}: unknown datatype {datatype!r}; use one of {', '.join(DATATYPES)}")


def datatype_of(dtype: torch.dtype, label: str = "tensor") -> str:
    """The OIP datatype name of a torch dtype."""
    try:
        return DATATYPE_OF[dtype]
    except KeyError:
        raise TensorCodecError(
            f"{label}: dtype {dtype} has no wire datatype; use one of "
            + ", ".join(str(d).removeprefix("torch.") for d in DATATYPE_OF)
        ) from None


def itemsize(datatype: str) -> int:
    """Bytes per element of an OIP datatype in the binary layout."""
    return np.dtype(_WIRE_NUMPY[datatype]).itemsize


def check_shape(shape: Any, label: str = "tensor") -> list[int]:
    """A shape as a list of non-negative ints, or an error naming what is wrong."""
    if not isinstance(shape, (list, tuple)):
        raise TensorCodecError(f"{label}: shape must be a list of integers, got {shape!r}")
    if len(shape) > MAX_NDIM:
        raise TensorCodecError(f"{label}: shape has {len(shape)} dimensions, at most {MAX_NDIM} are allowed")
    for dim in shape:
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TensorCodecError(f"{label}: shape must be a list of integers, got {list(shape)!r}")
        if dim < 0:
            raise TensorCodecError(f"{label}: shape {list(shape)} has a negative dimension")
        if dim > MAX_DIM:
            raise TensorCodecError(f"{label}: shape {list(shape)} has a dimension over {MAX_DIM}")
    return [int(d) for d in shape]


# -- OIP JSON tensor objects -----------------------------------------------------------

_TENSOR_KEYS = frozenset({"datatype", "shape", "data"})
_TENSOR_OPTIONAL_KEYS = frozenset({"name", "parameters"})


def is_json_tensor(obj: Any) -> bool:
    """True for a mapping whose keys are exactly datatype, shape and data, plus
    optionally name and parameters (the values are checked by :func:`json_to_tensor`)."""
    if not isinstance(obj, Mapping):
        return False
    keys = set(obj)
    return _TENSOR_KEYS <= keys and keys <= _TENSOR_KEYS | _TENSOR_OPTIONAL_KEYS


def _flatten(data: Any, label: str) -> list:
    """Row-major values of a flat or nested list."""
    if not isinstance(data, (list, tuple)):
        raise TensorCodecError(f"{label}: data must be a list, got {type(data).__name__}")
    if not any(isinstance(item, (list, tuple)) for item in data):
        return list(data)
    flat: list = []
    stack: list[tuple[Sequence, int]] = [(data, 0)]
    while stack:
        items, start = stack.pop()
        for i in range(start, len(items)):
            item = items[i]
            if isinstance(item, (list, tuple)):
                if len(stack) >= MAX_DEPTH:
                    raise TensorCodecError(f"{label}: data nests deeper than {MAX_DEPTH} levels")
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
        raise TensorCodecError(f"{label}: BOOL data must be true or false, got {bad!r} at index {i}")
    return torch.tensor(values, dtype=torch.bool)


def _int_data(values: list, datatype: str, dtype: torch.dtype, label: str) -> torch.Tensor:
    kinds = {type(v) for v in values}
    if not kinds <= {int, float}:
        i, bad = _first_bad(values, lambda v: type(v) in (int, float))
        raise TensorCodecError(f"{label}: {datatype} data must be integers, got {bad!r} at index {i}")
    if float in kinds:
        converted = []
        for i, value in enumerate(values):
            if type(value) is float:
                if not value.is_integer():
                    raise TensorCodecError(f"{label}: {datatype} data must be integers, got {value!r} at index {i}")
                value = int(value)
            converted.append(value)
        values = converted
    info = torch.iinfo(dtype)
    if values:
        low, high = min(values), max(values)
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise TensorCodecError(
                f"{label}: value {bad} is out of range for {datatype} ({info.min}..{info.max})"
            )
    return torch.tensor(values, dtype=dtype)


def _non_finite_error(label: str, value: Any, index: int) -> TensorCodecError:
    return TensorCodecError(
        f"{label}: non-finite value {value!r} at index {index}; JSON has no NaN or infinity, "
        'write it as the string "NaN", "Infinity" or "-Infinity"'
    )


def _float_data(values: list, datatype: str, dtype: torch.dtype, label: str) -> torch.Tensor:
    kinds = {type(v) for v in values}
    if not kinds <= {int, float, str}:
        i, bad = _first_bad(values, lambda v: type(v) in (int, float, str))
        raise TensorCodecError(f"{label}: {datatype} data must be numbers, got {bad!r} at index {i}")
    try:
        if str in kinds:
            converted = []
            for i, value in enumerate(values):
                if type(value) is str:
                    if value not in _NON_FINITE_IN:
                        raise TensorCodecError(
                            f'{label}: {datatype} data must be numbers (or "NaN", "Infinity", "-Infinity"), '
                            f"got {value!r} at index {i}"
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
        raise TensorCodecError(f"{label}: a value is out of range for {datatype}") from None
    source = torch.from_numpy(array)
    tensor = source.to(dtype)
    if dtype is not torch.float64:
        overflow = torch.isinf(tensor) & torch.isfinite(source)
        if bool(overflow.any()):
            i = int(torch.nonzero(overflow)[0, 0])
            raise TensorCodecError(
                f"{label}: value {values[i]!r} at index {i} is out of range for {datatype} "
                f"(largest is {torch.finfo(dtype).max})"
            )
    return tensor


def json_to_tensor(obj: Mapping[str, Any], label: str | None = None) -> torch.Tensor:
    """A torch tensor from an OIP JSON tensor object, after checking its datatype, shape,
    number of values and their range. ``label`` names the tensor in error messages
    (default: ``input 'NAME'`` when the object has a name, else ``tensor``)."""
    if not isinstance(obj, Mapping):
        raise TensorCodecError(f"{label or 'tensor'}: a tensor must be an object, got {type(obj).__name__}")
    if label is None:
        label = f"input {obj['name']!r}" if isinstance(obj.get("name"), str) else "tensor"
    for key in ("datatype", "shape", "data"):
        if key not in obj:
            raise TensorCodecError(f"{label}: missing {key!r}")
    datatype = obj["datatype"]
    dtype = torch_dtype(datatype, label)
    shape = check_shape(obj["shape"], label)
    values = _flatten(obj["data"], label)
    needed = math.prod(shape)
    if len(values) != needed:
        raise TensorCodecError(f"{label}: data has {len(values)} values but shape {shape} needs {needed}")
    if dtype is torch.bool:
        flat = _bool_data(values, label)
    elif dtype.is_floating_point:
        flat = _float_data(values, datatype, dtype, label)
    else:
        flat = _int_data(values, datatype, dtype, label)
    return flat.reshape(shape)


def _non_finite_out(value: float) -> float | str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def _json_data(tensor: torch.Tensor) -> list:
    """Flat row-major JSON values of a CPU tensor with a wire datatype."""
    flat = tensor.reshape(-1)
    values = flat.tolist()
    if flat.dtype.is_floating_point and flat.numel() and not bool(torch.isfinite(flat).all()):
        values = [_non_finite_out(v) for v in values]
    return values


def _plain_cpu(tensor: torch.Tensor, label: str) -> torch.Tensor:
    """A detached, dense CPU tensor with a wire datatype."""
    tensor = tensor.detach()
    if tensor.layout is not torch.strided:
        tensor = tensor.to_dense()
    datatype_of(tensor.dtype, label)
    tensor = tensor.cpu()
    if tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg()
    return tensor


def tensor_to_json(tensor: torch.Tensor, name: str | None = None) -> dict[str, Any]:
    """An OIP JSON tensor object (with ``name`` first when given)."""
    label = f"output {name!r}" if name is not None else "tensor"
    tensor = _plain_cpu(tensor, label)
    obj: dict[str, Any] = {} if name is None else {"name": name}
    obj.update(datatype=DATATYPE_OF[tensor.dtype], shape=list(tensor.shape), data=_json_data(tensor))
    return obj


def _numpy_to_torch(array: np.ndarray, label: str) -> torch.Tensor:
    if array.dtype.kind not in "biuf":
        raise TensorCodecError(f"{label}: numpy dtype {array.dtype} has no wire datatype")
    native = array.astype(array.dtype.newbyteorder("="), copy=False)
    try:
        tensor = torch.from_numpy(np.ascontiguousarray(native))
    except TypeError:
        raise TensorCodecError(f"{label}: numpy dtype {array.dtype} has no wire datatype") from None
    datatype_of(tensor.dtype, label)
    return tensor


def _json_key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, (bool, int, float)):
        return json.dumps(key)
    return str(key)


def _type_name(value: Any) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _opaque(value: Any) -> dict[str, str]:
    try:
        text = repr(value)
    except Exception as exc:  # a broken __repr__ must not break the answer
        text = f"<{_type_name(value)} object; repr failed: {exc}>"
    if len(text) > MAX_REPR_CHARS:
        text = text[: MAX_REPR_CHARS - 3] + "..."
    return {"type": _type_name(value), "repr": text}


def encode_json_value(value: Any) -> Any:
    """A value (typically a method's collected output) as JSON-ready Python data; see the
    module docstring for the rules. Raises :class:`TensorCodecError` for a tensor without
    a wire datatype or nesting deeper than :data:`MAX_DEPTH`."""
    return _encode(value, "output", 0)


def _encode(value: Any, where: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise TensorCodecError(f"{where}: nests deeper than {MAX_DEPTH} levels (a cycle?)")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return _non_finite_out(float(value))
    if isinstance(value, torch.Tensor):
        return tensor_to_json(_plain_cpu(value, where))
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "biuf":
            return tensor_to_json(_numpy_to_torch(value, where))
        if value.dtype.kind in "OUS":
            return _encode(value.tolist(), where, depth + 1)
        return _opaque(value)
    if isinstance(value, np.generic):
        item = value.item()
        return _opaque(value) if isinstance(item, np.generic) else _encode(item, where, depth + 1)
    if isinstance(value, Mapping):
        return {_json_key(k): _encode(v, f"{where}.{_json_key(k)}", depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or (
        isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray, memoryview, range))
    ):
        return [_encode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    return _opaque(value)


def decode_json_value(value: Any, where: str = "value") -> Any:
    """Decoded JSON data with every tensor object (at any depth of lists and objects)
    turned into a torch tensor; everything else is returned as it is. ``where`` prefixes
    error messages, e.g. ``kwargs.x[1]: data has 3 values but shape [2, 2] needs 4``."""
    return _decode(value, where, 0)


def _decode(value: Any, where: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise TensorCodecError(f"{where}: nests deeper than {MAX_DEPTH} levels")
    if is_json_tensor(value):
        return json_to_tensor(value, where)
    if isinstance(value, list):
        return [_decode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        return {k: _decode(v, f"{where}.{k}", depth + 1) for k, v in value.items()}
    return value


# -- safetensors -----------------------------------------------------------------------


def encode_safetensors(named: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """A safetensors body of named tensors (detached, on CPU, contiguous; tensors that
    share memory are copied, as the format needs one owner per byte range)."""
    from safetensors.torch import save

    plain: dict[str, torch.Tensor] = {}
    owners: set[int] = set()
    for name, tensor in named.items():
        if not isinstance(name, str):
            raise TensorCodecError(f"tensor names must be strings, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TensorCodecError(f"{name!r} is a {type(tensor).__name__}, not a tensor")
        tensor = _plain_cpu(tensor, repr(name)).contiguous()
        if tensor.numel():
            storage = tensor.untyped_storage()
            if storage.data_ptr() in owners or storage.nbytes() != tensor.nbytes:
                tensor = tensor.clone()  # a view of a larger buffer, or the same buffer twice
            owners.add(tensor.untyped_storage().data_ptr())
        plain[name] = tensor
    return save(plain, metadata=dict(metadata) if metadata else None)


def decode_safetensors(body: bytes) -> dict[str, torch.Tensor]:
    """Named tensors of a safetensors body; a truncated or malformed body, or a dtype
    without a wire datatype, raises :class:`TensorCodecError`."""
    from safetensors.torch import load

    body = bytes(body)
    if len(body) < 8:
        raise TensorCodecError(f"safetensors body has {len(body)} bytes, fewer than its 8-byte header length")
    (header_length,) = struct.unpack("<Q", body[:8])
    if header_length > len(body) - 8:
        raise TensorCodecError(
            f"safetensors header claims {header_length} bytes but the body has {len(body) - 8} after the length"
        )
    try:
        header = json.loads(body[8 : 8 + header_length])
    except (ValueError, RecursionError) as exc:
        raise TensorCodecError(f"safetensors header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise TensorCodecError("safetensors header is not a JSON object")
    try:
        named = load(body)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # the Rust parser's errors, including a panic (a BaseException)
        raise TensorCodecError(f"invalid safetensors body: {exc}") from None
    for name, tensor in named.items():
        datatype_of(tensor.dtype, f"safetensors tensor {name!r}")
    return named


def _as_tensor(value: Any, label: str) -> torch.Tensor:
    """A tensor from a tensor, numpy array, number or (nested) list of numbers."""
    if isinstance(value, torch.Tensor):
        return _plain_cpu(value, label)
    if isinstance(value, np.ndarray):
        return _numpy_to_torch(value, label)
    if is_json_tensor(value):
        return json_to_tensor(value, label)
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, (bool, int, float)) or isinstance(value, list):
        try:
            tensor = torch.tensor(value)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise TensorCodecError(f"{label}: cannot make a tensor of {value!r:.80}: {exc}") from None
        datatype_of(tensor.dtype, label)
        return tensor
    raise TensorCodecError(
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
            raise TensorCodecError(f"keyword {name!r} is not a valid argument name")
        if isinstance(value, (list, tuple)):
            if not value:
                raise TensorCodecError(f"argument {name!r} is an empty list, which safetensors cannot carry")
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
    lists: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in named.items():
        match = _KEYWORD_ITEM.match(name)
        if match:
            lists.setdefault(match.group(1), {})[int(match.group(2))] = tensor
        elif name.isidentifier():
            kwargs[name] = tensor
        else:
            raise TensorCodecError(
                f"tensor name {name!r} is neither an argument name nor a list item such as 'x.0'"
            )
    for base, items in lists.items():
        if base in kwargs:
            raise TensorCodecError(f"argument {base!r} is given both as a tensor and as list items {base}.N")
        indices = sorted(items)
        if indices != list(range(len(indices))):
            missing = sorted(set(range(indices[-1] + 1)) - set(indices))
            raise TensorCodecError(
                f"list argument {base!r} has items {indices} but indices must run from 0 with no gap "
                f"(missing {base}.{missing[0]})"
            )
        kwargs[base] = [items[i] for i in indices]
    return kwargs


def _escape_key(key: Any, where: str) -> str:
    if not isinstance(key, str):
        if isinstance(key, bool) or not isinstance(key, int):
            raise TensorCodecError(f"{where}: key {key!r} is not a string")
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


def pack_output(output: Any, prefix: str = "output") -> dict[str, torch.Tensor]:
    """A collected output as named tensors for a safetensors answer: a tensor (or numpy
    array, or number) is ``output``; list items are ``output.0``, ``output.1``, ...; mapping
    values are ``output.<escaped key>``, recursively (``output.0.gate_up_proj%2Eweight``).
    None, strings, other objects and empty containers raise :class:`TensorCodecError`."""
    named: dict[str, torch.Tensor] = {}
    _pack(output, prefix, named, 0)
    return named


def _pack(value: Any, path: str, named: dict[str, torch.Tensor], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise TensorCodecError(f"{path}: nests deeper than {MAX_DEPTH} levels")
    if isinstance(value, (list, tuple)):
        if not value:
            raise TensorCodecError(f"{path} is an empty list, which safetensors cannot carry")
        for i, item in enumerate(value):
            _pack(item, f"{path}.{i}", named, depth + 1)
    elif isinstance(value, Mapping):
        if not value:
            raise TensorCodecError(f"{path} is an empty mapping, which safetensors cannot carry")
        for key, item in value.items():
            _pack(item, f"{path}.{_escape_key(key, path)}", named, depth + 1)
    elif isinstance(value, (torch.Tensor, np.ndarray, np.generic, bool, int, float)):
        named[path] = _as_tensor(value, path)
    else:
        raise TensorCodecError(f"{path} is {_type_name(value)}, which safetensors cannot carry")


def unpack_output(named: Mapping[str, torch.Tensor], prefix: str = "output") -> Any:
    """The output :func:`pack_output` packed: a tensor, or lists and dicts of tensors
    (dict keys in sorted order: safetensors does not keep the original order)."""
    if not named:
        raise TensorCodecError("the answer holds no tensors")
    tree: dict[str, Any] = {}
    leaf = object()
    root: Any = None
    for name, tensor in named.items():
        if name == prefix:
            root = tensor
            continue
        if not name.startswith(prefix + "."):
            raise TensorCodecError(f"tensor name {name!r} is not under {prefix!r}")
        node = tree
        parts = name[len(prefix) + 1 :].split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise TensorCodecError(f"{name!r} nests under a tensor of the same name")
            node = child
        if parts[-1] in node:
            raise TensorCodecError(f"{name!r} is both a tensor and a container")
        node[parts[-1]] = (leaf, tensor)
    if root is not None:
        if tree:
            raise TensorCodecError(f"{prefix!r} is both a tensor and a container")
        return root

    def build(node: dict[str, Any], path: str) -> Any:
        values = {
            part: child[1] if isinstance(child, tuple) and child and child[0] is leaf else build(child, f"{path}.{part}")
            for part, child in node.items()
        }
        indexed = [bool(_INDEX.match(part)) for part in values]
        if all(indexed):
            indices = sorted(int(part) for part in values)
            if indices != list(range(len(indices))):
                raise TensorCodecError(f"{path}: list items {indices} do not run from 0 with no gap")
            return [values[str(i)] for i in indices]
        if any(indexed):
            raise TensorCodecError(f"{path} mixes list indices and mapping keys")
        return {_unescape_key(part): values[part] for part in sorted(values)}

    return build(tree, prefix)


# -- OIP binary tensor data extension --------------------------------------------------


def _strict_json(raw: bytes, what: str) -> Any:
    def reject(constant: str) -> Any:
        raise ValueError(f"{constant} is not valid JSON")

    try:
        return json.loads(raw, parse_constant=reject)
    except (ValueError, RecursionError) as exc:
        raise TensorCodecError(f"{what} is not valid JSON: {exc}") from None


def _tensor_from_bytes(raw: bytes | memoryview, datatype: str, shape: list[int], label: str) -> torch.Tensor:
    array = np.frombuffer(raw, dtype=np.dtype(_WIRE_NUMPY[datatype]))
    array = array.astype(array.dtype.newbyteorder("="), copy=True)  # own, writable, native order
    if datatype == "BOOL":
        if array.size and int(array.max()) > 1:
            raise TensorCodecError(f"{label}: BOOL bytes must be 0 or 1")
        return torch.from_numpy(array).to(torch.bool).reshape(shape)
    tensor = torch.from_numpy(array)
    if datatype == "BF16":
        tensor = tensor.view(torch.bfloat16)
    return tensor.reshape(shape)


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """Raw little-endian row-major bytes of a CPU tensor with a wire datatype."""
    tensor = tensor.contiguous()
    if tensor.dtype is torch.bfloat16:
        tensor = tensor.view(torch.int16)
    elif tensor.dtype is torch.bool:
        tensor = tensor.view(torch.uint8)
    array = tensor.numpy()
    return array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


def _split_body(body: bytes, header_length: int | None, what: str) -> tuple[Any, memoryview]:
    view = memoryview(body).cast("B") if not isinstance(body, memoryview) else body.cast("B")
    if header_length is None:
        return _strict_json(bytes(view), f"{what} body"), view[len(view) :]
    if isinstance(header_length, bool) or not isinstance(header_length, int):
        raise TensorCodecError(f"Inference-Header-Content-Length must be an integer, got {header_length!r}")
    if header_length < 0 or header_length > len(view):
        raise TensorCodecError(
            f"Inference-Header-Content-Length {header_length} does not fit a body of {len(view)} bytes"
        )
    return _strict_json(bytes(view[:header_length]), f"{what} header"), view[header_length:]


def _parse_tensors(
    entries: Any, rest: memoryview, binary_allowed: bool, kind: str
) -> dict[str, torch.Tensor]:
    """Tensors of an OIP ``inputs`` or ``outputs`` list, binary ones read from ``rest``."""
    tensors: dict[str, torch.Tensor] = {}
    offset = 0
    for position, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise TensorCodecError(f"{kind}s[{position}] must be an object")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise TensorCodecError(f"{kind}s[{position}] needs a non-empty string 'name'")
        label = f"{kind} {name!r}"
        if name in tensors:
            raise TensorCodecError(f"{label} is given twice")
        datatype = entry.get("datatype")
        torch_dtype(datatype, label)
        shape = check_shape(entry.get("shape"), label)
        parameters = entry.get("parameters") or {}
        if not isinstance(parameters, dict):
            raise TensorCodecError(f"{label}: parameters must be an object")
        if "shared_memory_region" in parameters:
            raise TensorCodecError(f"{label}: shared-memory tensors are not supported")
        size = parameters.get("binary_data_size")
        if size is None:
            if "data" not in entry:
                raise TensorCodecError(f"{label} has neither 'data' nor parameters.binary_data_size")
            tensors[name] = json_to_tensor(entry, label)
            continue
        if "data" in entry:
            raise TensorCodecError(f"{label} has both 'data' and parameters.binary_data_size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise TensorCodecError(f"{label}: binary_data_size must be a non-negative integer, got {size!r}")
        if not binary_allowed:
            raise TensorCodecError(
                f"{label} has binary_data_size but no Inference-Header-Content-Length says where the JSON ends"
            )
        expected = math.prod(shape) * itemsize(datatype)
        if size != expected:
            raise TensorCodecError(
                f"{label}: binary_data_size is {size} bytes but shape {shape} of {datatype} needs {expected}"
            )
        if offset + size > len(rest):
            raise TensorCodecError(
                f"{label}: the body ends {offset + size - len(rest)} bytes short of its binary data "
                f"({len(rest)} bytes follow the JSON header)"
            )
        tensors[name] = _tensor_from_bytes(rest[offset : offset + size], datatype, shape, label)
        offset += size
    if offset != len(rest):
        raise TensorCodecError(
            f"the body has {len(rest) - offset} bytes after the JSON header that no {kind} declares "
            f"({offset} declared by binary_data_size, {len(rest)} present)"
        )
    return tensors


def parse_infer_request(body: bytes, header_length: int | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """An OIP inference request and its input tensors, by name in request order.

    ``header_length`` is the ``Inference-Header-Content-Length`` header as an int (None
    when absent: the whole body is JSON). Inputs with ``parameters.binary_data_size`` take
    their bytes, in the order the JSON lists them, from after the header; the others take
    ``data`` from the JSON. Sizes must match shape and datatype and add up to the body
    exactly. The request dict is returned as parsed (with ``data`` lists left in it).
    """
    request, rest = _split_body(body, header_length, "inference request")
    if not isinstance(request, dict):
        raise TensorCodecError("inference request must be a JSON object")
    if "id" in request and not isinstance(request["id"], str):
        raise TensorCodecError(f"inference request 'id' must be a string, got {request['id']!r}")
    if request.get("parameters") is not None and not isinstance(request["parameters"], dict):
        raise TensorCodecError("inference request 'parameters' must be an object")
    outputs = request.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list) or not all(
            isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs
        ):
            raise TensorCodecError("inference request 'outputs' must be a list of objects with a 'name'")
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise TensorCodecError("inference request needs a non-empty 'inputs' list")
    return request, _parse_tensors(inputs, rest, header_length is not None, "input")


def _wants_binary(binary: set[str] | bool | Sequence[str], names: Sequence[str]) -> set[str]:
    if binary is True:
        return set(names)
    if binary is False or binary is None:
        return set()
    return set(binary) & set(names)


def _tensor_entries(
    tensors: Mapping[str, torch.Tensor], binary: set[str], kind: str
) -> tuple[list[dict[str, Any]], list[bytes]]:
    entries: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, tensor in tensors.items():
        label = f"{kind} {name!r}"
        if not isinstance(tensor, torch.Tensor):
            if isinstance(tensor, np.ndarray):
                tensor = _numpy_to_torch(tensor, label)
            else:
                raise TensorCodecError(f"{label} is a {type(tensor).__name__}, not a tensor")
        tensor = _plain_cpu(tensor, label)
        entry: dict[str, Any] = {"name": name, "datatype": DATATYPE_OF[tensor.dtype], "shape": list(tensor.shape)}
        if name in binary:
            raw = _tensor_bytes(tensor)
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = _json_data(tensor)
        entries.append(entry)
    return entries, blobs


def _assemble(message: dict[str, Any], blobs: list[bytes]) -> tuple[bytes, int | None]:
    header = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)


def build_infer_response(
    model_name: str,
    model_version: str | None,
    outputs: Mapping[str, torch.Tensor],
    binary: set[str] | bool,
    id: str | None = None,
    parameters: Mapping[str, Any] | None = None,
) -> tuple[bytes, int | None]:
    """An OIP inference response body and, when any output is binary, the length of its
    JSON header (send it as ``Inference-Header-Content-Length``; Triton answers such
    bodies as ``application/octet-stream``, JSON-only ones as ``application/json``).

    ``binary``: True for every output in binary, False for none, or the names to send in
    binary (names not among ``outputs`` are ignored). JSON outputs carry flat ``data``
    (BF16 as floats, non-finite floats as "NaN"/"Infinity"/"-Infinity"); binary outputs
    carry ``parameters.binary_data_size`` and their bytes follow the header in order.
    """
    entries, blobs = _tensor_entries(outputs, _wants_binary(binary, list(outputs)), "output")
    message: dict[str, Any] = {"model_name": model_name}
    if model_version is not None:
        message["model_version"] = model_version
    if id is not None:
        message["id"] = id
    if parameters:
        message["parameters"] = dict(parameters)
    message["outputs"] = entries
    return _assemble(message, blobs)


def build_infer_request(
    inputs: Mapping[str, torch.Tensor],
    binary: set[str] | bool = True,
    outputs: Sequence[str] | None = None,
    binary_outputs: bool = True,
    id: str | None = None,
    parameters: Mapping[str, Any] | None = None,
) -> tuple[bytes, int | None]:
    """An OIP inference request body (the client side), like tritonclient builds it:
    ``binary`` inputs as raw bytes after the JSON header, the rest as JSON ``data``.
    Named ``outputs`` are requested with ``parameters.binary_data`` = ``binary_outputs``;
    with no names, ``parameters.binary_data_output`` asks for every output in binary.
    Returns the body and the header length (None when the body is JSON only)."""
    entries, blobs = _tensor_entries(inputs, _wants_binary(binary, list(inputs)), "input")
    message: dict[str, Any] = {}
    if id is not None:
        message["id"] = id
    request_parameters = dict(parameters or {})
    if outputs:
        message["outputs"] = [{"name": name, "parameters": {"binary_data": binary_outputs}} for name in outputs]
    elif binary_outputs:
        request_parameters["binary_data_output"] = True
    if request_parameters:
        message["parameters"] = request_parameters
    message["inputs"] = entries
    return _assemble(message, blobs)


def parse_infer_response(body: bytes, header_length: int | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """An OIP inference response and its output tensors (the client side of
    :func:`build_infer_response`), with the same checks as :func:`parse_infer_request`."""
    response, rest = _split_body(body, header_length, "inference response")
    if not isinstance(response, dict) or not isinstance(response.get("outputs", []), list):
        raise TensorCodecError("inference response must be a JSON object with an 'outputs' list")
    return response, _parse_tensors(response.get("outputs", []), rest, header_length is not None, "output")

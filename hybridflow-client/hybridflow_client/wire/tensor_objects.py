"""Open Inference Protocol (OIP, KServe v2) JSON tensor objects:
``{"datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}``.

- ``data`` is flat and row-major; nested lists are accepted and flattened (only the number
  of values is checked against ``shape``). ``name`` and ``parameters`` may be present too.
- JSON has no NaN or infinity: float data spells them as the strings ``"NaN"``,
  ``"Infinity"`` and ``"-Infinity"``, both ways; a bare non-finite float is refused.
- Values must fit the datatype: an integer outside its range, a fraction for an integer
  datatype, or a finite number that would overflow to infinity in FP16/BF16/FP32 is a
  :class:`WireError`. Integer datatypes take floats with an integral value (``3.0``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hybridflow_client.wire.datatypes import (
    DATATYPES,
    WireTensor,
    bf16_words,
    check_datatype,
    check_shape,
    widen_bf16,
)
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.limits import DEFAULT_LIMITS, WireLimits

__all__ = ["from_json", "is_json_tensor", "tensor_object"]

#: How float data spells the values JSON cannot hold.
_NON_FINITE_IN = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_TENSOR_KEYS = frozenset({"datatype", "shape", "data"})
_TENSOR_OPTIONAL_KEYS = frozenset({"name", "parameters"})
#: The largest finite value of each narrow float datatype (for the overflow message).
_LARGEST = {
    "FP16": float(np.finfo(np.float16).max),
    "BF16": float(widen_bf16(np.array([0x7F7F], np.uint16))[0]),
    "FP32": float(np.finfo(np.float32).max),
}


def is_json_tensor(obj: Any) -> bool:
    """True for a mapping whose keys are exactly datatype, shape and data, plus
    optionally name and parameters (the values are checked by :func:`from_json`)."""
    if not isinstance(obj, Mapping):
        return False
    keys = set(obj)
    return _TENSOR_KEYS <= keys and keys <= _TENSOR_KEYS | _TENSOR_OPTIONAL_KEYS


def tensor_object(tensor: WireTensor, name: str | None = None) -> dict[str, Any]:
    """An OIP JSON tensor object (with ``name`` first when given)."""
    obj: dict[str, Any] = {} if name is None else {"name": name}
    obj.update(datatype=tensor.datatype, shape=tensor.shape, data=tensor.json_data())
    return obj


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


def _bool_data(values: list, label: str) -> np.ndarray:
    if not all(type(v) is bool for v in values):
        i, bad = _first_bad(values, lambda v: type(v) is bool)
        raise WireError(f"{label}: BOOL data must be true or false, got {bad!r:.80} at index {i}")
    return np.array(values, dtype=np.bool_)


def _int_data(values: list, datatype: str, label: str) -> np.ndarray:
    kinds = {type(v) for v in values}
    if not kinds <= {int, float}:
        i, bad = _first_bad(values, lambda v: type(v) in (int, float))
        raise WireError(f"{label}: {datatype} data must be integers, got {bad!r:.80} at index {i}")
    if float in kinds:
        converted = []
        for i, value in enumerate(values):
            if type(value) is float:
                if not value.is_integer():
                    raise WireError(f"{label}: {datatype} data must be integers, got {value!r} at index {i}")
                value = int(value)
            converted.append(value)
        values = converted
    info = np.iinfo(DATATYPES[datatype])
    if values:
        low, high = min(values), max(values)
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise WireError(f"{label}: value {bad} is out of range for {datatype} ({info.min}..{info.max})")
    return np.array(values, dtype=DATATYPES[datatype])


def _non_finite_error(label: str, value: Any, index: int) -> WireError:
    return WireError(
        f"{label}: non-finite value {value!r} at index {index}; JSON has no NaN or infinity, "
        'write it as the string "NaN", "Infinity" or "-Infinity"'
    )


def _float_data(values: list, datatype: str, label: str) -> np.ndarray:
    kinds = {type(v) for v in values}
    if not kinds <= {int, float, str}:
        i, bad = _first_bad(values, lambda v: type(v) in (int, float, str))
        raise WireError(f"{label}: {datatype} data must be numbers, got {bad!r:.80} at index {i}")
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
            wide = np.asarray(converted, dtype=np.float64)
        else:
            wide = np.asarray(values, dtype=np.float64)
            if float in kinds and not np.isfinite(wide).all():
                i = int(np.flatnonzero(~np.isfinite(wide))[0])
                raise _non_finite_error(label, values[i], i)
    except OverflowError:
        raise WireError(f"{label}: a value is out of range for {datatype}") from None
    if datatype == "FP64":
        return wide
    if datatype == "BF16":
        words = bf16_words(wide)
        narrow = widen_bf16(words)
    else:
        with np.errstate(over="ignore"):
            words = narrow = wide.astype(DATATYPES[datatype])
    overflow = np.isinf(narrow) & np.isfinite(wide)
    if overflow.any():
        i = int(np.flatnonzero(overflow)[0])
        raise WireError(
            f"{label}: value {values[i]!r} at index {i} is out of range for {datatype} (largest is {_LARGEST[datatype]})"
        )
    return words


def from_json(obj: Mapping[str, Any], label: str | None = None, limits: WireLimits = DEFAULT_LIMITS) -> WireTensor:
    """A tensor from an OIP JSON tensor object, after checking its datatype, shape,
    number of values and their range. ``label`` names the tensor in error messages
    (default: ``input 'NAME'`` when the object has a name, else ``tensor``)."""
    if not isinstance(obj, Mapping):
        raise WireError(f"{label or 'tensor'}: a tensor must be an object, got {type(obj).__name__}")
    if label is None:
        label = f"input {obj['name']!r}" if isinstance(obj.get("name"), str) else "tensor"
    for key in ("datatype", "shape", "data"):
        if key not in obj:
            raise WireError(f"{label}: missing {key!r}")
    datatype = check_datatype(obj["datatype"], label)
    shape = check_shape(obj["shape"], label, limits)
    values = _flatten(obj["data"], label, limits.max_depth)
    needed = math.prod(shape)
    if len(values) != needed:
        raise WireError(f"{label}: data has {len(values)} values but shape {shape} needs {needed}")
    if datatype == "BOOL":
        flat = _bool_data(values, label)
    elif DATATYPES[datatype].kind == "f" or datatype == "BF16":
        flat = _float_data(values, datatype, label)
    else:
        flat = _int_data(values, datatype, label)
    return WireTensor(datatype, flat.reshape(shape))

"""Datatypes, shapes and raw bytes: the Open Inference Protocol's datatype names and the
numpy dtype each is held in, shape checks, BF16 as 16-bit words, and :class:`WireTensor`,
the one form every codec reads and writes.

Datatypes: BOOL, UINT8, INT8, INT16, INT32, INT64, FP16, BF16, FP32, FP64 (no BYTES).
numpy has no bfloat16: a BF16 tensor holds its 16-bit words (``uint16``), each the upper
half of the float32 of the same value. BF16 travels as floats in JSON and as its raw 2
bytes in binary; floats are rounded to BF16 as torch rounds them (to nearest even, through
float32), so both sides of the wire make the same words.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.limits import DEFAULT_LIMITS, WireLimits

__all__ = [
    "DATATYPES",
    "WireTensor",
    "bf16_words",
    "check_datatype",
    "check_shape",
    "from_buffer",
    "itemsize",
    "spell_float",
    "widen_bf16",
]

#: OIP datatype name -> the numpy dtype a :class:`WireTensor` of it holds (BF16: its words).
DATATYPES: dict[str, np.dtype] = {
    name: np.dtype(code)
    for name, code in {
        "BOOL": "bool",
        "UINT8": "uint8",
        "INT8": "int8",
        "INT16": "int16",
        "INT32": "int32",
        "INT64": "int64",
        "FP16": "float16",
        "BF16": "uint16",
        "FP32": "float32",
        "FP64": "float64",
    }.items()
}


def check_datatype(datatype: Any, label: str = "tensor") -> str:
    """An OIP datatype name this wire speaks, or a :class:`WireError` naming it."""
    if isinstance(datatype, str) and datatype in DATATYPES:
        return datatype
    if datatype == "BYTES":
        raise WireError(f"{label}: datatype BYTES (strings) is not supported; use {', '.join(DATATYPES)}")
    raise WireError(f"{label}: unknown datatype {datatype!r:.40}; use one of {', '.join(DATATYPES)}")


def itemsize(datatype: str) -> int:
    """Bytes per element of a datatype in the binary layout."""
    return DATATYPES[datatype].itemsize


def check_shape(shape: Any, label: str = "tensor", limits: WireLimits = DEFAULT_LIMITS) -> list[int]:
    """A shape as a list of non-negative ints, or an error naming what is wrong. The
    product of its nonzero dimensions may not pass ``limits.max_tensor_elements``, so an
    empty tensor cannot claim dimensions whose product overflows (``[2**62, 2**62, 0]``)."""
    if not isinstance(shape, (list, tuple)):
        raise WireError(f"{label}: shape must be a list of integers, got {shape!r:.200}")
    if len(shape) > limits.max_ndim:
        raise WireError(f"{label}: shape has {len(shape)} dimensions, at most {limits.max_ndim} are allowed")
    product = 1
    for dim in shape:
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise WireError(f"{label}: shape must be a list of integers, got {list(shape)!r:.200}")
        if dim < 0:
            raise WireError(f"{label}: shape {list(shape)} has a negative dimension")
        if dim:
            product *= dim
            if product > limits.max_tensor_elements:
                raise WireError(
                    f"{label}: shape {list(shape)} has more than {limits.max_tensor_elements} elements "
                    "(limits.max_tensor_elements; the product of its nonzero dimensions)"
                )
    return [int(d) for d in shape]


def widen_bf16(words: np.ndarray) -> np.ndarray:
    """The float32 values of BF16 words (exact: each word is its float32's upper half)."""
    wide = np.asarray(words).astype(np.uint32)
    wide <<= 16  # in place: a 0-d array stays an array
    return wide.view(np.float32)


def bf16_words(values: np.ndarray) -> np.ndarray:
    """BF16 words of float values, rounded as torch rounds: to float32 first, then to the
    nearest BF16 (ties to even); every NaN becomes the one quiet NaN 0x7FC0. A value past
    BF16's range becomes an infinity (callers check for it)."""
    with np.errstate(all="ignore"):  # overflow to infinity, and a NaN's bits wrapping around
        single = np.asarray(values).astype(np.float32)
        bits = single.view(np.uint32)
        words = ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)
    words[np.isnan(single)] = 0x7FC0
    return words


@dataclass(frozen=True)
class WireTensor:
    """One tensor on the wire: its OIP ``datatype`` and its values in ``array`` (a numpy
    array of ``DATATYPES[datatype]``, C order, native byte order; BF16 as its words)."""

    datatype: str
    array: np.ndarray

    @property
    def shape(self) -> list[int]:
        return list(self.array.shape)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def to_bytes(self) -> bytes:
        """The raw little-endian row-major bytes of the binary formats."""
        return self.array.astype(self.array.dtype.newbyteorder("<"), copy=False).tobytes()

    def float64(self) -> np.ndarray:
        """The values as float64 (BF16 widened exactly)."""
        return self.values().astype(np.float64)

    def values(self) -> np.ndarray:
        """The values as numpy holds them (BF16 widened to float32)."""
        return widen_bf16(self.array) if self.datatype == "BF16" else self.array

    def json_data(self) -> list:
        """Flat row-major JSON values; non-finite floats as "NaN", "Infinity", "-Infinity"."""
        flat = self.values().reshape(-1)
        values = flat.tolist()
        if flat.dtype.kind == "f" and flat.size and not np.isfinite(flat).all():
            values = [spell_float(v) for v in values]
        return values


def spell_float(value: float) -> float | str:
    """A float as JSON may hold it: NaN and infinities as the strings the wire uses."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def from_buffer(raw: bytes | bytearray | memoryview, datatype: str, shape: list[int], label: str) -> WireTensor:
    """A tensor of ``shape`` from ``raw``, the little-endian bytes of ``datatype``. Where
    ``raw`` is writable and its bytes lie aligned in native order, the array is a view of
    them, not a copy: a large request body is then held once, not twice. Otherwise the
    array is a copy of its own, so it is always writable. BOOL bytes must be 0 or 1."""
    view = memoryview(raw).cast("B")
    dtype = DATATYPES[datatype]
    needed = math.prod(shape) * dtype.itemsize
    if len(view) != needed:
        raise WireError(f"{label}: {len(view)} bytes, but shape {shape} of {datatype} needs {needed}")
    array = np.frombuffer(view, dtype=np.uint8 if datatype == "BOOL" else dtype.newbyteorder("<"))
    if view.readonly or not array.flags.aligned or not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="), copy=True)
    if datatype == "BOOL":
        if array.size and int(array.max()) > 1:
            raise WireError(f"{label}: BOOL bytes must be 0 or 1")
        array = array.view(np.bool_)
    return WireTensor(datatype, array.reshape(shape))

"""Tensors as the client sends and reads them.

Every codec of the client works on :class:`WireTensor`: an OIP datatype name and a numpy
array of that datatype's values (C order, native byte order). What a user passes (a torch
tensor, a numpy array, a number, a list of numbers) becomes one with :func:`to_wire`;
what the service sends back is handed to the user by :func:`to_user`.

torch is optional. When it is installed, torch tensors are accepted and answers come back
as torch tensors. Without it, numpy arrays go in and come back.

BF16 has no numpy dtype: a BF16 :class:`WireTensor` holds the 16-bit words of its values
(``uint16``). With torch it comes back as a ``torch.bfloat16`` tensor. Without torch it
comes back as a ``float32`` array holding exactly the same values (every BF16 value is a
float32 value: its word is the float32's upper half); BF16 can then be sent only as a
JSON tensor object whose values are BF16 values already (rounding needs torch), else a
:class:`CodecError` says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

try:
    import torch
except ImportError:  # the client works without torch: numpy arrays in and out
    torch = None

if TYPE_CHECKING:
    from typing import TypeAlias

    import torch as _torch

    #: What a user gets back: a torch tensor where torch is installed, else a numpy array.
    Tensor: TypeAlias = _torch.Tensor | np.ndarray

__all__ = [
    "DATATYPES",
    "CodecError",
    "WireTensor",
    "check_datatype",
    "check_shape",
    "from_buffer",
    "from_json",
    "is_json_tensor",
    "is_tensor",
    "to_user",
    "to_wire",
    "torch_available",
]


class CodecError(ValueError):
    """A value the client cannot encode, or bytes from the service it cannot decode; the
    message names which and why."""


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
#: numpy dtype -> OIP datatype name, for the arrays a user may pass.
_DATATYPE_OF_NUMPY = {dtype: name for name, dtype in DATATYPES.items() if name != "BF16"}
#: JSON spells the floats it has no numbers for as these strings, both ways.
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_TENSOR_KEYS = frozenset({"datatype", "shape", "data"})
_OPTIONAL_KEYS = frozenset({"name", "parameters"})


def torch_available() -> bool:
    """True when torch is installed: tensors then come back as torch tensors."""
    return torch is not None


def is_tensor(value: Any) -> bool:
    """True for a numpy array, or a torch tensor where torch is installed."""
    return isinstance(value, np.ndarray) or (torch is not None and isinstance(value, torch.Tensor))


def is_json_tensor(value: Any) -> bool:
    """True for an OIP JSON tensor object: a mapping whose keys are datatype, shape and
    data, and optionally name and parameters."""
    if not isinstance(value, Mapping):
        return False
    keys = set(value)
    return _TENSOR_KEYS <= keys and keys <= _TENSOR_KEYS | _OPTIONAL_KEYS


@dataclass(frozen=True)
class WireTensor:
    """One tensor in the client's hands: its OIP ``datatype`` and its values in ``array``
    (C order, native byte order; BF16 as ``uint16`` words)."""

    datatype: str
    array: np.ndarray

    @property
    def shape(self) -> list[int]:
        return list(self.array.shape)

    def to_bytes(self) -> bytes:
        """The raw little-endian row-major bytes of the binary formats."""
        return self.array.astype(self.array.dtype.newbyteorder("<"), copy=False).tobytes()

    def float64(self) -> np.ndarray:
        """The values as float64 (BF16 widened exactly)."""
        return (_widen_bf16(self.array) if self.datatype == "BF16" else self.array).astype(np.float64)

    def json_data(self) -> list:
        """Flat row-major JSON values; non-finite floats as "NaN", "Infinity", "-Infinity"."""
        flat = (_widen_bf16(self.array) if self.datatype == "BF16" else self.array).reshape(-1)
        values = flat.tolist()
        if flat.dtype.kind == "f" and not np.isfinite(flat).all():
            values = [_spell(v) for v in values]
        return values


def _spell(value: float) -> float | str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def _widen_bf16(words: np.ndarray) -> np.ndarray:
    """float32 values of BF16 words: each word is the upper half of its float32."""
    return (words.astype(np.uint32) << 16).view(np.float32)


# -- what a user passes ------------------------------------------------------------------


def to_wire(value: Any, label: str = "tensor") -> WireTensor:
    """A :class:`WireTensor` of a torch tensor, a numpy array or scalar, an OIP JSON tensor
    object, a number, or a (nested) list of numbers. Numbers and lists follow
    ``torch.tensor``'s dtype rules: booleans are BOOL, integers INT64, floats FP32."""
    if isinstance(value, WireTensor):
        return value
    if torch is not None and isinstance(value, torch.Tensor):
        return _from_torch(value, label)
    if isinstance(value, np.ndarray):
        return _from_numpy(value, label)
    if is_json_tensor(value):
        return from_json(value, label)
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, (bool, int, float, list, tuple)):
        return _from_python(value, label)
    raise CodecError(
        f"{label} is a {type(value).__name__}; a tensor must be a numpy array"
        f"{', a torch tensor' if torch is not None else ''}, a number or a list of numbers"
    )


def _from_numpy(array: np.ndarray, label: str) -> WireTensor:
    native = array.dtype.newbyteorder("=")
    datatype = _DATATYPE_OF_NUMPY.get(native)
    if datatype is None:
        raise CodecError(
            f"{label}: numpy dtype {array.dtype} has no wire datatype; use one of "
            + ", ".join(str(d) for d in _DATATYPE_OF_NUMPY)
            + (" (BF16: a torch.bfloat16 tensor)" if torch is not None else " (BF16 needs torch)")
        )
    # order="C" copies only an array that is not C-contiguous (ascontiguousarray would make 0-d arrays 1-d)
    return WireTensor(datatype, np.asarray(array.astype(native, copy=False), order="C"))


def _from_python(value: Any, label: str) -> WireTensor:
    try:
        array = np.asarray(value)
    except (ValueError, OverflowError) as exc:
        raise CodecError(f"{label}: cannot make a tensor of {value!r:.80}: {exc}") from None
    if array.dtype.kind == "f":
        with np.errstate(over="ignore"):
            array = array.astype(np.float32)  # torch.tensor's default float dtype
    elif array.dtype.kind in "iu" and array.dtype != np.int64:
        raise CodecError(f"{label}: {value!r:.80} is out of the INT64 range")
    elif array.dtype.kind not in "bi":
        raise CodecError(f"{label}: cannot make a tensor of {value!r:.80}: not numbers")
    return _from_numpy(array, label)


def _from_torch(tensor: Any, label: str) -> WireTensor:
    tensor = tensor.detach()
    if tensor.layout is not torch.strided:
        tensor = tensor.to_dense()
    tensor = tensor.cpu().resolve_conj().resolve_neg().contiguous()
    if tensor.dtype is torch.bfloat16:
        return WireTensor("BF16", tensor.view(torch.int16).numpy().view(np.uint16))
    try:
        array = tensor.numpy()
    except TypeError:
        array = None
    if array is None or array.dtype not in _DATATYPE_OF_NUMPY:
        raise CodecError(f"{label}: dtype {tensor.dtype} has no wire datatype")
    return WireTensor(_DATATYPE_OF_NUMPY[array.dtype], array)


# -- what the service sends ----------------------------------------------------------------


def check_shape(shape: Any, label: str) -> list[int]:
    """A shape as a list of non-negative ints, or a :class:`CodecError`."""
    if not isinstance(shape, (list, tuple)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise CodecError(f"{label}: shape must be a list of non-negative integers, got {shape!r:.200}")
    return list(shape)


def check_datatype(datatype: Any, label: str) -> str:
    """An OIP datatype name the service speaks, or a :class:`CodecError`."""
    if isinstance(datatype, str) and datatype in DATATYPES:
        return datatype
    raise CodecError(f"{label}: unknown datatype {datatype!r:.40}; the service speaks {', '.join(DATATYPES)}")


def from_buffer(raw: bytes | memoryview, datatype: str, shape: list[int], label: str) -> WireTensor:
    """A tensor of ``shape`` read from ``raw``, the little-endian bytes of ``datatype``
    (a copy: the tensor owns its values and is writable)."""
    wire_dtype = DATATYPES[datatype]
    needed = math.prod(shape) * wire_dtype.itemsize
    if len(raw) != needed:
        raise CodecError(f"{label}: {len(raw)} bytes, but shape {shape} of {datatype} needs {needed}")
    if datatype == "BOOL":
        array = np.frombuffer(raw, dtype=np.uint8)
        if array.size and int(array.max()) > 1:
            raise CodecError(f"{label}: BOOL bytes must be 0 or 1")
        return WireTensor(datatype, array.astype(np.bool_).reshape(shape))
    array = np.frombuffer(raw, dtype=wire_dtype.newbyteorder("<")).astype(wire_dtype, copy=True)
    return WireTensor(datatype, array.reshape(shape))


def _flatten(data: Any, label: str) -> list:
    if not isinstance(data, (list, tuple)):
        raise CodecError(f"{label}: data must be a list, got {type(data).__name__}")
    flat: list = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, (list, tuple)):
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


def from_json(obj: Mapping[str, Any], label: str = "tensor") -> WireTensor:
    """A tensor from an OIP JSON tensor object (flat or nested row-major ``data``), its
    datatype, shape, value count and value range checked."""
    for key in ("datatype", "shape", "data"):
        if key not in obj:
            raise CodecError(f"{label}: missing {key!r}")
    datatype = check_datatype(obj["datatype"], label)
    shape = check_shape(obj["shape"], label)
    values = _flatten(obj["data"], label)
    if len(values) != math.prod(shape):
        raise CodecError(f"{label}: data has {len(values)} values but shape {shape} needs {math.prod(shape)}")
    if datatype == "BOOL":
        if not all(type(v) is bool for v in values):
            raise CodecError(f"{label}: BOOL data must be true or false")
        return WireTensor(datatype, np.array(values, dtype=np.bool_).reshape(shape))
    if datatype.startswith(("INT", "UINT")):
        if not all(type(v) is int or (type(v) is float and v.is_integer()) for v in values):
            raise CodecError(f"{label}: {datatype} data must be integers")
        info = np.iinfo(DATATYPES[datatype])
        ints = [int(v) for v in values]
        if ints and (min(ints) < info.min or max(ints) > info.max):
            raise CodecError(f"{label}: a value is out of range for {datatype} ({info.min}..{info.max})")
        return WireTensor(datatype, np.array(ints, dtype=DATATYPES[datatype]).reshape(shape))
    if not all(type(v) in (int, float) or (type(v) is str and v in _NON_FINITE) for v in values):
        raise CodecError(f'{label}: {datatype} data must be numbers (or "NaN", "Infinity", "-Infinity")')
    wide = np.array([_NON_FINITE.get(v, v) if type(v) is str else v for v in values], dtype=np.float64)
    return WireTensor(datatype, _narrow(wide, datatype, label).reshape(shape))


def _narrow(wide: np.ndarray, datatype: str, label: str) -> np.ndarray:
    """float64 values as ``datatype`` (BF16: its words); a finite value that would
    overflow is an error."""
    if datatype == "FP64":
        return wide
    if datatype == "BF16" and torch is not None:
        narrow = torch.from_numpy(wide).to(torch.bfloat16)
        values, words = narrow.float().numpy(), narrow.view(torch.int16).numpy().view(np.uint16)
    elif datatype == "BF16":  # without torch only exact BF16 values are taken: their upper 16 bits
        with np.errstate(over="ignore"):
            words = (wide.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        values = _widen_bf16(words)
        inexact = ~((values == wide) | np.isnan(wide) | np.isinf(values))
        if inexact.any():
            raise CodecError(
                f"{label}: {wide[inexact][0]!r} is not a BF16 value; rounding to BF16 needs torch (or send FP32)"
            )
    else:
        with np.errstate(over="ignore"):
            values = words = wide.astype(DATATYPES[datatype])
    if (np.isinf(values) & np.isfinite(wide)).any():
        raise CodecError(f"{label}: a value is out of range for {datatype}")
    return words


def to_user(tensor: WireTensor) -> Tensor:
    """What a user gets for a tensor from the service: a torch tensor where torch is
    installed, else a numpy array (BF16 widened to float32)."""
    if torch is None:
        return _widen_bf16(tensor.array) if tensor.datatype == "BF16" else tensor.array
    if tensor.datatype == "BF16":
        return torch.from_numpy(tensor.array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(tensor.array)

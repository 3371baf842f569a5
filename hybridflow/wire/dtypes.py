"""Datatypes and shapes: OIP datatype names to torch and numpy, item sizes, shape checks,
and turning tensors and numpy arrays into plain CPU tensors with a wire datatype.

Datatypes: BOOL, UINT8, INT8, INT16, INT32, INT64, FP16, BF16, FP32, FP64 (no BYTES). BF16
travels as floats in JSON and as its raw 2 bytes in binary.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hybridflow.wire.errors import WireError
from hybridflow.wire.limits import DEFAULT_LIMITS, WireLimits

__all__ = [
    "DATATYPES",
    "DATATYPE_OF",
    "check_shape",
    "datatype_of",
    "itemsize",
    "numpy_to_torch",
    "plain_cpu",
    "tensor_from_buffer",
    "torch_dtype",
    "wire_numpy_dtype",
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
_WIRE_NUMPY: dict[str, np.dtype] = {
    name: np.dtype(code)
    for name, code in {
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
    }.items()
}


def torch_dtype(datatype: Any, label: str = "tensor") -> torch.dtype:
    """The torch dtype of an OIP datatype name."""
    if isinstance(datatype, str) and datatype in DATATYPES:
        return DATATYPES[datatype]
    if datatype == "BYTES":
        raise WireError(f"{label}: datatype BYTES (strings) is not supported; use {', '.join(DATATYPES)}")
    raise WireError(f"{label}: unknown datatype {datatype!r}; use one of {', '.join(DATATYPES)}")


def datatype_of(dtype: torch.dtype, label: str = "tensor") -> str:
    """The OIP datatype name of a torch dtype."""
    try:
        return DATATYPE_OF[dtype]
    except KeyError:
        raise WireError(
            f"{label}: dtype {dtype} has no wire datatype; use one of "
            + ", ".join(str(d).removeprefix("torch.") for d in DATATYPE_OF)
        ) from None


def wire_numpy_dtype(datatype: str) -> np.dtype:
    """The little-endian numpy dtype of a datatype's binary layout (BF16: 16-bit words)."""
    return _WIRE_NUMPY[datatype]


def itemsize(datatype: str) -> int:
    """Bytes per element of an OIP datatype in the binary layout."""
    return _WIRE_NUMPY[datatype].itemsize


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
            raise WireError(f"{label}: shape must be a list of integers, got {list(shape)!r}")
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


def plain_cpu(tensor: torch.Tensor, label: str) -> torch.Tensor:
    """A detached, dense CPU tensor with a wire datatype."""
    tensor = tensor.detach()
    if tensor.layout is not torch.strided:
        tensor = tensor.to_dense()
    datatype_of(tensor.dtype, label)
    tensor = tensor.cpu()
    if tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg()
    return tensor


def numpy_to_torch(array: np.ndarray, label: str) -> torch.Tensor:
    """A torch tensor with a wire datatype from a numeric numpy array (any byte order)."""
    if array.dtype.kind not in "biuf":
        raise WireError(f"{label}: numpy dtype {array.dtype} has no wire datatype")
    native = array.astype(array.dtype.newbyteorder("="), copy=False)
    try:
        tensor = torch.from_numpy(np.ascontiguousarray(native))
    except TypeError:
        raise WireError(f"{label}: numpy dtype {array.dtype} has no wire datatype") from None
    datatype_of(tensor.dtype, label)
    return tensor


def tensor_from_buffer(raw: memoryview, datatype: str, shape: list[int], label: str) -> torch.Tensor:
    """A tensor of ``shape`` from ``raw``, the little-endian bytes of ``datatype`` (their
    count already checked against the shape). Where ``raw`` is writable and its bytes lie
    aligned in native order, the tensor is a view of them, not a copy: a large request body
    is then held once, not twice. Otherwise the tensor gets a copy of its own, so it is
    always writable. BOOL bytes must be 0 or 1."""
    array = np.frombuffer(raw, dtype=wire_numpy_dtype(datatype))
    if raw.readonly or not array.flags.aligned or not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="), copy=True)
    if datatype == "BOOL":
        if array.size and int(array.max()) > 1:
            raise WireError(f"{label}: BOOL bytes must be 0 or 1")
        return torch.from_numpy(array).view(torch.bool).reshape(shape)
    tensor = torch.from_numpy(array)
    if datatype == "BF16":
        tensor = tensor.view(torch.bfloat16)
    return tensor.reshape(shape)

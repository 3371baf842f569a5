"""Tensors in a caller's hands and on the wire: what a caller passes (a torch tensor, a
numpy array or scalar, an OIP JSON tensor object, a number, a list of numbers) becomes a
:class:`~hybridflow_client.wire.datatypes.WireTensor` (:func:`to_wire`), and a decoded one
becomes a torch tensor without a copy (:func:`to_torch`).

torch is optional and never imported here until a caller asks for a torch tensor: a torch
tensor can only be at hand once torch is imported, so it is recognised through
``sys.modules``. Numbers and lists follow ``torch.tensor``'s dtype rules: booleans are
BOOL, integers INT64, floats FP32.
"""

from __future__ import annotations

import functools
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from hybridflow_client.wire.datatypes import DATATYPES, WireTensor
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.tensor_objects import from_json, is_json_tensor

if TYPE_CHECKING:
    from typing import TypeAlias

    import torch as _torch

    #: What a client hands back: a torch tensor where torch is installed, else a numpy array.
    Tensor: TypeAlias = _torch.Tensor | np.ndarray

__all__ = [
    "datatype_of_torch",
    "element_count",
    "installed_torch",
    "is_tensor",
    "tensor_nbytes",
    "to_torch",
    "to_wire",
    "torch_dtype",
]

#: numpy dtype -> OIP datatype name, for the arrays a caller may pass (BF16 has none).
_DATATYPE_OF_NUMPY = {dtype: name for name, dtype in DATATYPES.items() if name != "BF16"}


@functools.cache
def installed_torch() -> ModuleType | None:
    """torch where it is installed (imported on this first call), else None: whether a
    client hands tensors back as torch tensors."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def _torch_tensor_type() -> type | None:
    torch = sys.modules.get("torch")
    return None if torch is None else torch.Tensor


def is_tensor(value: Any) -> bool:
    """True for a numeric numpy array or a torch tensor (what encoders take as a tensor)."""
    if isinstance(value, np.ndarray):
        return value.dtype.kind in "biuf"
    kind = _torch_tensor_type()
    return kind is not None and isinstance(value, kind)


def element_count(value: Any) -> int:
    """Elements of a tensor (torch or numpy) or a :class:`WireTensor`."""
    if isinstance(value, WireTensor):
        return int(value.array.size)
    if isinstance(value, np.ndarray):
        return int(value.size)
    return int(value.numel())


def tensor_nbytes(value: Any) -> int:
    """Bytes a tensor-like value holds (a number: 8)."""
    if isinstance(value, (WireTensor, np.ndarray)):
        return int(value.nbytes)
    kind = _torch_tensor_type()
    if kind is not None and isinstance(value, kind):
        return value.numel() * value.element_size()
    return 8


def to_wire(value: Any, label: str = "tensor") -> WireTensor:
    """A :class:`WireTensor` of a torch tensor, a numpy array or scalar, an OIP JSON tensor
    object, a number, or a (nested) list of numbers; a :class:`WireError` names why not."""
    if isinstance(value, WireTensor):
        return value
    kind = _torch_tensor_type()
    if kind is not None and isinstance(value, kind):
        return _from_torch(value, label)
    if isinstance(value, np.ndarray):
        return _from_numpy(value, label)
    if is_json_tensor(value):
        return from_json(value, label)
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, (bool, int, float, list, tuple)):
        return _from_python(value, label)
    raise WireError(
        f"{label} is a {type(value).__name__}; a tensor is a torch tensor, a numpy array, a number or a list of numbers"
    )


def _no_datatype(label: str, dtype: Any) -> WireError:
    names = ", ".join(str(d) for d in _DATATYPE_OF_NUMPY)
    return WireError(f"{label}: dtype {dtype} has no wire datatype; use one of {names} (or bfloat16 in torch)")


def _from_numpy(array: np.ndarray, label: str) -> WireTensor:
    native = array.dtype.newbyteorder("=")
    datatype = _DATATYPE_OF_NUMPY.get(native)
    if datatype is None:
        raise _no_datatype(label, f"{array.dtype} (numpy)")
    # order="C" copies only an array that is not C-contiguous (ascontiguousarray would make 0-d arrays 1-d)
    return WireTensor(datatype, np.asarray(array.astype(native, copy=False), order="C"))


def _from_python(value: Any, label: str) -> WireTensor:
    try:
        array = np.asarray(value)
    except (ValueError, OverflowError) as exc:
        raise WireError(f"{label}: cannot make a tensor of {value!r:.80}: {exc}") from None
    if array.dtype.kind == "f":
        with np.errstate(over="ignore"):
            array = array.astype(np.float32)  # torch.tensor's default float dtype
    elif array.dtype.kind in "iu" and array.dtype != np.int64:
        raise WireError(f"{label}: cannot make a tensor of {value!r:.80}: out of the INT64 range")
    elif array.dtype.kind not in "bi":
        raise WireError(f"{label}: cannot make a tensor of {value!r:.80}: not numbers")
    return _from_numpy(array, label)


def _from_torch(tensor: Any, label: str) -> WireTensor:
    torch = sys.modules["torch"]
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
        raise _no_datatype(label, tensor.dtype)
    return WireTensor(_DATATYPE_OF_NUMPY[array.dtype], array)


def _torch() -> ModuleType:
    try:
        import torch
    except ImportError:
        raise WireError("torch tensors need torch installed") from None
    return torch


def to_torch(tensor: WireTensor) -> Any:
    """A torch tensor of a :class:`WireTensor`, sharing its memory (no copy)."""
    torch = _torch()
    if tensor.datatype == "BF16":
        return torch.from_numpy(tensor.array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(tensor.array)


@functools.cache
def _torch_dtypes() -> dict[str, Any]:
    torch = _torch()
    return {
        name: torch.bfloat16 if name == "BF16" else torch.from_numpy(np.empty(0, dtype)).dtype
        for name, dtype in DATATYPES.items()
    }


@functools.cache
def _datatypes_of_torch() -> dict[Any, str]:
    return {dtype: name for name, dtype in _torch_dtypes().items()}


def torch_dtype(datatype: str) -> Any:
    """The torch dtype of an OIP datatype name."""
    return _torch_dtypes()[datatype]


def datatype_of_torch(dtype: Any, label: str = "tensor") -> str:
    """The OIP datatype name of a torch dtype, or a :class:`WireError`."""
    try:
        return _datatypes_of_torch()[dtype]
    except KeyError:
        raise _no_datatype(label, dtype) from None

"""Sending CPU tensors to Ray actors as out-of-band numpy buffers (opt-in, per process).

By default Ray pickles a ``torch.Tensor`` the way torch does: the whole storage is written
into the pickle stream (a copy), the stream into the object store (a second copy), and the
receiver unpickles a third. :func:`send_tensors_out_of_band` makes this process hand Ray a
numpy view of each plain CPU tensor instead; Ray writes its buffer to the object store
out of band (one copy), and the receiver rebuilds a writable tensor of its own from it (one
copy), so a rank may still modify its inputs in place. docs/benchmarks.md has what it saves.

What differs from torch's path: a tensor arrives contiguous (a transposed view arrives as
a transposed copy), and tensors that shared a storage arrive as separate ones. Tensors
numpy cannot hold (CUDA, sparse, quantized, requiring grad, subclasses such as
``nn.Parameter``, dtypes without a numpy twin) keep torch's own path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

#: dtypes whose values numpy holds as they are.
_NUMPY_DTYPES = {
    torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128,
}
#: dtypes sent as the bits of a numpy dtype of the same width, viewed back on arrival.
_BIT_VIEWS = {torch.bfloat16: torch.int16}


class _TorchPath:
    """A tensor for torch's own pickling (the deserializer gets the tensor back)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce__(self) -> Any:
        return self.tensor.__reduce_ex__(5)


def _plain(tensor: torch.Tensor) -> bool:
    return (
        type(tensor) is torch.Tensor
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.requires_grad
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
        and (tensor.dtype in _NUMPY_DTYPES or tensor.dtype in _BIT_VIEWS)
    )


def _serialize(tensor: torch.Tensor) -> Any:
    if not _plain(tensor):
        return _TorchPath(tensor)
    view = _BIT_VIEWS.get(tensor.dtype)
    array = (tensor if view is None else tensor.view(view)).numpy()
    return array, None if view is None else str(tensor.dtype).removeprefix("torch.")


def _deserialize(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):  # came by torch's path
        return value
    array, view = value
    # The array may be a read-only view of the object store: the copy is the rank's own.
    tensor = torch.from_numpy(np.array(array, copy=True))
    return tensor if view is None else tensor.view(getattr(torch, view))


def send_tensors_out_of_band() -> None:
    """From now on, this process sends plain CPU tensors to Ray as numpy buffers out of
    band (see the module's docstring). Ray must be initialised in this process."""
    import ray

    ray.util.register_serializer(torch.Tensor, serializer=_serialize, deserializer=_deserialize)

"""single_controller.ray.tensor_transport without Ray: what its serializer hands Ray, pickled
with protocol 5 and out-of-band buffers as Ray pickles it, comes back as an equal tensor of
the receiver's own; tensors numpy cannot hold take torch's path unchanged."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from single_controller.ray.tensor_transport import _deserialize, _serialize


def send(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The round trip, and how many bytes went out of band."""
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(_serialize(tensor), protocol=5, buffer_callback=buffers.append)
    # the receiver sees read-only memory, as an object in Ray's object store is
    received = [memoryview(bytes(b.raw())).toreadonly() for b in buffers]
    return _deserialize(pickle.loads(stream, buffers=received)), sum(b.raw().nbytes for b in buffers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int8, torch.uint8, torch.bool, torch.complex64])
def test_plain_tensors_go_out_of_band_and_arrive_equal_and_writable(dtype):
    tensor = (torch.rand(64, 32) * 100).to(dtype)
    got, out_of_band = send(tensor)
    assert got.dtype == dtype and got.shape == tensor.shape and torch.equal(got, tensor)
    assert out_of_band == tensor.numel() * tensor.element_size()  # the data never entered the stream
    got.zero_() if dtype is not torch.bool else got.logical_not_()  # the receiver's own memory
    assert not torch.equal(got, tensor)


def test_views_arrive_as_their_own_values():
    base = torch.arange(100, dtype=torch.float32).reshape(10, 10)
    row, _ = send(base[3])
    assert row.tolist() == base[3].tolist()
    column, _ = send(base[:, 2])  # not contiguous: numpy pickles the values, contiguous
    assert column.tolist() == base[:, 2].tolist() and column.is_contiguous()
    scalar, _ = send(torch.tensor(7.5))
    assert scalar.shape == () and scalar.item() == 7.5


def test_tensors_numpy_cannot_hold_keep_torchs_path():
    grad = torch.ones(3, requires_grad=True)
    got, out_of_band = send(grad)
    assert got.requires_grad and torch.equal(got.detach(), grad.detach()) and out_of_band == 0
    parameter = torch.nn.Parameter(torch.ones(2))
    assert type(_serialize(parameter)).__name__ == "_TorchPath"
    sparse = torch.eye(3).to_sparse()
    got, _ = send(sparse)
    assert got.is_sparse and torch.equal(got.to_dense(), torch.eye(3))


def test_a_read_only_numpy_backed_tensor_is_sent_too():
    # what a controller holds after Ray's zero-copy path: a tensor over read-only memory
    array = np.arange(6, dtype=np.float32)
    array.flags.writeable = False
    with pytest.warns(UserWarning, match="not writable"):
        tensor = torch.from_numpy(array)
    got, _ = send(tensor)
    assert got.tolist() == [0, 1, 2, 3, 4, 5]
    got.add_(1)
    assert got.tolist() == [1, 2, 3, 4, 5, 6]

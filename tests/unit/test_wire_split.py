"""A job's split (hybridflow.wire.split): its pieces are torch.tensor_split's, made as views
on demand, and a split that does not fit is refused, within limits.max_split_views, before
any view is made."""

from __future__ import annotations

import pytest
import torch

from hybridflow.wire.split import split_call
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.limits import WireLimits


def test_split_pieces_are_tensor_split_pieces_made_on_demand():
    x = torch.arange(22.0).reshape(11, 2)
    y = torch.arange(7.0)
    pieces = split_call([[x, y], "keep"], {"scale": 2}, 3)
    assert len(pieces) == 3
    for (args, kwargs), want_x, want_y in zip(pieces, torch.tensor_split(x, 3), torch.tensor_split(y, 3), strict=True):
        assert torch.equal(args[0][0], want_x) and torch.equal(args[0][1], want_y)
        assert args[1:] == ["keep"] and kwargs == {"scale": 2}
    assert pieces[-1][0][0][0].data_ptr() == x[8:].data_ptr()  # views, not copies
    assert list(split_call([1], {}, 1)) == [([1], {})]
    with pytest.raises(WireError, match="one argument that is a list of tensors"):
        split_call([], {"a": [x], "b": [y]}, 2)
    with pytest.raises(WireError, match="4 pieces, over the limit of 3"):
        split_call([], {"x": [x, y]}, 2, WireLimits(max_split_views=3))

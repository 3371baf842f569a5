"""TensorDict as a batch type: building one (tensors, jagged tensors, object columns,
metadata), splitting and joining it with jagged tensors of two and three dimensions, row
selection and padding, a DataProto's round trip through it, and what dispatch does
with such batches."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from single_controller import DataProto
from single_controller import tensordict_utils as tu
from single_controller.batch import chunk_batch, concat_batches, pad_batch, unpad_batch


def jagged(lengths, width: int | None = None) -> torch.Tensor:
    """Rows ``arange(n)`` (or ``arange(n)`` repeated over ``width`` rows: ragged on dim 2)."""
    parts = [torch.arange(n) if width is None else torch.arange(n).expand(width, n) for n in lengths]
    return torch.nested.as_nested_tensor(parts, layout=torch.jagged)


def shapes(nested: torch.Tensor) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in nested.unbind(0)]


def test_get_tensordict_builds_rows_columns_and_metadata():
    td = tu.get_tensordict(
        {"ids": jagged([2, 3]), "x": torch.ones(2, 3), "turns": [[], [{"role": "user"}]]}, {"step": 7}
    )
    assert td.batch_size == torch.Size([2])
    assert isinstance(td.get("turns"), NonTensorStack) and isinstance(td.get("step"), NonTensorData)
    assert tu.get(td, "turns") == [[], [{"role": "user"}]] and tu.get(td, "step") == 7
    assert tu.get(td, "missing", "default") == "default"
    assert tu.get_tensordict({}, {"only": "metadata"}).batch_size == torch.Size([])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize(
    "entries, metadata, message",
    [
        ({"a": torch.ones(2), "b": torch.ones(3)}, None, "same number of rows"),
        ({"a": [torch.ones(1)]}, None, "column of Python objects"),
        ({"a": torch.tensor(1.0)}, None, "needs a first \\(row\\) dimension"),
        ({"a": 3}, None, "expected a tensor, a list or a NonTensorStack"),
        ({"a": torch.ones(2)}, {"a": 1}, "both a per-row entry and batch metadata"),
        ("strided-nested", None, "layout=torch.jagged"),
    ],
)
def test_get_tensordict_names_what_does_not_fit(entries, metadata, message):
    if entries == "strided-nested":  # made here, where the warning it gives is filtered
        entries = {"a": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}
    with pytest.raises(ValueError, match=message):
        tu.get_tensordict(entries, metadata)


@pytest.mark.parametrize("width", [None, 3], ids=["2d", "3d-ragged-last"])
def test_chunk_and_concat_keep_jagged_rows(width):
    lengths = [1, 4, 2, 6, 3, 5]
    td = TensorDict({"ids": jagged(lengths, width), "x": torch.arange(6.0)}, batch_size=[6])
    parts = tu.chunk_tensordict(td, 3)
    assert [p["x"].tolist() for p in parts] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert shapes(parts[1]["ids"]) == shapes(td["ids"])[2:4]
    back = tu.concat_tensordict(parts)
    assert shapes(back["ids"]) == shapes(td["ids"]) and torch.equal(back["ids"].values(), td["ids"].values())
    # dispatch's own helpers take the same path; each part carries only its rows when sent
    pieces = chunk_batch(td, 3)
    assert len(pickle.dumps(pieces[0])) < len(pickle.dumps(td))
    assert shapes(concat_batches(pieces)["ids"]) == shapes(td["ids"])
    with pytest.raises(ValueError, match="does not split into 4 equal chunks"):
        tu.chunk_tensordict(td, 4)


def test_concat_nested_tensors_joins_rows_in_order():
    joined = tu.concat_nested_tensors([jagged([1, 2]), jagged([3])])
    assert shapes(joined) == [(1,), (2,), (3,)]
    with pytest.raises(ValueError, match="tensor 1 is not a nested tensor"):
        tu.concat_nested_tensors([jagged([1]), torch.ones(2, 2)])
    with pytest.raises(ValueError, match="nothing to concatenate"):
        tu.concat_nested_tensors([])


def test_padding_repeats_rows_from_the_start_and_unpad_drops_them():
    td = tu.get_tensordict({"ids": jagged([1, 2, 3]), "tag": ["a", "b", "c"]}, {"step": 1})
    padded, pad = tu.pad_to_divisor(td, 4)
    assert pad == 1 and shapes(padded["ids"]) == [(1,), (2,), (3,), (1,)]
    assert tu.get(padded, "tag") == ["a", "b", "c", "a"]
    assert shapes(tu.unpad(padded, pad)["ids"]) == [(1,), (2,), (3,)]
    via_dispatch, pad = pad_batch(td, 2)
    assert pad == 1 and shapes(unpad_batch(via_dispatch, pad)["ids"]) == [(1,), (2,), (3,)]


def test_index_select_contiguous_pop_and_assign():
    td = tu.get_tensordict({"ids": jagged([1, 2, 3]), "x": torch.arange(3.0).expand(2, 3).T})
    picked = tu.index_select_tensor_dict(td, [2, 0])
    assert shapes(picked["ids"]) == [(3,), (1,)] and picked["x"][:, 0].tolist() == [2.0, 0.0]
    assert not td["x"].is_contiguous() and tu.contiguous(td)["x"].is_contiguous()
    tu.assign_non_tensor(td, note="hello", per_row=[1, 2, 3])
    assert tu.pop(td, "note") == "hello" and "note" not in td.keys()
    assert tu.get_non_tensor_data(td, "per_row", None) == [1, 2, 3]


def test_a_dataproto_round_trips_through_a_tensordict():
    data = DataProto.from_dict(
        {"a": torch.tensor([1, 2])}, {"prompt": np.array(["hi", "yo"], dtype=object)}, {"temperature": 0.5}
    )
    td = data.to_tensordict()
    assert tu.get(td, "prompt") == ["hi", "yo"] and tu.get(td, "temperature") == 0.5
    back = DataProto.from_tensordict(td)
    assert back.batch["a"].tolist() == [1, 2] and back.non_tensor_batch["prompt"].tolist() == ["hi", "yo"]
    assert back.meta_info == {"temperature": 0.5}
    # its rows split and join like any batch
    assert tu.get(concat_batches(chunk_batch(td, 2)), "prompt") == ["hi", "yo"]


@pytest.mark.parametrize("width", [None, 3], ids=["2d", "3d-ragged-last"])
def test_a_jagged_tensor_travels_as_values_and_offsets(width):
    original = jagged([2, 0, 3], width)
    values, offsets, ragged_dim = tu.jagged_parts(original)
    assert offsets.tolist() == [0, 2, 2, 5] and ragged_dim == (1 if width is None else 2)
    rebuilt = tu.jagged_from_parts(values, offsets, ragged_dim)
    assert shapes(rebuilt) == shapes(original)
    assert all(torch.equal(a, b) for a, b in zip(rebuilt.unbind(0), original.unbind(0), strict=True))


@pytest.mark.parametrize(
    "offsets, ragged_dim, message",
    [
        (torch.tensor([1, 5]), 1, "start at 0"),
        (torch.tensor([0, 3, 2, 5]), 1, "never decrease"),
        (torch.tensor([0, 9]), 1, "end at 5"),
        (torch.tensor([[0, 5]]), 1, "1-D integer"),
        (torch.tensor([0.0, 5.0]), 1, "1-D integer"),
        (torch.tensor([0, 5]), 2, "ragged_dim must be between 1 and 1"),
    ],
)
def test_bad_offsets_are_refused(offsets, ragged_dim, message):
    with pytest.raises(ValueError, match=message):
        tu.jagged_from_parts(torch.arange(5), offsets, ragged_dim)

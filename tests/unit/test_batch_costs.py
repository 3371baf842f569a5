"""What the batch helpers cost, for every batch type: dispatch's round trip of a batch (pad,
split into parts, pickle each part as a rank receives it, concatenate, unpad) and the
wire's decoding of object columns take CPU time in proportion to the batch's bytes, at
most ``MAX_RATIO`` times what a dense tensor (or a DataProto) of the same bytes takes. The
costs are CPU-time ratios against a reference measured in the same test, never wall-clock
thresholds. Beside them, the vectorised jagged operations against rows computed one by
one, :class:`ObjectColumn` against tensordict's own ``NonTensorStack``, and the dynamic
batcher concatenating and splitting a large batch off the event loop."""

from __future__ import annotations

import asyncio
import json
import math
import pickle
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from hybridflow.control.batching import OFF_LOOP_BYTES, Batcher
from hybridflow.http.body import JSON
from hybridflow.http.call_body import parse_call_body
from hybridflow_client.wire.json_values import encode_json_value
from single_controller import tensordict_utils as tu
from single_controller.batch import chunk_batch, concat_batches, pad_batch, unpad_batch
from single_controller.jagged import concat_jagged, jagged_parts, select_jagged, slice_jagged, split_jagged
from single_controller.object_column import ObjectColumn, column_values
from single_controller.protocol import DataProto

#: The most a jagged or object batch may cost against a dense one of the same bytes.
MAX_RATIO = 3.0


@pytest.fixture
def one_thread():
    """torch on one thread while CPU time is measured: idle intra-op threads spin, and
    their spinning counts as the process's CPU time whatever the work."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def cpu_seconds(fn: Callable[[], object], repeats: int = 5, give_up_above: float = math.inf) -> float:
    """The least CPU time (``time.process_time``) of ``repeats`` runs of ``fn``; after a
    run over ``give_up_above``, no more (a cost that far off needs no second look)."""
    best = math.inf
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
        if best > give_up_above:
            break
    return best


def cost_ratio(subject: Callable[[], object], reference: Callable[[], object]) -> tuple[float, float]:
    """CPU seconds of ``subject`` and of ``reference``, each the least of a few runs."""
    reference_s = cpu_seconds(reference)
    return cpu_seconds(subject, give_up_above=10 * MAX_RATIO * reference_s), reference_s


def dispatch_round_trip(batch, ranks: int = 4):
    """What dispatch does with a batch for ``ranks`` ranks and back: pad, split, each part
    pickled and unpickled (as Ray sends it), the parts joined, the padding dropped."""
    padded, pad = pad_batch(batch, ranks)
    parts = [pickle.loads(pickle.dumps(part, protocol=5)) for part in chunk_batch(padded, ranks)]
    return unpad_batch(concat_batches(parts), pad)


def one_byte_rows(rows: int) -> torch.Tensor:
    """``rows`` rows of one int8 each, row ``i`` holding ``i % 100``."""
    return tu.jagged_from_parts(torch.arange(rows, dtype=torch.int64).remainder(100).to(torch.int8),
                                torch.arange(rows + 1), 1)


# -- costs -------------------------------------------------------------------------------


def test_a_jagged_batch_goes_through_dispatch_at_the_cost_of_a_dense_one_of_its_bytes(one_thread):
    # a million one-byte rows: 9 MB of values and offsets, enough that the fixed cost of
    # torch's nested-tensor calls (a millisecond or two a round trip) does not dominate
    rows = 1_000_001
    jagged = TensorDict({"ids": one_byte_rows(rows)}, batch_size=[rows])
    values, offsets, _ = jagged_parts(jagged["ids"])
    nbytes = values.numel() * values.element_size() + offsets.numel() * offsets.element_size()
    dense = TensorDict({"ids": torch.ones(nbytes, dtype=torch.int8)}, batch_size=[nbytes])

    jagged_s, dense_s = cost_ratio(lambda: dispatch_round_trip(jagged), lambda: dispatch_round_trip(dense))
    assert jagged_s <= MAX_RATIO * dense_s, (jagged_s, dense_s)
    back = dispatch_round_trip(jagged)
    back_values, back_offsets, _ = jagged_parts(back["ids"])
    assert torch.equal(back_offsets, torch.arange(rows + 1))
    assert torch.equal(back_values, torch.arange(rows).remainder(100).to(torch.int8))


def test_an_object_column_goes_through_dispatch_at_the_cost_of_a_dataprotos(one_thread):
    items = [f"row {i}" for i in range(200_001)]
    tensordict = tu.get_tensordict({"o": items, "x": torch.arange(len(items))})
    column = np.empty(len(items), dtype=object)
    column[:] = items
    dataproto = DataProto.from_dict({"x": torch.arange(len(items))}, {"o": column}, auto_padding=True)

    tensordict_s, dataproto_s = cost_ratio(lambda: dispatch_round_trip(tensordict),
                                           lambda: dispatch_round_trip(dataproto))
    assert tensordict_s <= MAX_RATIO * dataproto_s, (tensordict_s, dataproto_s)
    back = dispatch_round_trip(tensordict)
    assert tu.get(back, "o") == items and torch.equal(back["x"], torch.arange(len(items)))
    assert dispatch_round_trip(dataproto).non_tensor_batch["o"].tolist() == items


def test_an_object_column_decodes_at_the_cost_of_a_dataprotos():
    rows = 120_000  # the column of ints of a 240 KB body
    as_tensordict = {"__tensordict__": {"batch_size": [rows], "tensors": {}, "objects": {"o": [0] * rows}}}
    as_dataproto = {"__dataproto__": {"rows": rows, "batch": {}, "meta_info": {},
                                      "non_tensor_batch": {"o": {"dtype": "object", "shape": [rows], "data": [0] * rows}}}}
    tensordict_body = json.dumps({"kwargs": {"x": as_tensordict}}).encode()
    dataproto_body = json.dumps({"kwargs": {"x": as_dataproto}}).encode()
    tensordict_s, dataproto_s = cost_ratio(lambda: parse_call_body(JSON, tensordict_body),
                                           lambda: parse_call_body(JSON, dataproto_body))
    assert tensordict_s <= MAX_RATIO * dataproto_s, (tensordict_s, dataproto_s)
    decoded = parse_call_body(JSON, tensordict_body)[1]["x"]
    assert tu.get(decoded, "o") == [0] * rows and decoded.batch_size == torch.Size([rows])
    # and back to the wire as it came
    assert encode_json_value(decoded)["__tensordict__"]["objects"] == {"o": [0] * rows}


# -- jagged rows, against rows taken one by one -----------------------------------------


def rows_of(tensor: torch.Tensor) -> list[list]:
    return [row.tolist() for row in tensor.unbind(0)]


@pytest.mark.parametrize("width", [None, 3], ids=["ragged-dim-1", "ragged-dim-2"])
def test_jagged_rows_are_sliced_selected_split_and_joined_as_row_by_row(width):
    lengths = [2, 0, 3, 1, 4, 0, 2]
    rows = [torch.arange(n) * 10 + i if width is None else (torch.arange(n) * 10 + i).expand(width, n)
            for i, n in enumerate(lengths)]
    tensor = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    expected = [row.tolist() for row in rows]

    assert rows_of(slice_jagged(tensor, 2, 5)) == expected[2:5]
    assert rows_of(slice_jagged(tensor, 1, 4, copy=False)) == expected[1:4]
    assert rows_of(select_jagged(tensor, [6, 0, 0, 3])) == [expected[i] for i in (6, 0, 0, 3)]
    assert rows_of(select_jagged(tensor, torch.tensor([3, 4, 5]))) == expected[3:6]  # a run: one slice
    parts = split_jagged(tensor, [3, 1, 3])
    assert [rows_of(part) for part in parts] == [expected[:3], expected[3:4], expected[4:]]
    joined = concat_jagged([*parts, tensor])
    assert rows_of(joined) == expected + expected
    assert joined._ragged_idx == tensor._ragged_idx
    # each part owns its rows: pickled, it carries no other row's values
    values, _, _ = jagged_parts(parts[1])
    assert values.untyped_storage().nbytes() == values.numel() * values.element_size()


def test_a_jagged_tensor_with_gaps_between_its_rows_is_packed_without_a_tensor_per_row():
    values = torch.arange(10)
    gapped = torch.nested.nested_tensor_from_jagged(
        values, torch.tensor([0, 4, 6, 9]), lengths=torch.tensor([2, 1, 3])
    )
    packed_values, offsets, ragged_dim = jagged_parts(gapped)
    assert packed_values.tolist() == [0, 1, 4, 6, 7, 8] and offsets.tolist() == [0, 2, 3, 6] and ragged_dim == 1
    assert rows_of(select_jagged(gapped, [2, 0])) == [[6, 7, 8], [0, 1]]


def test_jagged_operations_name_what_does_not_fit():
    tensor = one_byte_rows(4)
    with pytest.raises(ValueError, match="rows \\[3, 9\\)"):
        slice_jagged(tensor, 3, 9)
    with pytest.raises(ValueError, match="add up to the tensor's 4 rows"):
        split_jagged(tensor, [1, 1])
    with pytest.raises(ValueError, match="outside \\[0, 4\\)"):
        select_jagged(tensor, [0, 4])
    wider = torch.nested.as_nested_tensor([torch.ones(2, 3), torch.ones(1, 3)], layout=torch.jagged)
    with pytest.raises(ValueError, match="differ in more than their ragged length"):
        concat_jagged([wider, torch.nested.as_nested_tensor([torch.ones(2, 4)], layout=torch.jagged)])


# -- object columns, against tensordict's NonTensorStack --------------------------------


def test_an_object_column_is_a_non_tensor_stack_that_builds_its_members_only_when_asked():
    items = ["a", [1, 2], {"k": None}, 3.5, None]
    column = tu.object_column(items)
    reference = NonTensorStack.from_list([NonTensorData(item) for item in items])
    assert isinstance(column, NonTensorStack) and column.batch_size == reference.batch_size
    assert column.tolist() == reference.tolist() == items
    td = TensorDict({"o": column, "x": torch.arange(5)}, batch_size=[5])
    assert column.__dict__["_members"] is None  # held in a TensorDict, listed, counted: no member yet
    # pickled as its list: the copy is an ObjectColumn with the same rows
    copy = pickle.loads(pickle.dumps(td)).get("o")
    assert type(copy) is ObjectColumn and copy.tolist() == items
    assert len(pickle.dumps(column)) < len(pickle.dumps(reference)) / 4
    # tensordict's own operations see a NonTensorStack, as they would the reference
    assert td[1]["o"] == [1, 2] and td[1:3].get("o").tolist() == items[1:3]
    assert torch.stack([NonTensorData(v) for v in items]).tolist() == column.tolist()
    column[0] = NonTensorData("changed")  # once built, the members are the column
    assert column.tolist()[0] == "changed" and pickle.loads(pickle.dumps(column)).tolist()[0] == "changed"


def test_object_columns_are_split_selected_and_joined_on_their_lists():
    td = tu.get_tensordict({"o": [f"r{i}" for i in range(6)], "x": torch.arange(6)}, {"step": 3})
    parts = tu.chunk_tensordict(td, 3)
    assert [tu.get(part, "o") for part in parts] == [["r0", "r1"], ["r2", "r3"], ["r4", "r5"]]
    assert all(type(part.get("o")) is ObjectColumn and part.get("o").__dict__["_members"] is None for part in parts)
    assert tu.get(tu.concat_tensordict(parts), "o") == [f"r{i}" for i in range(6)]
    picked = tu.index_select_tensor_dict(td, [5, -6])
    assert tu.get(picked, "o") == ["r5", "r0"] and picked["x"].tolist() == [5, 0] and tu.get(picked, "step") == 3
    assert tu.get(tu.slice_rows(td, 1, 3), "o") == ["r1", "r2"]
    # a plain NonTensorStack (as tensordict builds one) takes the same path
    plain = TensorDict({"o": NonTensorStack.from_list(["a", "b", "c"])}, batch_size=[3])
    padded, pad = pad_batch(plain, 2)
    assert pad == 1 and tu.get(padded, "o") == ["a", "b", "c", "a"]
    assert column_values(unpad_batch(padded, pad).get("o")) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="outside a batch of 6"):
        tu.index_select_tensor_dict(td, [6])


# -- the batcher ---------------------------------------------------------------------------


class Traced(torch.Tensor):
    """A tensor that records the thread each concatenation and split of it runs on."""

    seen: list[tuple[str, int]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.cat, torch.split, torch.Tensor.split):
            cls.seen.append((func.__name__, threading.get_ident()))
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("rows", [OFF_LOOP_BYTES // 4 // 64, 4], ids=["large", "small"])
def test_the_batcher_concatenates_and_splits_a_large_batch_off_the_event_loop(rows):
    Traced.seen = []

    async def run_batch(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    async def main():
        batcher = Batcher(run_batch, max_batch_size=2, max_delay_s=1.0)
        xs = [torch.full((rows, 64), float(i)).as_subclass(Traced) for i in range(2)]
        answers = await asyncio.gather(*(batcher.submit(x) for x in xs))
        return threading.get_ident(), answers

    loop_thread, answers = asyncio.run(main())
    assert [a.batch_size for a in answers] == [2, 2]
    assert [a.output.as_subclass(torch.Tensor).unique().tolist() for a in answers] == [[0.0], [2.0]]
    assert [name for name, _ in Traced.seen] == ["cat", "split"]
    large = 2 * rows * 64 * 4 >= OFF_LOOP_BYTES
    assert all((thread != loop_thread) == large for _, thread in Traced.seen), Traced.seen

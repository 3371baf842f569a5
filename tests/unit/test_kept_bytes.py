"""Byte bounds count what is kept: ``estimate_bytes`` counts numpy object arrays, strings,
bytes, ``NonTensorData``, ``NonTensorStack`` (an ``ObjectColumn`` too), TensorDicts and
DataProtos by their content, so ``limits.idempotency_bytes`` (the controller's
``IdempotencyCache``) and ``limits.jobs_result_bytes`` (which counts the same way) hold
for every batch type. The HTTP side of both bounds is in tests/e2e/test_loop_costs.py."""

from __future__ import annotations

import asyncio
import sys

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from hybridflow.control.contract import CallResult
from hybridflow.state.idempotency import IdempotencyCache, estimate_bytes
from single_controller import tensordict_utils as tu
from single_controller.protocol import DataProto

MIB = 1 << 20


def eight_mib(tag: str) -> str:
    return tag + "x" * (8 * MIB - len(tag))


def object_array(*items) -> np.ndarray:
    array = np.empty(len(items), dtype=object)
    array[:] = list(items)
    return array


#: Each batch type (and the plain values they hold) with one 8 MiB string in it.
HOLDERS = {
    "dataproto non_tensor_batch": lambda s: DataProto.from_dict({"x": torch.ones(1)}, {"text": object_array(s)}),
    "dataproto meta_info": lambda s: DataProto.from_dict({"x": torch.ones(1)}, meta_info={"text": s}),
    "tensordict objects": lambda s: tu.get_tensordict({"text": [s], "x": torch.ones(1)}),
    "tensordict metadata": lambda s: tu.get_tensordict({"x": torch.ones(1)}, {"text": s}),
    "tensordict plain NonTensorStack": lambda s: TensorDict(
        {"text": NonTensorStack.from_list([NonTensorData(s)])}, batch_size=[1]),
    "NonTensorData": lambda s: NonTensorData(s),
    "numpy object array": lambda s: object_array(s, 1, None),
    "bytes in a list": lambda s: [s.encode()],
    "str in a dict": lambda s: {"text": s},
}


@pytest.mark.parametrize("make", HOLDERS.values(), ids=HOLDERS.keys())
def test_an_8_mib_string_counts_8_mib_in_every_holder(make):
    counted = estimate_bytes(CallResult(output=make(eight_mib("a"))))
    assert 8 * MIB <= counted <= 8 * MIB + 64 * 1024, counted


def test_tensors_count_their_storage_and_jagged_tensors_their_values_and_offsets():
    base = torch.zeros(1 << 18)  # 1 MiB
    assert estimate_bytes(base[:10]) >= 1 * MIB  # a view keeps its whole storage
    assert estimate_bytes([base, base[5:], base]) < 1 * MIB + 4096  # counted once
    jagged = tu.jagged_from_parts(torch.ones(1000, dtype=torch.int8), torch.arange(1001), 1)
    assert 1000 + 8 * 1001 <= estimate_bytes(jagged) < 1000 + 8 * 1001 + 1024
    assert estimate_bytes(np.zeros(1000)) >= 8000


def test_shared_parts_count_once_and_a_cycle_ends():
    text = eight_mib("shared")
    assert estimate_bytes([text] * 100) < 9 * MIB
    cycle: list = []
    cycle += [cycle, cycle, {"again": cycle}]
    assert estimate_bytes(cycle) < 1024


def test_a_column_of_many_small_values_counts_each_without_building_members():
    column = tu.object_column([f"row {i}" for i in range(100_000)])
    counted = estimate_bytes(tu.get_tensordict({"o": column}))
    assert counted >= sum(sys.getsizeof(f"row {i}") for i in range(100_000))
    assert column.__dict__["_members"] is None  # read from its list, no tensorclass per row
    # past stop_above the count stops: only known to be over it
    assert 64 * 1024 < estimate_bytes(column, stop_above=64 * 1024) < counted


@pytest.mark.parametrize("kind", ["dataproto non_tensor_batch", "tensordict objects"])
def test_sixteen_answers_of_8_mib_under_a_64_mib_bound_drop_the_first(kind):
    make = HOLDERS[kind]

    async def scenario():
        cache: IdempotencyCache[CallResult] = IdempotencyCache(max_entries=10_000, max_bytes=64 * MIB)

        async def answer(i: int) -> CallResult:
            return CallResult(output=make(eight_mib(f"k{i}")))

        for i in range(16):
            await cache.run(f"k{i}", f"body-{i}", lambda i=i: answer(i))
        return cache

    cache = asyncio.run(scenario())
    assert cache.lookup("k0", "another body") is None  # dropped: a new body runs, no conflict
    assert cache.kept_bytes <= 64 * MIB and len(cache) <= 7
    assert cache.lookup("k15", "body-15") is not None

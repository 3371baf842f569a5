"""Dispatch and collect functions, tested as pure functions against a reported layout."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from tensordict import TensorDict

from single_controller.base.decorator import (
    DISPATCH_TABLE,
    PADDING_KEY,
    Dispatch,
    DispatchError,
    Execute,
    collect_all_to_all,
    register,
    register_dispatch_mode,
)
from single_controller.base.dispatch_registry import resolve_dispatch_mode


@dataclass
class RankInfo:
    tp_rank: int
    dp_rank: int
    pp_rank: int
    cp_rank: int = 0


class Layout:
    """A group that reports a Megatron layout, rank order tp fastest, then dp, then pp."""

    def __init__(self, tp: int, dp: int, pp: int, micro_dp_group_size: int = 1):
        self.tp_size, self.dp_size, self.pp_size, self.cp_size = tp, dp, pp, 1
        self.world_size = tp * dp * pp
        self.micro_dp_group_size = micro_dp_group_size
        self.infos = [
            RankInfo(tp_rank=r % tp, dp_rank=(r // tp) % dp, pp_rank=r // (tp * dp)) for r in range(self.world_size)
        ]

    def get_megatron_rank_info(self, rank: int) -> RankInfo:
        return self.infos[rank]


def run(mode, group, *args, **kwargs):
    spec = resolve_dispatch_mode(mode)
    return spec.dispatch_fn(group, *args, **kwargs)


def test_every_paper_protocol_is_in_the_table():
    for name in ("ONE_TO_ALL", "ALL_TO_ALL", "RANK_ZERO", "DP_COMPUTE", "DP_COMPUTE_PROTO", "MEGATRON_COMPUTE",
                 "MEGATRON_COMPUTE_PROTO", "MEGATRON_PP_AS_DP", "MEGATRON_PP_ONLY", "ALL_MICRO_DP"):
        assert Dispatch[name] in DISPATCH_TABLE
    # The HybridFlow paper's names resolve to the same modes.
    assert Dispatch["3D_PROTO"] is Dispatch.MEGATRON_COMPUTE_PROTO
    assert Dispatch["3D_PP_ONLY"] is Dispatch.MEGATRON_PP_ONLY
    assert Dispatch["3D_ALL_MICRO_DP"] is Dispatch.ALL_MICRO_DP
    assert Dispatch["DP_PROTO"] is Dispatch.DP_COMPUTE_PROTO


def test_one_to_all_broadcasts_without_touching_input():
    group = Layout(tp=1, dp=4, pp=1)
    payload = {"k": [1, 2]}
    args, kwargs = run(Dispatch.ONE_TO_ALL, group, 5, cfg=payload)
    assert args == ([5, 5, 5, 5],)
    assert kwargs == {"cfg": [payload] * 4}
    assert payload == {"k": [1, 2]}


def test_all_to_all_is_identity_and_collect_returns_list():
    group = Layout(tp=1, dp=2, pp=1)
    args, kwargs = run(Dispatch.ALL_TO_ALL, group, [1, 2], y=[3, 4])
    assert args == ([1, 2],) and kwargs == {"y": [3, 4]}
    assert collect_all_to_all(group, ["a", "b"]) == ["a", "b"]


def test_dp_compute_requires_one_item_per_rank():
    group = Layout(tp=1, dp=4, pp=1)
    x = [1, 2, 3, 4]
    args, _ = run(Dispatch.DP_COMPUTE, group, x)
    assert args == ([1, 2, 3, 4],) and args[0] is not x
    with pytest.raises(DispatchError, match=r"expected length 4, got 3"):
        run(Dispatch.DP_COMPUTE, group, x=[1, 2, 3])
    with pytest.raises(DispatchError, match="argument 'x'.*got int"):
        run(Dispatch.DP_COMPUTE, group, x=7)


def test_dp_compute_proto_pads_splits_and_collect_concatenates():
    group = Layout(tp=1, dp=4, pp=1)
    batch = TensorDict({"obs": torch.arange(10.0).reshape(10, 1)}, batch_size=[10])
    before = batch.clone()
    args, kwargs = run(Dispatch.DP_COMPUTE_PROTO, group, batch)
    assert kwargs[PADDING_KEY] == 2
    chunks = args[0]
    assert [c.batch_size[0] for c in chunks] == [3, 3, 3, 3]
    # padding repeats rows from the start: rows 0 and 1
    assert torch.equal(chunks[3]["obs"].flatten(), torch.tensor([9.0, 0.0, 1.0]))
    assert (batch == before).all()
    spec = resolve_dispatch_mode(Dispatch.DP_COMPUTE_PROTO)
    merged = spec.collect_fn(group, chunks)
    assert torch.equal(merged["obs"][:10], batch["obs"])
    with pytest.raises(DispatchError, match="TensorDict"):
        run(Dispatch.DP_COMPUTE_PROTO, group, [1, 2, 3, 4])


def test_megatron_compute_sends_each_dp_item_to_its_tp_pp_ranks_and_collects_tp0_last_pp():
    group = Layout(tp=2, dp=2, pp=2)  # 8 ranks
    a, b = object(), object()
    args, _ = run(Dispatch.MEGATRON_COMPUTE, group, [a, b])
    per_rank = args[0]
    for rank, info in enumerate(group.infos):
        assert per_rank[rank] is (a if info.dp_rank == 0 else b)
    outputs = [f"out{r}" for r in range(8)]
    collected = resolve_dispatch_mode(Dispatch.MEGATRON_COMPUTE).collect_fn(group, outputs)
    # tp=0, pp=1 ranks are 4 (dp0) and 6 (dp1)
    assert collected == ["out4", "out6"]
    with pytest.raises(DispatchError, match=r"one item per dp rank: expected length 2, got 3"):
        run(Dispatch.MEGATRON_COMPUTE, group, [1, 2, 3])


def test_megatron_compute_proto_chunks_by_dp():
    group = Layout(tp=2, dp=2, pp=1)
    batch = TensorDict({"x": torch.arange(4.0)}, batch_size=[4])
    args, kwargs = run(Dispatch.MEGATRON_COMPUTE_PROTO, group, batch)
    assert PADDING_KEY not in kwargs
    assert [a["x"].tolist() for a in args[0]] == [[0.0, 1.0], [0.0, 1.0], [2.0, 3.0], [2.0, 3.0]]
    out = resolve_dispatch_mode(Dispatch.MEGATRON_COMPUTE_PROTO).collect_fn(group, args[0])
    assert out["x"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_megatron_pp_as_dp_round_trips_in_order():
    group = Layout(tp=2, dp=2, pp=2)
    items = ["A", "B", "C", "D"]
    args, _ = run(Dispatch.MEGATRON_PP_AS_DP, group, items)
    for rank, info in enumerate(group.infos):
        assert args[0][rank] == items[info.dp_rank * 2 + info.pp_rank]
    # each rank echoes its input; tp=0 ranks give back the items in dispatch order
    collected = resolve_dispatch_mode(Dispatch.MEGATRON_PP_AS_DP).collect_fn(group, args[0])
    assert collected == items


def test_megatron_pp_only_broadcasts_and_collects_one_per_stage():
    group = Layout(tp=2, dp=2, pp=2)
    args, _ = run(Dispatch.MEGATRON_PP_ONLY, group, "w")
    assert args[0] == ["w"] * 8
    collected = resolve_dispatch_mode(Dispatch.MEGATRON_PP_ONLY).collect_fn(group, list(range(8)))
    assert collected == [0, 4]  # tp=0, dp=0 of pp 0 and pp 1


def test_all_micro_dp_splits_by_micro_dp_and_collects_local_rank_zero():
    group = Layout(tp=2, dp=2, pp=1, micro_dp_group_size=2)
    batch = TensorDict({"x": torch.arange(3.0)}, batch_size=[3])
    args, kwargs = run(Dispatch.ALL_MICRO_DP, group, batch)
    assert kwargs[PADDING_KEY] == 1
    assert [a["x"].tolist() for a in args[0]] == [[0.0, 1.0], [0.0, 1.0], [2.0, 0.0], [2.0, 0.0]]
    out = resolve_dispatch_mode(Dispatch.ALL_MICRO_DP).collect_fn(group, args[0])
    assert out["x"].tolist() == [0.0, 1.0, 2.0, 0.0]
    lists, _ = run(Dispatch.ALL_MICRO_DP, group, ["p", "q"])
    assert lists[0] == ["p", "p", "q", "q"]
    assert resolve_dispatch_mode(Dispatch.ALL_MICRO_DP).collect_fn(group, [0, 1, 2, 3]) == [0, 2]
    with pytest.raises(DispatchError, match="micro-dp group"):
        run(Dispatch.ALL_MICRO_DP, group, ["p", "q", "r"])


def test_megatron_modes_need_a_layout():
    class Plain:
        world_size = 2

    with pytest.raises(DispatchError, match="tp/pp/dp layout"):
        run(Dispatch.MEGATRON_COMPUTE, Plain(), [1])


def test_builtin_dispatch_never_mutates_arguments():
    group = Layout(tp=2, dp=2, pp=1)
    for mode, value in [
        (Dispatch.ONE_TO_ALL, [1, 2]),
        (Dispatch.DP_COMPUTE, [[1], [2], [3], [4]]),
        (Dispatch.MEGATRON_COMPUTE, [[1], [2]]),
        (Dispatch.MEGATRON_PP_AS_DP, [[1], [2]]),
        (Dispatch.ALL_MICRO_DP, [[1], [2], [3], [4]][:4 // group.micro_dp_group_size]),
    ]:
        snapshot = copy.deepcopy(value)
        run(mode, group, value, k=value)
        assert value == snapshot, mode


def test_register_rejects_unknown_modes_at_definition():
    with pytest.raises(ValueError, match="unknown dispatch mode"):
        register(dispatch_mode="NOT_A_MODE")
    with pytest.raises(ValueError, match="unknown dispatch mode"):
        register(dispatch_mode=42)
    with pytest.raises(ValueError, match="dispatch_fn"):
        register(dispatch_mode={"dispatch_fn": lambda g: g})
    with pytest.raises(ValueError, match="unknown execute mode"):
        register(Dispatch.ONE_TO_ALL, execute_mode="SOMETIMES")


def test_register_dispatch_mode_adds_a_named_mode():
    def first_only(group, *args, **kwargs):
        return tuple([a] + [None] * (group.world_size - 1) for a in args), {}

    def keep_first(group, outputs):
        return outputs[0]

    mode = register_dispatch_mode("TEST_FIRST_ONLY", first_only, keep_first)
    assert Dispatch.TEST_FIRST_ONLY is mode and Dispatch["TEST_FIRST_ONLY"] is mode
    args, _ = run(mode, Layout(tp=1, dp=3, pp=1), "a")
    assert args == (["a", None, None],)

    @register(Dispatch.TEST_FIRST_ONLY, Execute.RANK_ZERO)
    def method(self, x):
        return x

    with pytest.raises(ValueError, match="already registered"):
        register_dispatch_mode("TEST_FIRST_ONLY", first_only, keep_first)


def test_modes_pickle_by_name():
    import pickle

    assert pickle.loads(pickle.dumps(Dispatch.ONE_TO_ALL)) is Dispatch.ONE_TO_ALL
    assert pickle.loads(pickle.dumps(Execute.RANK_ZERO)) == Execute.RANK_ZERO

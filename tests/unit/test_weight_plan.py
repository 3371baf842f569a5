"""Weight layouts, the resharding planner and the transport choice, without Ray: every plan
applied to shards cut from known full tensors must rebuild the destination's shards
exactly, each destination rank receiving only its overlaps."""

from __future__ import annotations

import pytest
import torch

from single_controller.weights.layout import ParamSpec, RankWeights, WeightLayout, box_slices
from single_controller.weights.plan import plan_resharding
from single_controller.weights.transport import choose_transport

HIDDEN, FFN = 8, 16


def mlp_params(dtype: str = "float32") -> tuple[ParamSpec, ...]:
    return (
        ParamSpec("gate_proj", (FFN, HIDDEN), dtype, split_dim=0),
        ParamSpec("up_proj", (FFN, HIDDEN), dtype, split_dim=0),
        ParamSpec("down_proj", (HIDDEN, FFN), dtype, split_dim=1),
    )


def layout(tp: int, dp: int = 1, params=None, device: str = "cpu", keys=None) -> WeightLayout:
    """Megatron's order: tp fastest, then dp."""
    params = mlp_params() if params is None else params
    return WeightLayout.of(
        RankWeights(
            rank=r, tp_rank=r % tp, tp_size=tp, dp_rank=r // tp, params=params, device=device,
            device_key=keys[r] if keys else "",
        )
        for r in range(tp * dp)
    )


def full_tensors(params) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {p.name: torch.randn(p.shape, generator=g) for p in params}


def shards_of(lay: WeightLayout, full: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    return [{p.name: full[p.name][box_slices(r.box(p.name))].clone() for p in r.params} for r in lay.ranks]


def apply(plan, src_layout, src_shards, dst_layout) -> list[dict[str, torch.Tensor]]:
    """The plan run by hand: NaN-filled destination shards, each slice copied in once."""
    out = [{p.name: torch.full(r.shard_shape(p.name), float("nan")) for p in r.params} for r in dst_layout.ranks]
    for t in plan.transfers():
        target = out[t.dst_rank][t.param][box_slices(t.dst_slice)]
        assert torch.isnan(target).all(), "a destination element written twice"
        target.copy_(src_shards[t.src_rank][t.param][box_slices(t.src_slice)])
    return out


@pytest.mark.parametrize(
    ("src_tp", "src_dp", "dst_tp", "dst_dp"),
    [(4, 1, 2, 1), (4, 1, 1, 1), (2, 1, 4, 1), (2, 2, 4, 1), (4, 1, 2, 2), (1, 1, 8, 1), (8, 1, 2, 1)],
)
def test_plan_rebuilds_every_destination_shard(src_tp, src_dp, dst_tp, dst_dp):
    src, dst = layout(src_tp, src_dp), layout(dst_tp, dst_dp)
    full = full_tensors(mlp_params())
    plan = plan_resharding(src, dst)
    got = apply(plan, src, shards_of(src, full), dst)
    want = shards_of(dst, full)
    for g, w in zip(got, want, strict=True):
        assert all(torch.equal(g[k], w[k]) for k in w)
    # each destination rank receives exactly its shards' bytes: its overlaps, nothing more
    full_bytes = 3 * HIDDEN * FFN * 4
    assert plan.full_bytes == full_bytes
    assert plan.bytes_per_dst_rank() == [full_bytes // dst_tp] * (dst_tp * dst_dp)


def test_tp4_to_tp2_slices_are_the_overlaps():
    plan = plan_resharding(layout(4), layout(2))
    # dst rank 0 holds gate rows 0..7: rows 0..3 of src 0 and 4..7 of src 1 (their whole shards)
    gate = [t for t in plan.per_dst[0] if t.param == "gate_proj"]
    assert [(t.src_rank, t.src_slice, t.dst_slice) for t in gate] == [
        (0, ((0, 4), (0, HIDDEN)), ((0, 4), (0, HIDDEN))),
        (1, ((0, 4), (0, HIDDEN)), ((4, 8), (0, HIDDEN))),
    ]
    down = [t for t in plan.per_dst[1] if t.param == "down_proj"]
    assert [(t.src_rank, t.dst_slice) for t in down] == [(2, ((0, HIDDEN), (0, 4))), (3, ((0, HIDDEN), (4, 8)))]
    assert plan.slices_per_dst_rank() == [6, 6]
    assert plan.src_ranks == [0, 1, 2, 3]


def test_tp2_to_tp4_takes_half_of_one_source_shard():
    plan = plan_resharding(layout(2), layout(4))
    # dst rank 1: gate rows 4..7, the second half of src rank 0's rows 0..7
    (gate,) = [t for t in plan.per_dst[1] if t.param == "gate_proj"]
    assert (gate.src_rank, gate.src_slice, gate.dst_slice) == (0, ((4, 8), (0, HIDDEN)), ((0, 4), (0, HIDDEN)))
    # each source piece is put once: 4 destinations x 3 params, each piece distinct
    assert sum(len(p) for p in plan.pieces_by_src_rank()) == 12


def test_copies_take_turns_and_shared_pieces_are_put_once():
    # source tp2 x dp2: ranks 0 and 2 hold tp shard 0; destinations alternate between them
    plan = plan_resharding(layout(2, 2), layout(4))
    senders = {(t.dst_rank, t.param): t.src_rank for t in plan.transfers()}
    assert senders[(0, "gate_proj")] == 0 and senders[(1, "gate_proj")] == 2
    assert sorted(plan.src_ranks) == [0, 1, 2, 3]
    # destination tp2 x dp2: two dp copies need the same slices, put once each
    plan = plan_resharding(layout(4), layout(2, 2))
    assert sum(len(p) for p in plan.pieces_by_src_rank()) == 12
    assert len(list(plan.transfers())) == 24


def test_split_dimension_may_differ():
    row = (ParamSpec("w", (8, 6), split_dim=0),)
    col = (ParamSpec("w", (8, 6), split_dim=1),)
    full = full_tensors(row)
    src, dst = layout(2, params=row), layout(3, params=col)
    plan = plan_resharding(src, dst)
    got = apply(plan, src, shards_of(src, full), dst)
    assert all(torch.equal(g["w"], w["w"]) for g, w in zip(got, shards_of(dst, full), strict=True))
    # each destination column block crosses both source row blocks
    assert plan.slices_per_dst_rank() == [2, 2, 2]


def test_replicated_parameters_and_pipeline_stages():
    norm = ParamSpec("norm", (HIDDEN,), split_dim=None)
    first = (ParamSpec("layer0", (FFN, HIDDEN), split_dim=0), norm)
    second = (ParamSpec("layer1", (FFN, HIDDEN), split_dim=0),)
    # source: tp2 x pp2; destination: tp1 holding everything
    src = WeightLayout.of(
        RankWeights(rank=r, tp_rank=r % 2, tp_size=2, pp_rank=r // 2, params=first if r < 2 else second)
        for r in range(4)
    )
    dst = layout(1, params=first + second)
    full = full_tensors(first + second)
    plan = plan_resharding(src, dst)
    got = apply(plan, src, shards_of(src, full), dst)
    assert all(torch.equal(got[0][k], full[k]) for k in full)
    # the replicated norm comes from one tp rank, not both
    assert [t.src_rank for t in plan.per_dst[0] if t.param == "norm"] == [0]


def test_mismatches_are_refused_naming_each():
    src = layout(2)
    other = (
        ParamSpec("gate_proj", (FFN, HIDDEN + 1), split_dim=0),
        ParamSpec("up_proj", (FFN, HIDDEN), "bfloat16", split_dim=0),
        ParamSpec("o_proj", (HIDDEN, FFN), split_dim=1),
    )
    with pytest.raises(ValueError) as err:
        plan_resharding(src, layout(2, params=other))
    message = str(err.value)
    assert "the source holds no o_proj" in message
    assert "the destination holds no down_proj" in message
    assert f"gate_proj is [{FFN}, {HIDDEN}] in the source and [{FFN}, {HIDDEN + 1}] in the destination" in message
    assert "up_proj is float32 in the source and bfloat16 in the destination" in message


def test_a_source_that_misses_a_shard_is_refused():
    partial = WeightLayout.of(
        RankWeights(rank=r, tp_rank=0, tp_size=2, dp_rank=r, params=mlp_params()) for r in range(2)
    )
    with pytest.raises(ValueError, match=r"do not hold all of gate_proj once \(tp ranks \[0\] of 2"):
        plan_resharding(partial, layout(1))


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ParamSpec("w", (4, 0)), "shape must be positive integers"),
        (lambda: ParamSpec("w", (4,), "float31"), "unknown dtype 'float31'"),
        (lambda: ParamSpec("w", (4,), split_dim=1), "split_dim must be None or a dimension of"),
        (lambda: ParamSpec("", (4,)), "non-empty name"),
        (lambda: RankWeights(rank=0, tp_rank=0, tp_size=3, params=mlp_params()), "not divisible by tp 3"),
        (lambda: RankWeights(rank=0, tp_rank=2, tp_size=2), "tp_rank 2 is not in a tp of size 2"),
        (lambda: WeightLayout.of([RankWeights(rank=1)]), "layout rank 0 declares itself rank 1"),
        (lambda: WeightLayout.of([RankWeights(rank=0, tp_size=2), RankWeights(rank=1)]), "different tp sizes"),
        (
            lambda: WeightLayout.of(
                [RankWeights(rank=0, params=(ParamSpec("w", (4,)),)), RankWeights(rank=1, params=(ParamSpec("w", (5,)),))]
            ),
            "declare w differently",
        ),
    ],
)
def test_bad_layouts_raise_value_errors(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_layout_round_trips_through_json():
    import json

    lay = layout(2, 2)
    again = WeightLayout.from_dict(json.loads(json.dumps(lay.to_dict())))
    assert again == lay
    assert lay.to_dict()["full_bytes"] == 3 * HIDDEN * FFN * 4


def test_transport_choice():
    src, dst = layout(4), layout(2)
    plan = plan_resharding(src, dst)
    assert choose_transport(src, dst, plan).transport == "object_store"
    forced = choose_transport(src, dst, plan, "collective")
    assert (forced.transport, forced.backend) == ("collective", "gloo")
    gpus = layout(4, device="cuda", keys=[f"n/gpu{r}" for r in range(4)])
    apart = layout(2, device="cuda", keys=["n/gpu4", "n/gpu5"])
    assert choose_transport(gpus, apart, plan_resharding(gpus, apart)).backend == "nccl"
    # colocated: dst rank 0 shares src rank 0's GPU and needs its slices (dst rank 1 shares
    # src rank 1's, but takes nothing from it)
    together = layout(2, device="cuda", keys=["n/gpu0", "n/gpu1"])
    route = choose_transport(gpus, together, plan_resharding(gpus, together))
    assert route.transport == "object_store" and "share a GPU (src 0/dst 0);" in route.reason
    with pytest.raises(ValueError, match="cannot connect ranks on one GPU: src rank 0 and dst rank 0"):
        choose_transport(gpus, together, plan_resharding(gpus, together), "collective")
    with pytest.raises(ValueError, match="one kind of device"):
        choose_transport(gpus, dst, plan_resharding(gpus, dst), "collective")
    with pytest.raises(ValueError, match="unknown transport 'rdma'"):
        choose_transport(src, dst, plan, "rdma")

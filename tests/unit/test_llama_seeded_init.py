"""The seeded random init of the tp MLP layer, in process (no megatron, no Ray): the number
of draws follows a shard's parameters, not its rows, and any run of rows is the same
whoever draws it."""

from __future__ import annotations

import itertools
import types

import pytest
import torch

from single_controller.models import llama
from single_controller.models.llama import (
    DEFAULT_MAX_PARAMETERS,
    ParallelLlamaMLP,
    fill_master_rows,
    layer_spec,
)
from single_controller.models.llama_checkpoint import DOWN, GATE, UP

#: The most rows per parameter the default bound lets through: a layer of one hidden unit.
HOSTILE = {"hidden_size": 1, "intermediate_size": DEFAULT_MAX_PARAMETERS // 3 // 4 * 4}
TP = 4
#: Seeded draws allowed for a rank's shard of the hostile layer: 3 * 22369621 parameters,
#: so one draw per 16384 of them. Drawing per row would take one per parameter.
DRAW_BUDGET = 4096


class _TooManyDraws(AssertionError):
    pass


def _counting_normal(monkeypatch, budget: int) -> list[int]:
    """Counts ``Tensor.normal_`` calls given a generator (the seeded draws), failing at the
    first one over ``budget`` so that a per-row draw stops early instead of running on."""
    draws = [0]
    real = torch.Tensor.normal_

    def normal_(self, *args, **kwargs):
        if kwargs.get("generator") is not None:
            draws[0] += 1
            if draws[0] > budget:
                raise _TooManyDraws(f"more than {budget} seeded draws")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "normal_", normal_)
    return draws


def _unbuilt_layer(hidden: int, ffn: int, tp: int) -> ParallelLlamaMLP:
    """A layer's shard tensors without megatron, NaN until ``_init_shard`` fills them."""
    layer = ParallelLlamaMLP.__new__(ParallelLlamaMLP)
    torch.nn.Module.__init__(layer)
    layer.hidden_size, layer.intermediate_size, layer.tp = hidden, ffn, tp
    per_rank = ffn // tp
    layer.gate_up_proj = types.SimpleNamespace(weight=torch.full((2 * per_rank, hidden), float("nan")))
    layer.down_proj = types.SimpleNamespace(weight=torch.full((hidden, per_rank), float("nan")))
    return layer


def test_a_layer_of_one_hidden_unit_is_drawn_in_blocks_not_rows(monkeypatch):
    """The largest layer the default bound passes with hidden_size 1 (67M rows per matrix):
    a rank draws its 3 * 22M parameters with a few thousand seeded draws, as many as for
    any other shape of the same size, not one per row."""
    spec = layer_spec(HOSTILE, tp=TP)
    assert spec.parameter_count <= DEFAULT_MAX_PARAMETERS < spec.parameter_count + 3 * TP
    layer = _unbuilt_layer(spec.hidden_size, spec.intermediate_size, TP)
    draws = _counting_normal(monkeypatch, DRAW_BUDGET)
    layer._init_shard(seed=0, rank=TP - 1)
    assert 0 < draws[0] <= DRAW_BUDGET
    monkeypatch.undo()
    # every element drawn: N(0, 0.02), none left NaN
    for weight in (layer.gate_up_proj.weight, layer.down_proj.weight):
        assert not weight.isnan().any()
        assert abs(float(weight.std()) - llama.INIT_STD) < 1e-3
    # and the draws of a squarer layer of as many parameters are as many
    square = _unbuilt_layer(4096, spec.intermediate_size // 4096 // TP * TP, TP)
    square_draws = _counting_normal(monkeypatch, DRAW_BUDGET)
    square._init_shard(seed=0, rank=TP - 1)
    assert abs(square_draws[0] - draws[0]) <= 0.1 * draws[0]


@pytest.mark.parametrize("hidden", [1, 3, 300, 70_000])
def test_any_run_of_rows_is_the_same_whoever_draws_it(hidden):
    """Rows drawn in pieces (as tp ranks, or down's chunks, cut them), at offsets that fall
    inside blocks, equal the same rows drawn at once; the three matrices and the seeds
    differ."""
    rows = -(-3 * llama._BLOCK_ELEMENTS // hidden) + 5
    whole = {m: torch.empty(rows, hidden) for m in (GATE, UP, DOWN)}
    for matrix, out in whole.items():
        fill_master_rows(out, 7, matrix, 0)
    cuts = sorted({0, 1, rows // 3, rows // 2 + 1, rows - 2, rows})
    for matrix, out in whole.items():
        for begin, end in itertools.pairwise(cuts):
            piece = torch.empty(end - begin, hidden)
            fill_master_rows(piece, 7, matrix, begin)
            assert torch.equal(piece, out[begin:end]), (matrix, begin, end)
    assert not torch.equal(whole[GATE], whole[UP]) and not torch.equal(whole[UP], whole[DOWN])
    other = torch.empty(rows, hidden)
    fill_master_rows(other, 8, GATE, 0)
    assert not torch.equal(other, whole[GATE])


def test_a_matrix_has_at_most_2_to_the_46_elements():
    layer_spec({"hidden_size": 1 << 23, "intermediate_size": 1 << 23}, tp=1, max_parameters=None)
    with pytest.raises(ValueError, match=r"hidden_size x intermediate_size must be at most 2\*\*46"):
        layer_spec({"hidden_size": 1 << 23, "intermediate_size": (1 << 23) + 1}, tp=1, max_parameters=None)

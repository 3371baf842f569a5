"""ParallelLlamaMLP and MegatronWorker without Ray: tp processes on gloo (torch.multiprocessing),
each rank's output against an unsharded float64 reference assembled from the gathered shards."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from single_controller.rendezvous import free_port

HIDDEN, FFN, SEQ, BATCH = 64, 128, 8, 2
SEED = 7
TOLERANCE = 1e-5

ACTS = {
    "silu": torch.nn.functional.silu,
    "gelu_pytorch_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
}


def _config(megatron_tp: int, **changes):
    from omegaconf import OmegaConf

    base = {
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "hidden_act": "silu",
        "pretraining_tp": 1,
        "tp": megatron_tp,
    }
    return OmegaConf.create({**base, **changes})


def _build(megatron_tp: int, seed: int, **changes):
    from omegaconf import OmegaConf

    from single_controller.models.llama import ParallelLlamaMLP

    torch.manual_seed(seed)
    return ParallelLlamaMLP(
        config=_config(megatron_tp, **changes),
        megatron_config=OmegaConf.create({"sequence_parallel_enabled": False}),
    )


def _weights(layer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in layer.named_parameters()}


def _error_of(fn) -> str | None:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def _rank_main(rank: int, world: int, tp: int, port: int, out_dir: str) -> None:
    """One rank: join the group through MegatronWorker, build, run, record to out_dir."""
    # Worker reads its place from the environment, as under a worker group.
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    import torch.distributed as dist
    from megatron.core import parallel_state

    from single_controller.megatron.worker import MegatronWorker

    try:
        worker = MegatronWorker()
        worker.init_megatron(
            {
                "tensor_model_parallel_size": tp,
                "pipeline_model_parallel_size": 1,
                "num_layers_per_virtual_pipeline_stage": None,
            }
        )
        record: dict = {
            "rank_info": worker.get_megatron_rank_info(),
            "global_info": worker.get_megatron_global_info(),
        }
        x = torch.rand(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(1234))
        for act in ACTS:
            layer = _build(tp, SEED, hidden_act=act)
            with torch.no_grad():
                record[f"y_{act}"] = layer(x)
            record[f"weights_{act}"] = _weights(layer)
        record["x"] = x
        record["rebuilt"] = _weights(_build(tp, SEED))
        record["other_seed"] = _weights(_build(tp, SEED + 1))
        record["errors"] = {
            "bad_act": _error_of(lambda: _build(tp, SEED, hidden_act="swishy")),
            "bad_tp": _error_of(lambda: _build(tp, SEED, tp=tp + 1)),
            "indivisible": _error_of(lambda: _build(tp, SEED, intermediate_size=FFN + 1)),
            "bad_input": _error_of(lambda: layer(torch.rand(SEQ, BATCH, HIDDEN + 1))),
        }
        torch.save(record, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_ranks(world: int, tp: int, out_dir: Path) -> list[dict]:
    mp.start_processes(
        _rank_main, args=(world, tp, free_port(), str(out_dir)), nprocs=world, join=True, start_method="spawn"
    )
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _reference(shards: list[dict[str, torch.Tensor]], x: torch.Tensor, act) -> torch.Tensor:
    """The unsharded layer from one tp group's shards (in tp-rank order), in float64."""
    halves = [s["gate_up_proj.weight"].double().chunk(2, dim=0) for s in shards]
    gate = torch.cat([g for g, _ in halves], dim=0)
    up = torch.cat([u for _, u in halves], dim=0)
    down = torch.cat([s["down_proj.weight"].double() for s in shards], dim=1)
    h = x.double()
    return (act(h @ gate.T) * (h @ up.T)) @ down.T


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


# One run per layout, shared by the tests below (each run is a few seconds of process start).
_RUNS: dict[tuple[int, int], list[dict]] = {}


def _records(world: int, tp: int, tmp_path_factory) -> list[dict]:
    if (world, tp) not in _RUNS:
        _RUNS[(world, tp)] = _run_ranks(world, tp, tmp_path_factory.mktemp(f"world{world}-tp{tp}"))
    return _RUNS[(world, tp)]


@pytest.fixture(params=[(1, 1), (2, 2), (4, 4)], ids=lambda p: f"world{p[0]}-tp{p[1]}")
def ranks(request, tmp_path_factory):
    world, tp = request.param
    return tp, _records(world, tp, tmp_path_factory)


def test_layout_reported_by_worker(ranks):
    tp, records = ranks
    for rank, rec in enumerate(records):
        assert (rec["rank_info"].tp_rank, rec["rank_info"].dp_rank) == (rank, 0)
        assert (rec["rank_info"].pp_rank, rec["rank_info"].cp_rank) == (0, 0)
        g = rec["global_info"]
        assert (g.tp_size, g.dp_size, g.pp_size, g.cp_size) == (tp, 1, 1, 1)


def test_parameter_names_and_shapes(ranks):
    tp, records = ranks
    for rec in records:
        shapes = {name: tuple(w.shape) for name, w in rec["weights_silu"].items()}
        assert shapes == {
            "gate_up_proj.weight": (2 * FFN // tp, HIDDEN),
            "down_proj.weight": (HIDDEN, FFN // tp),
        }
        assert all(w.dtype == torch.float32 for w in rec["weights_silu"].values())


@pytest.mark.parametrize("act", list(ACTS))
def test_sharded_output_matches_unsharded_reference(ranks, act):
    tp, records = ranks
    shards = [rec[f"weights_{act}"] for rec in records]
    ref = _reference(shards, records[0]["x"], ACTS[act])
    for rec in records:
        y = rec[f"y_{act}"]
        assert y.shape == (SEQ, BATCH, HIDDEN) and y.dtype == torch.float32
        assert _rel_err(y, ref) <= TOLERANCE
    # the row-parallel all-reduce leaves every tp rank with the same output
    assert all(torch.equal(rec[f"y_{act}"], records[0][f"y_{act}"]) for rec in records)


def test_shards_cut_from_one_master_weight(ranks, tmp_path_factory):
    """Each rank holds gate shard r then up shard r of the same tp-independent master: the
    tp=1 weights, re-cut, equal every layout's shards. (A plain stride-1 column split would
    give tp=2's rank 0 all of gate and rank 1 all of up; this test catches that.)"""
    tp, records = ranks
    master = _records(1, 1, tmp_path_factory)[0]["weights_silu"]
    gate, up = master["gate_up_proj.weight"].chunk(2, dim=0)
    for r, rec in enumerate(records):
        expected_gate_up = torch.cat([gate.chunk(tp, dim=0)[r], up.chunk(tp, dim=0)[r]], dim=0)
        assert torch.equal(rec["weights_silu"]["gate_up_proj.weight"], expected_gate_up)
        assert torch.equal(
            rec["weights_silu"]["down_proj.weight"], master["down_proj.weight"].chunk(tp, dim=1)[r]
        )
        # and so every layout computes the tp=1 layer
        assert _rel_err(rec["y_silu"], _reference([master], rec["x"], ACTS["silu"])) <= TOLERANCE


def test_same_seed_same_weights(ranks):
    _, records = ranks
    for rec in records:
        assert rec["rebuilt"].keys() == rec["weights_silu"].keys()
        assert all(torch.equal(rec["rebuilt"][k], rec["weights_silu"][k]) for k in rec["rebuilt"])
        assert not torch.equal(rec["other_seed"]["down_proj.weight"], rec["weights_silu"]["down_proj.weight"])


def test_config_validation(ranks):
    tp, records = ranks
    errors = records[0]["errors"]
    assert "swishy" in errors["bad_act"]
    assert f"tp={tp + 1}" in errors["bad_tp"]
    assert "input must be [seq, batch, 64]" in errors["bad_input"]
    if tp > 1:
        assert f"intermediate_size {FFN + 1} is not divisible by tp {tp}" in errors["indivisible"]
    else:
        assert errors["indivisible"] is None

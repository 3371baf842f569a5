"""ParallelLlamaMLP and MegatronWorker without Ray: tp processes on gloo (torch.multiprocessing),
each rank's output against an unsharded float64 reference assembled from the gathered shards,
and, loaded from a Hugging Face checkpoint written by transformers, against transformers'
own LlamaMLP, with the bytes each rank read."""

from __future__ import annotations

import os
import shutil
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from single_controller.rendezvous import free_port

HIDDEN, FFN, SEQ, BATCH = 64, 128, 8, 2
SEED = 7
TOLERANCE = 1e-5
#: Checkpoint variants: where the rank loads from, and which layer.
CHECKPOINTS = {"file": ("single/model.safetensors", 1), "index": ("sharded", 2), "no_index": ("no_index", 0)}
#: A layer big enough that drawing its full master weight shows in a rank's peak memory.
BIG_HIDDEN, BIG_FFN = 1024, 8192
#: A layer whose shards span several of the blocks the layer draws (2**16 elements) or
#: copies from a checkpoint (256 rows) at a time, their ends inside blocks.
MID_HIDDEN, MID_FFN = 320, 1280

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

    return ParallelLlamaMLP(
        config=_config(megatron_tp, seed=seed, **changes),
        megatron_config=OmegaConf.create({"sequence_parallel_enabled": False}),
    )


def _mapped_file(address: int) -> str | None:
    """The file mapped at ``address`` in this process, if any (from /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(a, 16) for a in fields[0].split("-"))
            if low <= address < high:
                return fields[5].strip() if len(fields) == 6 else None
    return None


class _CountingSlice:
    """safetensors' slice object, recording what every tensor cut from it holds: the slice's
    bytes, the bytes of its storage, and the file its storage maps (None: process memory)."""

    def __init__(self, real, reads: list[tuple[int, int, str | None]]) -> None:
        self._real, self._reads = real, reads

    def __getitem__(self, index):
        tensor = self._real[index]
        storage = tensor.untyped_storage()
        self._reads.append(
            (tensor.numel() * tensor.element_size(), storage.nbytes(), _mapped_file(storage.data_ptr()))
        )
        return tensor

    def __getattr__(self, name):
        return getattr(self._real, name)


class _CountingHandle:
    def __init__(self, real, reads: list, full_reads: list[str]) -> None:
        self._real, self._reads, self._full_reads = real, reads, full_reads

    def __enter__(self):
        self._inner = self._real.__enter__()
        return self

    def __exit__(self, *exc):
        return self._real.__exit__(*exc)

    def get_slice(self, name):
        return _CountingSlice(self._inner.get_slice(name), self._reads)

    def get_tensor(self, name):
        self._full_reads.append(name)
        return self._inner.get_tensor(name)

    def keys(self):
        return self._inner.keys()


def _counting_safe_open(reads: list, full_reads: list[str]):
    from safetensors import safe_open

    return lambda *args, **kwargs: _CountingHandle(safe_open(*args, **kwargs), reads, full_reads)


def _load(megatron_tp: int, path: str, layer_index: int) -> tuple[torch.nn.Module, list, list[str]]:
    """The layer from a checkpoint, with the bytes of every slice this rank read."""
    from single_controller.models import llama_checkpoint
    from single_controller.models.llama import ParallelLlamaMLP

    reads: list[tuple[int, int, str | None]] = []
    full_reads: list[str] = []
    real = llama_checkpoint.safe_open
    llama_checkpoint.safe_open = _counting_safe_open(reads, full_reads)
    try:
        layer = ParallelLlamaMLP({"checkpoint": path, "layer_index": layer_index, "tp": megatron_tp})
    finally:
        llama_checkpoint.safe_open = real
    return layer, reads, full_reads


def _build_peak_growth(megatron_tp: int) -> tuple[int, int]:
    """(peak RSS growth while building the big layer over the RSS before, the shard's bytes).
    VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec, from the pytest process."""
    from bench.layer_init import status_bytes

    before = status_bytes("VmRSS")
    layer = _build(megatron_tp, SEED, hidden_size=BIG_HIDDEN, intermediate_size=BIG_FFN)
    peak = status_bytes("VmHWM")
    shard = sum(p.numel() * p.element_size() for p in layer.parameters())
    return peak - before, shard


def _weights(layer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in layer.named_parameters()}


def _error_of(fn) -> str | None:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def _rank_main(rank: int, world: int, tp: int, port: int, out_dir: str, checkpoint_root: str) -> None:
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
        # first, while this process's peak is still its imports'
        record["build_peak_growth"] = _build_peak_growth(tp)
        x = torch.rand(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(1234))
        layers = {act: _build(tp, SEED, hidden_act=act) for act in ACTS}
        for act, layer in layers.items():
            with torch.no_grad():
                record[f"y_{act}"] = layer(x)
            record[f"weights_{act}"] = _weights(layer)
        record["x"] = x
        rebuilt = _build(tp, SEED)
        record["rebuilt"] = _weights(rebuilt)
        with torch.no_grad():
            record["y_again"] = layers["silu"](x)
            record["y_rebuilt"] = rebuilt(x)
        record["mid_seeded"] = _weights(_build(tp, SEED, hidden_size=MID_HIDDEN, intermediate_size=MID_FFN))
        record["mid_loaded"] = _weights(_load(tp, str(Path(checkpoint_root) / "mid.safetensors"), 0)[0])
        record["checkpoints"] = {}
        for variant, (path, layer_index) in CHECKPOINTS.items():
            loaded, reads, full_reads = _load(tp, str(Path(checkpoint_root) / path), layer_index)
            with torch.no_grad():
                y = loaded(x)
            record["checkpoints"][variant] = {
                "y": y, "weights": _weights(loaded), "reads": reads, "full_reads": full_reads
            }
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


#: What every rank imports, imported once by the fork server that starts the ranks (each
#: spawned rank would import megatron-core and torch again: seconds of CPU apiece).
RANK_IMPORTS = ["torch", "megatron.core.parallel_state", "megatron.core.tensor_parallel",
                "single_controller.megatron.worker", "single_controller.models.llama", __name__]


def _run_ranks(world: int, tp: int, out_dir: Path, checkpoint_root: Path) -> list[dict]:
    mp.set_forkserver_preload(RANK_IMPORTS)
    mp.start_processes(
        _rank_main,
        args=(world, tp, free_port(), str(out_dir), str(checkpoint_root)),
        nprocs=world,
        join=True,
        start_method="forkserver",
    )
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _write_checkpoints(root: Path):
    """A tiny random Llama saved by transformers: one file, shards with an index, shards without."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=32, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, hidden_act="silu",
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="100KB")
    (root / "no_index").mkdir()
    for shard in (root / "sharded").glob("*.safetensors"):
        shutil.copy(shard, root / "no_index")
    g = torch.Generator().manual_seed(SEED)
    save_file(
        {
            "model.layers.0.mlp.gate_proj.weight": torch.randn(MID_FFN, MID_HIDDEN, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(MID_FFN, MID_HIDDEN, generator=g),
            "model.layers.0.mlp.down_proj.weight": torch.randn(MID_HIDDEN, MID_FFN, generator=g),
        },
        str(root / "mid.safetensors"),
    )
    return model


_CHECKPOINT: dict[str, tuple[Path, torch.nn.Module]] = {}


def _checkpoint(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """(the checkpoints' folder, the transformers model they hold)."""
    if not _CHECKPOINT:
        root = tmp_path_factory.mktemp("llama-checkpoint")
        _CHECKPOINT["tiny"] = (root, _write_checkpoints(root))
    return _CHECKPOINT["tiny"]


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
        root, _ = _checkpoint(tmp_path_factory)
        _RUNS[(world, tp)] = _run_ranks(world, tp, tmp_path_factory.mktemp(f"world{world}-tp{tp}"), root)
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


def test_bitwise_deterministic_forward(ranks):
    """The same input gives the same bits: called again, and on a layer rebuilt from the seed."""
    _, records = ranks
    for rec in records:
        assert torch.equal(rec["y_again"], rec["y_silu"])
        assert torch.equal(rec["y_rebuilt"], rec["y_silu"])


def test_each_rank_draws_only_its_shard(ranks):
    """Building a 1024 x 8192 layer (100 MB of float32) raises a rank's peak memory by about
    its shard, not by the full master weight megatron's CPU init draws on every rank."""
    tp, records = ranks
    full = 3 * BIG_HIDDEN * BIG_FFN * 4
    for rec in records:
        growth, shard = rec["build_peak_growth"]
        assert shard == full // tp
        # the shard and some slack (torch's and megatron's first allocations: up to 32 MB
        # seen); drawing the master first would add `full` (tp=1: 2x)
        assert growth < shard + full // 2, (growth, shard)


def _transformers_mlp(model, layer_index: int):
    return model.model.layers[layer_index].mlp


@pytest.mark.parametrize("variant", list(CHECKPOINTS))
def test_checkpoint_layer_equals_transformers_llama_mlp(ranks, variant, tmp_path_factory):
    tp, records = ranks
    _, model = _checkpoint(tmp_path_factory)
    hf = _transformers_mlp(model, CHECKPOINTS[variant][1])
    x = records[0]["x"]
    with torch.no_grad():
        expected = hf(x)
    assert expected.dtype == torch.float32
    for rank, rec in enumerate(records):
        loaded = rec["checkpoints"][variant]
        assert loaded["y"].dtype == torch.float32
        assert float((loaded["y"] - expected).norm() / expected.norm()) <= TOLERANCE
        # the rank holds exactly its rows of gate and up, and its columns of down
        rows = slice(rank * FFN // tp, (rank + 1) * FFN // tp)
        gate_up = torch.cat([hf.gate_proj.weight[rows], hf.up_proj.weight[rows]])
        assert torch.equal(loaded["weights"]["gate_up_proj.weight"], gate_up)
        assert torch.equal(loaded["weights"]["down_proj.weight"], hf.down_proj.weight[:, rows])


@pytest.mark.parametrize("variant", list(CHECKPOINTS))
def test_each_rank_reads_only_its_slices(ranks, variant):
    """Every tensor safetensors handed a rank is one of its slices (the bytes add up to its
    shard, a tp-th of the three matrices), and none was read whole into the process: each
    is either a copy of just the slice or a view of the memory-mapped file (safetensors
    0.8), from which the rank then copies only its slice."""
    tp, records = ranks
    shard_bytes = 3 * HIDDEN * FFN * 4 // tp
    for rec in records:
        reads = rec["checkpoints"][variant]["reads"]
        assert rec["checkpoints"][variant]["full_reads"] == []
        assert len(reads) == 3
        assert sum(taken for taken, _, _ in reads) == shard_bytes
        assert max(taken for taken, _, _ in reads) == HIDDEN * FFN * 4 // tp
        for taken, held, mapped in reads:
            assert held == taken or (mapped or "").endswith(".safetensors"), (taken, held, mapped)


def _cut(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s shard of the full matrices, as the layer lays it out."""
    return {
        "gate_up_proj.weight": torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]]),
        "down_proj.weight": down.chunk(tp, dim=1)[rank],
    }


def test_shards_spanning_several_blocks(ranks, tmp_path_factory):
    """Layers whose shards span several blocks: seeded, every layout cuts the tp=1 master;
    loaded, every rank holds exactly its slices of the checkpoint."""
    tp, records = ranks
    master = _records(1, 1, tmp_path_factory)[0]["mid_seeded"]
    gate, up = master["gate_up_proj.weight"].chunk(2)
    root, _ = _checkpoint(tmp_path_factory)
    saved = load_file(str(root / "mid.safetensors"))
    saved_mlp = [saved[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up", "down")]
    for rank, rec in enumerate(records):
        expected = _cut(gate, up, master["down_proj.weight"], tp, rank)
        assert all(torch.equal(rec["mid_seeded"][k], expected[k]) for k in expected)
        expected = _cut(*saved_mlp, tp, rank)
        assert all(torch.equal(rec["mid_loaded"][k], expected[k]) for k in expected)


def _worker_main(rank: int, port: int, out_dir: str, cases: dict) -> None:
    """One rank of tp=1: MLPLayerWorker.init_model for each case ``(worker kwargs, config)``,
    recording None or the ValueError's message."""
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    import torch.distributed as dist
    from megatron.core import parallel_state

    from single_controller.models.mlp_worker import MLPLayerWorker

    try:
        results = {}
        for name, (kwargs, config) in cases.items():
            worker = MLPLayerWorker.__ray_actor_class__(**kwargs)
            worker.init_megatron({"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1})
            results[name] = _error_of(lambda worker=worker, config=config: worker.init_model(config))
        torch.save(results, Path(out_dir) / "results.pt")
    except BaseException:
        (Path(out_dir) / "rank0.err").write_text(traceback.format_exc())
        raise
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_served_layer_reads_checkpoint_files_only_from_its_directories(tmp_path, tmp_path_factory):
    """Every file init_model reads must resolve inside the worker's checkpoint_dirs: a
    checkpoint directory inside them whose shard, or index, links out is refused; the
    worker's default allows no directory."""
    from single_controller.models.mlp_worker import MLPLayerWorker

    root, _ = _checkpoint(tmp_path_factory)
    allowed, outside = tmp_path / "models", tmp_path / "elsewhere"
    shutil.copytree(root / "sharded", allowed / "copied")
    shutil.copytree(root / "sharded", outside / "sharded")
    index_name = "model.safetensors.index.json"
    shards = sorted(p.name for p in (outside / "sharded").glob("*.safetensors"))
    linked_shard = allowed / "linked_shard"
    shutil.copytree(root / "sharded", linked_shard)
    (linked_shard / shards[0]).unlink()
    (linked_shard / shards[0]).symlink_to(outside / "sharded" / shards[0])
    linked_index = allowed / "linked_index"
    shutil.copytree(root / "sharded", linked_index)
    (linked_index / index_name).unlink()
    (linked_index / index_name).symlink_to(outside / "sharded" / index_name)
    linked_plain = allowed / "linked_plain"
    linked_plain.mkdir()
    for shard in shards:
        (linked_plain / shard).symlink_to(outside / "sharded" / shard)
    layer = {"layer_index": CHECKPOINTS["index"][1], "tp": 1}
    served = {"checkpoint_dirs": [str(allowed)]}
    cases = {
        "inside": (served, {**layer, "checkpoint": str(allowed / "copied")}),
        "linked_shard": (served, {**layer, "checkpoint": str(linked_shard)}),
        "linked_index": (served, {**layer, "checkpoint": str(linked_index)}),
        "linked_plain": (served, {**layer, "checkpoint": str(linked_plain)}),
        "root_outside": (served, {**layer, "checkpoint": str(outside / "sharded")}),
        "default": ({}, {**layer, "checkpoint": str(allowed / "copied")}),
        "none": ({"checkpoint_dirs": None}, {**layer, "checkpoint": str(allowed / "copied")}),
        "seeded_by_default": ({}, {"hidden_size": HIDDEN, "intermediate_size": FFN, "tp": 1}),
    }
    out = tmp_path / "out"
    out.mkdir()
    mp.start_processes(_worker_main, args=(free_port(), str(out), cases), nprocs=1, join=True, start_method="spawn")
    errors = torch.load(out / "results.pt", weights_only=False)
    assert errors["inside"] is None and errors["seeded_by_default"] is None
    refused = "outside the directories this layer may read"
    for name, path in (
        ("linked_shard", linked_shard / shards[0]),
        ("linked_index", linked_index / index_name),
        ("linked_plain", linked_plain / shards[0]),
    ):
        assert refused in (errors[name] or ""), (name, errors[name])
        assert str(path) in errors[name], (name, errors[name])
    assert refused in (errors["root_outside"] or "")
    for name in ("default", "none"):
        assert refused in (errors[name] or "") and "(none)" in errors[name], (name, errors[name])
    # the worker's own check of the named path, before the reader opens anything
    worker = MLPLayerWorker.__ray_actor_class__(checkpoint_dirs=[str(allowed)])
    worker._check_checkpoint_path({"checkpoint": str(allowed / "copied"), "layer_index": 0})
    for path in (outside / "sharded", allowed / ".." / "elsewhere", "/etc"):
        with pytest.raises(ValueError, match=refused):
            worker._check_checkpoint_path({"checkpoint": str(path), "layer_index": 0})

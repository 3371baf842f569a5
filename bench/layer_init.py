"""The tp MLP layer's start: what each rank spends building it, three ways, in one run.

    python -m bench.layer_init                  # 4096 x 11008, tp=4, 2 rounds
    python -m bench.layer_init --hidden 1024 --ffn 4096 --rounds 1

- ``master``: megatron's CPU init as this layer used it before (``use_cpu_initialization``
  with ``perform_initialization``): every rank draws the full master weights from the
  seeded torch RNG and keeps its shard;
- ``shard``: ``ParallelLlamaMLP`` today: megatron allocates the shard only, and the rank
  draws just its rows from per-row seeded generators;
- ``checkpoint``: ``ParallelLlamaMLP`` loading its slices of a Hugging Face safetensors
  checkpoint of the same shape, the file's pages dropped from the page cache first.

Each variant runs in fresh processes (one per rank, gloo, one thread each as in a Ray
worker), all ranks building at once as at a service's start; rounds alternate the
variants. Per rank: wall and CPU seconds of the build, peak RSS (VmHWM, which counts the
checkpoint's mapped file pages too) and its growth over the RSS before the build, and the
anonymous memory after it. Writes bench/results/layer_init.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

RESULTS = Path(__file__).resolve().parent / "results"
SEED = 0
VARIANTS = ("master", "shard", "checkpoint")


def status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM: this process's peak, RssAnon) in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _build_master(hidden: int, ffn: int) -> torch.nn.Module:
    """The layer's construction before per-shard init (megatron's master-weight CPU init)."""
    import functools

    from megatron.core import ModelParallelConfig, parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(SEED)
    config = ModelParallelConfig(
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=torch.float32,
    )
    init = functools.partial(torch.nn.init.normal_, mean=0.0, std=0.02)
    layer = torch.nn.Module()
    layer.gate_up_proj = ColumnParallelLinear(
        hidden, 2 * ffn, config=config, init_method=init, bias=False, gather_output=False, stride=2,
        skip_bias_add=True,
    )
    layer.down_proj = RowParallelLinear(
        ffn, hidden, config=config, init_method=init, bias=False, input_is_parallel=True, skip_bias_add=True
    )
    return layer


def init_megatron_rank(rank: int, tp: int, port: int) -> None:
    """This process as rank ``rank`` of a tp=``tp`` group on this machine (rendezvous at
    ``port``), set up by ``MegatronWorker.init_megatron`` as a group's worker is."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(tp), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(tp),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    from single_controller.megatron.worker import MegatronWorker

    MegatronWorker().init_megatron({"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": 1})


def _rank(rank: int, tp: int, port: int, variant: str, hidden: int, ffn: int, checkpoint: str, out: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from single_controller.models.llama import ParallelLlamaMLP

    init_megatron_rank(rank, tp, port)
    dist.barrier()
    rss_before = status_bytes("VmRSS")
    wall, cpu = time.perf_counter(), time.process_time()
    if variant == "master":
        layer = _build_master(hidden, ffn)
    elif variant == "shard":
        layer = ParallelLlamaMLP({"hidden_size": hidden, "intermediate_size": ffn, "seed": SEED}, max_parameters=None)
    else:
        layer = ParallelLlamaMLP({"checkpoint": checkpoint, "layer_index": 0}, max_parameters=None)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec, from the parent process
    peak = status_bytes("VmHWM")
    row = {
        "rank": rank,
        "wall_s": wall,
        "cpu_s": cpu,
        "peak_rss_bytes": peak,
        "peak_growth_bytes": peak - rss_before,
        "anon_after_bytes": status_bytes("RssAnon"),
        "shard_bytes": sum(p.numel() * p.element_size() for p in layer.parameters()),
    }
    Path(out, f"{variant}-{rank}.json").write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


def _write_checkpoint(path: Path, hidden: int, ffn: int) -> None:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(SEED)
    save_file(
        {
            "model.layers.0.mlp.gate_proj.weight": torch.randn(ffn, hidden, generator=g) * 0.02,
            "model.layers.0.mlp.up_proj.weight": torch.randn(ffn, hidden, generator=g) * 0.02,
            "model.layers.0.mlp.down_proj.weight": torch.randn(hidden, ffn, generator=g) * 0.02,
        },
        str(path),
    )


def _drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run(hidden: int, ffn: int, tp: int, rounds: int) -> dict[str, Any]:
    from single_controller.rendezvous import free_port

    runs: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="layer_init-") as tmp:
        checkpoint = Path(tmp) / "model.safetensors"
        _write_checkpoint(checkpoint, hidden, ffn)
        for _ in range(rounds):
            for variant in VARIANTS:
                if variant == "checkpoint":
                    _drop_from_page_cache(checkpoint)
                out = tempfile.mkdtemp(dir=tmp)
                mp.start_processes(
                    _rank, args=(tp, free_port(), variant, hidden, ffn, str(checkpoint), out),
                    nprocs=tp, join=True, start_method="spawn",
                )
                rows = [json.loads(Path(out, f"{variant}-{r}.json").read_text()) for r in range(tp)]
                runs[variant].append(rows)
                print(variant, json.dumps(_summary([rows])), flush=True)
    summary = {v: _summary(rows) for v, rows in runs.items()}
    return {
        "layer": {"hidden_size": hidden, "intermediate_size": ffn, "tp": tp, "fp32_bytes": 3 * hidden * ffn * 4},
        "rounds": rounds,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "summary": summary,
        "ratios_shard_vs_master": {
            key: summary["shard"][key] / summary["master"][key] for key in summary["master"]
        },
        "runs": runs,
    }


def _summary(rounds: list[list[dict[str, Any]]]) -> dict[str, float]:
    """Medians over rounds of the slowest rank's wall time and the per-rank means."""
    def median_of(fn) -> float:
        return statistics.median(fn(rows) for rows in rounds)

    return {
        "slowest_rank_wall_s": median_of(lambda rows: max(r["wall_s"] for r in rows)),
        "cpu_s_per_rank": median_of(lambda rows: statistics.mean(r["cpu_s"] for r in rows)),
        "peak_rss_mib_per_rank": median_of(lambda rows: statistics.mean(r["peak_rss_bytes"] for r in rows)) / 2**20,
        "peak_growth_mib_per_rank": median_of(lambda rows: statistics.mean(r["peak_growth_bytes"] for r in rows))
        / 2**20,
        "anon_after_mib_per_rank": median_of(lambda rows: statistics.mean(r["anon_after_bytes"] for r in rows))
        / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "layer_init.json")
    options = parser.parse_args()
    result = run(options.hidden, options.ffn, options.tp, options.rounds)
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))
    print("shard / master:", json.dumps(result["ratios_shard_vs_master"], indent=2))


if __name__ == "__main__":
    main()

"""GPU check of the Megatron layer without Ray: every local GPU runs one tensor-parallel
rank (nccl), the sharded output is compared with an unsharded float64 reference built from
the gathered shards, and the tutorial's full-size forward is timed.

    python examples/gpu_check.py [--full]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def rank_main(rank: int, world: int, port: int, full: bool, results) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    import torch.distributed as dist

    from single_controller.device import get_device_name, get_dist_backend, get_torch_device
    from single_controller.megatron.worker import MegatronWorker
    from single_controller.models.llama import ParallelLlamaMLP

    worker = MegatronWorker()
    worker.init_megatron({"tensor_model_parallel_size": world, "pipeline_model_parallel_size": 1})
    device = get_torch_device()
    hidden, ffn = 256, 1024
    layer = ParallelLlamaMLP(
        {"hidden_size": hidden, "intermediate_size": ffn, "hidden_act": "silu", "pretraining_tp": 1, "tp": world}
    ).to(device)
    x = torch.rand(16, 4, hidden, device=device)
    with torch.no_grad():
        y = layer(x)
    shards = {k: v.detach() for k, v in layer.named_parameters()}
    gathered = {k: [torch.empty_like(v) for _ in range(world)] for k, v in shards.items()}
    for k, v in shards.items():
        dist.all_gather(gathered[k], v)
    gate = torch.cat([g.double().chunk(2)[0] for g in gathered["gate_up_proj.weight"]])
    up = torch.cat([g.double().chunk(2)[1] for g in gathered["gate_up_proj.weight"]])
    down = torch.cat([g.double() for g in gathered["down_proj.weight"]], dim=1)
    ref = (torch.nn.functional.silu(x.double() @ gate.T) * (x.double() @ up.T)) @ down.T
    err = float((y.double() - ref).norm() / ref.norm())
    out = {
        "rank": rank, "device": str(y.device), "backend": get_dist_backend(), "device_name": get_device_name(),
        "backend_in_use": dist.get_backend(), "rel_err": err,
    }
    if full:
        big = ParallelLlamaMLP(
            {"hidden_size": 4096, "intermediate_size": 11008, "hidden_act": "silu", "pretraining_tp": 1}
        ).to(device)
        xb = torch.rand(2048, 16, 4096, device=device)
        with torch.no_grad():
            big(xb)
            torch.cuda.synchronize()
            start = time.perf_counter()
            yb = big(xb)
            torch.cuda.synchronize()
        out["full_shape_output"] = list(yb.shape)
        out["full_forward_s"] = time.perf_counter() - start
    results.put(out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--full", action="store_true", help="also time the tutorial's full-size forward")
    options = parser.parse_args()
    world = max(1, torch.cuda.device_count())
    from single_controller.rendezvous import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, options.full, results)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    rows = [results.get() for _ in range(world)]
    for row in sorted(rows, key=lambda r: r["rank"]):
        print(row)
    assert all(r["rel_err"] <= 1e-5 for r in rows), rows


if __name__ == "__main__":
    main()

"""Chapter 4 of the verl Ray tutorial: a MegatronRayWorkerGroup running a tensor-parallel
Llama MLP layer (megatron-core's ColumnParallelLinear / RowParallelLinear).

The worker class is the tutorial's ``MLPLayerWorker`` (``single_controller/models/mlp_worker.py``):
``init_model`` and ``get_weights`` are ONE_TO_ALL, ``run_layer`` is MEGATRON_COMPUTE (one
input per dp rank in, the tp-rank-0 output of each dp rank out).

By default it runs the tutorial's shape: seq 2048, batch 16, hidden 4096, ffn 11008, fp32,
tp=4 on a pool of 4, output ``[2048, 16, 4096]``. That is about 9 TFLOP of matmul and a
512 MiB input: minutes on a small CPU machine. Shrink it with the flags:

    python examples/megatron_mlp.py                                  # the tutorial's shape
    python examples/megatron_mlp.py --seq 16 --batch 2 --hidden 64 --ffn 128 --check
    python examples/megatron_mlp.py --tp 2 --world 4 --seq 16 --batch 4 --hidden 64 --ffn 128

GPUs are used when the cluster has one per worker; otherwise the pool's bundles are CPU
only and the workers compute on CPU over gloo (the device is ``get_device_name()`` inside
each worker).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

os.environ.setdefault("MEGATRON_USE_CUDA_TIMER", "0")
os.environ.setdefault("MEGATRON_START_PROCESS_TIMER", "False")
os.environ.setdefault("NCCL_DEBUG", "WARN")

import ray  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from single_controller.models.mlp_worker import MLPLayerWorker  # noqa: E402
from single_controller.ray import MegatronRayWorkerGroup  # noqa: E402
from single_controller.ray.base import RayClassWithInitArgs, RayResourcePool  # noqa: E402


def reference_output(shards: list[dict[str, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    """The unsharded silu MLP, assembled from one tp group's shards (tp-rank order), in float64.

    Each shard's ``gate_up_proj.weight`` is that rank's gate rows then its up rows."""
    halves = [s["gate_up_proj.weight"].double().chunk(2, dim=0) for s in shards]
    gate = torch.cat([g for g, _ in halves], dim=0)
    up = torch.cat([u for _, u in halves], dim=0)
    down = torch.cat([s["down_proj.weight"].double() for s in shards], dim=1)
    h = x.double()
    return (torch.nn.functional.silu(h @ gate.T) * (h @ up.T)) @ down.T


def run_chapter_4(
    resource_pool: RayResourcePool,
    seq_len: int = 2048,
    batch_size: int = 16,
    hidden_size: int = 4096,
    ffn_hidden_size: int = 11008,
    tp: int | None = None,
    seed: int = 0,
    check: bool = False,
) -> dict[str, Any]:
    """The tutorial's chapter 4 on ``resource_pool`` (tp defaults to the pool's size).

    Prints what the tutorial prints and returns it; the group is shut down before
    returning, the pool is left to its owner."""
    world = resource_pool.world_size
    tp = world if tp is None else tp
    if tp < 1 or world % tp:
        raise ValueError(f"tp={tp} must divide the pool's {world} workers")
    if ffn_hidden_size % tp:
        raise ValueError(f"ffn {ffn_hidden_size} is not divisible by tp {tp}")
    dp = world // tp
    if batch_size % dp:
        raise ValueError(f"batch {batch_size} is not divisible by dp {dp}")

    layer_cls = RayClassWithInitArgs(cls=MLPLayerWorker)
    layer_worker_group = MegatronRayWorkerGroup(
        resource_pool=resource_pool,
        ray_cls_with_init=layer_cls,
        default_megatron_kwargs={
            "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": 1,
            "num_layers_per_virtual_pipeline_stage": None,
        },
    )
    out: dict[str, Any] = {}
    try:
        g = layer_worker_group
        out["layout"] = (g.world_size, g.tp_size, g.pp_size, g.dp_size)
        print(*out["layout"])
        out["devices"] = sorted({info["device"] for info in g.rank_info()})

        config = OmegaConf.create(
            {
                "hidden_size": hidden_size,
                "intermediate_size": ffn_hidden_size,
                "hidden_act": "silu",
                "pretraining_tp": 1,
                "tp": g.tp_size,
                "seed": seed,
            }
        )
        x = torch.rand(size=(seq_len, batch_size, hidden_size), dtype=torch.float32)

        start = time.perf_counter()
        out["init_model"] = g.init_model(config)
        out["init_s"] = time.perf_counter() - start
        print(out["init_model"])

        # One input per dp rank (the tutorial's dp is 1: a list of one tensor).
        inputs = list(x.chunk(g.dp_size, dim=1))
        start = time.perf_counter()
        outputs = g.run_layer(inputs)
        out["run_s"] = time.perf_counter() - start
        output = torch.cat(outputs, dim=1)
        out["output_shape"] = tuple(output.shape)
        print(output.shape)

        if check:
            shards = g.get_weights()
            dp0 = [r for r in range(world) if g.get_megatron_rank_info(r).dp_rank == 0]
            tp_group = [shards[r] for r in sorted(dp0, key=lambda r: g.get_megatron_rank_info(r).tp_rank)]
            ref = reference_output(tp_group, x)
            out["rel_err"] = float((output.double() - ref).norm() / ref.norm())
            print(f"relative error vs unsharded float64 reference: {out['rel_err']:.2e}")
    finally:
        layer_worker_group.shutdown()
    print(
        f"devices {out.get('devices')}; init_model {out.get('init_s', 0):.2f}s, run_layer {out.get('run_s', 0):.2f}s"
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    parser.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size (default 4096)")
    parser.add_argument("--ffn", type=int, default=11008, help="intermediate (ffn) size (default 11008)")
    parser.add_argument("--tp", type=int, default=4, help="tensor-parallel size (default 4)")
    parser.add_argument(
        "--world", type=int, default=None, help="workers in the pool (default: tp); dp = world/tp"
    )
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    parser.add_argument("--check", action="store_true", help="compare with an unsharded float64 reference")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    options = parser.parse_args()
    world = options.world or options.tp
    for name in ("seq", "batch", "hidden", "ffn", "tp"):
        if getattr(options, name) < 1:
            parser.error(f"--{name} must be positive")
    if world % options.tp:
        parser.error(f"--world {world} is not divisible by --tp {options.tp}")
    if options.ffn % options.tp:
        parser.error(f"--ffn {options.ffn} is not divisible by --tp {options.tp}")
    if options.batch % (world // options.tp):
        parser.error(f"--batch {options.batch} is not divisible by dp {world // options.tp}")

    ray.init(address=options.address)
    try:
        # A GPU per worker when the cluster has them, else CPU bundles.
        use_gpu = ray.cluster_resources().get("GPU", 0) >= world
        resource_pool = RayResourcePool([world], use_gpu=use_gpu)
        try:
            run_chapter_4(
                resource_pool,
                seq_len=options.seq,
                batch_size=options.batch,
                hidden_size=options.hidden,
                ffn_hidden_size=options.ffn,
                tp=options.tp,
                seed=options.seed,
                check=options.check,
            )
        finally:
            resource_pool.remove()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()

"""A weight sync between two MLP layer groups on CPU: what it moves and what it costs.

    python -m bench.weight_sync                 # 1024 x 4096, tp=4 -> tp=2, 5 rounds
    python -m bench.weight_sync --quick

``bench_weight_sync(quick)`` answers a dict of figures (``bench.run`` merges it): the bytes
each destination rank received against the full model's size; the sync's time (object
store and, for comparison, the collective path on gloo) and the commit's, the only part a
call on the destination waits for; and the floor: the same bytes (one full copy of the
model) through one ``ray.get`` of a gathered full model into another process, copied
into tensors as a stage copies its slices.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def _timed_get_task() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    def timed_get(refs: list[Any]) -> float:
        import torch

        started = time.perf_counter()
        arrays = ray.get(refs)
        # what a destination does with what it fetched: copy it into its own tensors
        [torch.from_numpy(a.copy()) for a in arrays]
        return time.perf_counter() - started

    return timed_get


def _floor_s(full: dict[str, Any], rounds: int) -> float:
    """One ``ray.get`` of the gathered full model in another process, median of ``rounds``."""
    import ray

    timed_get = _timed_get_task()
    ray.get(timed_get.remote([ray.put(next(iter(full.values()))[:1])]))  # the task's process started
    times = []
    for _ in range(rounds):
        refs = [ray.put(array) for array in full.values()]
        times.append(ray.get(timed_get.remote(refs)))
        del refs
    return statistics.median(times)


def bench_weight_sync(
    quick: bool = False, hidden: int | None = None, ffn: int | None = None, src_tp: int = 4, dst_tp: int = 2,
    rounds: int | None = None,
) -> dict[str, Any]:
    """Figures of a tp=``src_tp`` to tp=``dst_tp`` sync of the MLP layer on CPU ranks. Uses the
    running Ray instance, or starts (and stops) a local one."""
    import ray
    import torch

    from single_controller.models.mlp_worker import MLPLayerWorker
    from single_controller.ray import MegatronRayWorkerGroup, RayClassWithInitArgs, RayResourcePool
    from single_controller.weights import read_weights, sync_weights

    hidden = hidden or (512 if quick else 1024)
    ffn = ffn or (2048 if quick else 4096)
    rounds = rounds or (3 if quick else 5)
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    made = []
    try:
        for tp, prefix in ((src_tp, "bench_src"), (dst_tp, "bench_dst")):
            pool = RayResourcePool([tp], use_gpu=False, name_prefix=prefix)
            group = MegatronRayWorkerGroup(
                resource_pool=pool,
                ray_cls_with_init=RayClassWithInitArgs(cls=MLPLayerWorker),
                default_megatron_kwargs={"tensor_model_parallel_size": tp},
            )
            made.append((pool, group))
            group.init_model({"hidden_size": hidden, "intermediate_size": ffn, "seed": tp})
        (_, src), (_, dst) = made
        sync_weights(src, dst)  # warm: first fetches and allocations
        reports = {"object_store": [], "collective": []}
        for _ in range(rounds):
            for transport, samples in reports.items():
                samples.append(sync_weights(src, dst, transport=transport))
        # the gathered full model: one tensor per logical parameter, as one process would hold it
        _, shards = read_weights(src)
        full = {
            name: torch.cat([s[name] for s in shards], dim=1 if name == "down_proj" else 0).numpy()
            for name in shards[0]
        }
        floor = _floor_s(full, rounds)
    finally:
        for pool, group in made:
            group.shutdown()
            pool.remove()
        if started_ray:
            ray.shutdown()
    last = reports["object_store"][-1]
    sync_s = statistics.median(r.seconds for r in reports["object_store"])
    mib = 1 << 20
    return {
        "weight_sync_layer": f"{hidden}x{ffn} tp{src_tp}->tp{dst_tp}",
        "weight_sync_full_mib": last.full_bytes / mib,
        "weight_sync_bytes_per_dst_rank_mib": [b / mib for b in last.bytes_per_rank],
        "weight_sync_bytes_fraction_of_full": max(last.bytes_per_rank) / last.full_bytes,
        "weight_sync_p50_s": sync_s,
        "weight_sync_stage_p50_s": statistics.median(r.stage_seconds for r in reports["object_store"]),
        "weight_sync_commit_p50_ms": statistics.median(r.commit_seconds for r in reports["object_store"]) * 1e3,
        "weight_sync_collective_gloo_p50_s": statistics.median(r.seconds for r in reports["collective"]),
        "weight_sync_floor_full_get_p50_s": floor,
        "weight_sync_vs_floor": sync_s / floor,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--ffn", type=int)
    parser.add_argument("--src-tp", type=int, default=4)
    parser.add_argument("--dst-tp", type=int, default=2)
    parser.add_argument("--rounds", type=int)
    options = parser.parse_args(argv)
    figures = bench_weight_sync(
        options.quick, options.hidden, options.ffn, options.src_tp, options.dst_tp, options.rounds
    )
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

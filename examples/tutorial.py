"""The verl Ray tutorial, replayed end to end on this library.

The worker classes are the tutorial's, in ``single_controller/models/tutorial_workers.py``.

Runs unchanged on a CPU machine and on a GPU node: the only change from the tutorial
is the device (``get_device_name()``: cuda when present, else cpu) and, where the
cluster has no GPUs, pools with ``use_gpu=False``.

    python examples/tutorial.py            # chapters 1-3
    python examples/tutorial.py --megatron # and chapter 4 at a small shape
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("MEGATRON_USE_CUDA_TIMER", "0")
os.environ.setdefault("MEGATRON_START_PROCESS_TIMER", "False")
os.environ.setdefault("NCCL_DEBUG", "WARN")

import ray  # noqa: E402

from single_controller.models.tutorial_workers import (  # noqa: E402
    Accumulator,
    GPUAccumulator,
    GPUAccumulatorDecorator,
    TestActor,
)
from single_controller.ray.base import (  # noqa: E402
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    merge_resource_pool,
)


def run_tutorial(use_gpu: bool) -> dict:
    """Chapters 1-3 on the connected cluster; prints the tutorial's outputs and returns
    them (with the pools and groups, so a caller can release them)."""
    out: dict = {}

    # Chapter 1: Ray basics
    accumulator = Accumulator.remote()
    out["accumulator_initial"] = ray.get(accumulator.get_value.remote())
    print(out["accumulator_initial"])
    accumulator.add.remote(10)
    out["accumulator_after_add"] = ray.get(accumulator.get_value.remote())
    print(out["accumulator_after_add"])
    out["accumulator"] = accumulator

    # Chapter 2: resource pools and RayWorkerGroup
    resource_pool = RayResourcePool([4], use_gpu=use_gpu)
    class_with_args = RayClassWithInitArgs(cls=GPUAccumulator)
    worker_group = RayWorkerGroup(resource_pool, class_with_args)
    out["add_1"] = worker_group.execute_all_sync("add", x=[1, 1, 1, 1])
    print(out["add_1"])
    out["local_rank_list"] = resource_pool.local_rank_list()
    out["local_world_size_list"] = resource_pool.local_world_size_list()
    print(out["local_rank_list"])
    print(out["local_world_size_list"])
    print(worker_group.workers)
    print(worker_group.worker_names)

    # GPU sharing: a second pool, and the two merged
    resource_pool_1 = RayResourcePool([4], use_gpu=use_gpu, name_prefix="a")
    resource_pool_merge = merge_resource_pool(resource_pool, resource_pool_1)
    out["local_rank_list_1"] = resource_pool_1.local_rank_list()
    out["local_rank_list_merge"] = resource_pool_merge.local_rank_list()
    print(out["local_rank_list_1"])
    print(out["local_rank_list_merge"])
    worker_group_1 = RayWorkerGroup(resource_pool_1, class_with_args)
    worker_group_merge = RayWorkerGroup(resource_pool_merge, class_with_args)
    out["add_2"] = worker_group_1.execute_all_sync("add", x=[2, 2, 2, 2])
    print(out["add_2"])
    out["add_3"] = worker_group_merge.execute_all_sync("add", x=[3, 3, 3, 3, 3, 3, 3, 3])
    print(out["add_3"])
    out["world_sizes"] = (worker_group.world_size, worker_group_1.world_size, worker_group_merge.world_size)
    print(*out["world_sizes"])

    # Chapter 3: dispatch, execution and collection
    class_with_args = RayClassWithInitArgs(cls=GPUAccumulatorDecorator)
    gpu_accumulator_decorator = RayWorkerGroup(resource_pool_merge, class_with_args)
    out["decorator_add"] = gpu_accumulator_decorator.add(x=10)
    print(out["decorator_add"])

    class_with_args = RayClassWithInitArgs(cls=TestActor, x=2)
    test_group = RayWorkerGroup(resource_pool, class_with_args)
    output_ref = test_group.foo_custom(x=[1, 2], y=[5, 6])
    assert output_ref == [8, 10, 8, 10]
    out["foo_custom"] = output_ref
    print(output_ref)
    output_ref = test_group.foo_rank_zero(x=1, y=2)
    assert output_ref == 5
    out["foo_rank_zero"] = output_ref
    print(output_ref)

    out["groups"] = {
        "gpu_accumulator": worker_group,
        "gpu_accumulator_a": worker_group_1,
        "gpu_accumulator_merge": worker_group_merge,
        "gpu_accumulator_decorator": gpu_accumulator_decorator,
        "test_actor": test_group,
    }
    out["pools"] = {"pool": resource_pool, "pool_a": resource_pool_1, "pool_merge": resource_pool_merge}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megatron", action="store_true", help="also run chapter 4 (tp=4 MLP, small shape)")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    options = parser.parse_args()

    ray.init(address=options.address)
    # The tutorial's pools take 8 GPUs; with fewer, run them on CPU bundles.
    use_gpu = ray.cluster_resources().get("GPU", 0) >= 8
    results = run_tutorial(use_gpu)
    if options.megatron:
        # run as a script, this file's folder is on sys.path, not the repository root
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from examples.megatron_mlp import run_chapter_4

        run_chapter_4(results["pools"]["pool"], seq_len=16, batch_size=2, hidden_size=64, ffn_hidden_size=128)
    ray.shutdown()


if __name__ == "__main__":
    main()

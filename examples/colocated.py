"""Colocated workers and compiled-graph calls, on the tutorial's worker classes.

Two roles (the ONE_TO_ALL accumulator and the TestActor) share one process per bundle
of a pool of 4; the accumulator's ``add`` then runs through the group's compiled graph.

    python examples/colocated.py                       # in a Ray cluster of its own
    RAY_ADDRESS=head:6379 python examples/colocated.py  # on a running cluster
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from single_controller.models.tutorial_workers import GPUAccumulatorDecorator, TestActor  # noqa: E402
from single_controller.ray.base import (  # noqa: E402
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    create_colocated_worker_cls,
)


def main() -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=False)  # the running cluster RAY_ADDRESS names
    else:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    use_gpu = ray.available_resources().get("GPU", 0) >= 4
    pool = RayResourcePool([4], use_gpu=use_gpu)
    fused = create_colocated_worker_cls(
        {"acc": RayClassWithInitArgs(GPUAccumulatorDecorator), "test": RayClassWithInitArgs(TestActor, x=2)}
    )
    groups = RayWorkerGroup(pool, fused).spawn(prefix_set=["acc", "test"])
    acc, test = groups["acc"], groups["test"]
    print("pids (acc) ", [r["pid"] for r in acc.rank_info()])
    print("pids (test)", [r["pid"] for r in test.rank_info()])
    print("acc.add(10)        ", [float(v) for v in acc.add(10)])           # 10, 11, 12, 13
    print("test.foo_custom    ", test.foo_custom([1, 2], [5, 6]))         # [8, 10, 8, 10]

    compiled = acc.compile()
    print("compiled add(1)    ", [float(v) for v in compiled.add(1)])      # 11, 12, 13, 14
    for name, call in (("plain", lambda: acc.add(0)), ("compiled", lambda: compiled.add(0))):
        call()
        start = time.perf_counter()
        for _ in range(200):
            call()
        print(f"{name:9s} add p-mean {(time.perf_counter() - start) / 200 * 1e3:.2f} ms")
    ray.shutdown()


if __name__ == "__main__":
    main()

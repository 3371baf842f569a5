"""verl's worker aliveness check: a driver process whose worker dies gets SIGABRT; a
busy worker, or a group shut down on purpose, does not abort it. The driver is a
subprocess attached to the session's cluster (the abort would end pytest itself)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import ray

DRIVER = textwrap.dedent(
    """
    import os, sys, time
    import ray
    from single_controller.base import Worker
    from single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    @ray.remote
    class Napper(Worker):
        def nap(self, seconds):
            time.sleep(seconds)
            return self.rank

        def die(self):
            os._exit(1)

    ray.init(address=sys.argv[1], namespace="aliveness_check", log_to_driver=False)
    pool = RayResourcePool([2], use_gpu=False)

    quiet = RayWorkerGroup(pool, RayClassWithInitArgs(Napper))
    quiet.start_worker_aliveness_check(0.2)
    quiet.shutdown()  # stops the check before killing the workers
    time.sleep(1.5)
    print("shut down without abort", flush=True)

    group = RayWorkerGroup(pool, RayClassWithInitArgs(Napper))
    group.start_worker_aliveness_check(0.2)
    print("busy", group.execute_all_sync("nap", 2.0), flush=True)  # ten checks while busy
    group.execute_rank_zero_async("die")
    time.sleep(60)
    print("still running", flush=True)
    """
)


def test_a_dead_worker_aborts_the_driver_and_a_busy_one_does_not(ray_cluster, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.run(
        [sys.executable, str(script), address],
        capture_output=True,
        text=True,
        timeout=240,
        preexec_fn=_no_core_dump,
    )
    assert "shut down without abort" in proc.stdout, proc.stderr[-3000:]
    assert "busy [0, 1]" in proc.stdout, proc.stderr[-3000:]
    assert "still running" not in proc.stdout
    assert proc.returncode == -signal.SIGABRT, (proc.returncode, proc.stderr[-3000:])


def _no_core_dump() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

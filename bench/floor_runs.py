"""The served path against hand-written floors, each measured alone on the machine with
the same load generator (``bench.load_generator``), the same layer and the same body.

Targets, one at a time (the others stopped, as a user runs one instead of the other):

- the floors (:func:`floor_run`): the HTTP ``add`` app over 8 ranks (``bench/floor_app.py``),
  and the inference app over one actor holding the layer (``bench/infer_floor_app.py``) with
  plain actor calls and through a compiled graph;
- the service (:func:`service_run`) on either request path a user meets: HAProxy, as
  ``make serve`` runs it, or Serve's own proxy (a plain ``serve run``).

Each target answers the same figures (:func:`measure_add`, :func:`measure_infer`): a lone
client's p50 and p99, requests/s (and p50, p99) at fixed concurrencies, and for inference
the CPU milliseconds per request of the machine and of each process by role
(``bench.request_cpu``), the target's idle rate taken out. ``bench.run`` alternates whole
runs (floor, service, floor, service) so that the machine's drift hits both sides.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from bench.cold_start import CONTROLLERS, FLOOR_ACTOR, FLOOR_APP, INGRESS, OTHER, PROXY, RANKS, RAY_DAEMONS
from bench.load_generator import Load, LoadResult, default_processes, run_load
from bench.request_cpu import TargetCpu
from tests.serve_process import ROOT, ServeProcess

#: The 8-rank group of the ``add`` figure, and its body on the service and on the floor.
ADD_GROUP = "gpu_accumulator_decorator"
ADD_SERVICE = (f"/v1/groups/{ADD_GROUP}/add", {"kwargs": {"x": 1}})
ADD_FLOOR = ("/add", {"x": 1})
ADD_CONCURRENCY = 32
INFER_SHAPE = (8, 2, 4096)
INFER_CONCURRENCY = (16, 64)
#: The served layer's worker class: its processes are the layer's ranks.
RANK_CLASSES = ("MLPLayerWorker",)
#: The request paths a user meets: ``make serve``'s HAProxy, a plain ``serve run``'s proxy.
PATHS = ("haproxy", "serve_proxy")
#: The served models of the figures: one forward per request, and the batching one.
SERVED_MODELS = {"unbatched": "mlp_unbatched", "batched": "mlp"}


@dataclass(frozen=True)
class Settings:
    """The load generator's settings for every figure of a run."""

    processes: int
    lone_s: float
    window_s: float
    warmup_s: float
    idle_s: float

    @classmethod
    def for_run(cls, quick: bool, processes: int | None = None) -> Settings:
        processes = processes or default_processes()
        if quick:
            return cls(processes, lone_s=2.0, window_s=3.0, warmup_s=0.5, idle_s=2.0)
        return cls(processes, lone_s=4.0, window_s=6.0, warmup_s=1.0, idle_s=4.0)

    def figures(self) -> dict[str, Any]:
        return {**asdict(self), "add_concurrency": ADD_CONCURRENCY, "infer_concurrency": list(INFER_CONCURRENCY),
                "infer_shape": list(INFER_SHAPE)}


def infer_body() -> tuple[bytes, dict[str, str]]:
    """An OIP binary request of one ``INFER_SHAPE`` FP32 input, its output asked in binary."""
    import torch

    from bench.http_figures import oip_body

    return oip_body("x", torch.rand(*INFER_SHAPE, generator=torch.Generator().manual_seed(0)), binary_output=True)


def say(what: str) -> None:
    """A line on standard error: where a long run is."""
    print(f"bench {time.strftime('%H:%M:%S')}: {what}", file=sys.stderr, flush=True)


# -- one target's figures --------------------------------------------------------------------


def load_figures(result: LoadResult) -> dict[str, Any]:
    """A window's figures: requests/s, p50, p99 and the errors."""
    return {"rps": result.rps, "p50_ms": result.p50_ms, "p99_ms": result.p99_ms, "requests": result.requests,
            "errors": result.errors_total, **({"error_samples": result.error_samples} if result.errors_total else {})}


def lone(url: str, path: str, body: bytes, headers: dict[str, str], settings: Settings) -> dict[str, Any]:
    """One client, one request after another: p50 and p99."""
    result = run_load(Load(url, path, body, headers, concurrency=1, processes=1, warmup_s=0.5,
                           window_s=settings.lone_s))
    return {"lone_p50_ms": result.p50_ms, "lone_p99_ms": result.p99_ms, "lone_requests": result.requests,
            "lone_errors": result.errors_total}


def measure_add(url: str, path: str, document: Any, settings: Settings) -> dict[str, Any]:
    """The ``add``'s lone p50/p99 and its requests/s at ``ADD_CONCURRENCY`` clients."""
    load = Load.of_json(url, path, document, concurrency=ADD_CONCURRENCY, processes=settings.processes,
                        warmup_s=settings.warmup_s, window_s=settings.window_s)
    out = lone(url, path, load.body, dict(load.headers), settings)
    at = load_figures(run_load(load))
    out.update({f"{key}_{ADD_CONCURRENCY}": value for key, value in at.items()})
    return out


def measure_infer(url: str, path: str, settings: Settings, cpu: TargetCpu, last: bool = True) -> dict[str, Any]:
    """Lone p50/p99, then requests/s, p50, p99 and CPU ms per request at each of
    ``INFER_CONCURRENCY`` (the idle rate read first). ``last``: nothing is measured on
    the target after this, so the requests in flight at the end are dropped, not awaited."""
    body, headers = infer_body()
    out = lone(url, path, body, headers, settings)
    if cpu.idle is None:
        cpu.measure_idle(settings.idle_s)
    for concurrency in INFER_CONCURRENCY:
        drain = not last or concurrency != INFER_CONCURRENCY[-1]
        result, spent = cpu.run(Load(url, path, body, headers, concurrency=concurrency,
                                     processes=settings.processes, warmup_s=settings.warmup_s,
                                     window_s=settings.window_s, drain=drain))
        out.update({f"{key}_{concurrency}": value for key, value in load_figures(result).items()})
        out[f"cpu_{concurrency}"] = spent
    return out


def client_scaling(load: Load) -> dict[str, Any]:
    """Requests/s of one target under ``load`` with its client processes and then twice as
    many: a generator that is not the bottleneck gives the same figure twice."""
    rows = []
    for processes in (load.processes, 2 * load.processes):
        result = run_load(replace(load, processes=processes))
        rows.append({"processes": processes, "rps": result.rps, "p50_ms": result.p50_ms,
                     "client_cpu_ms_per_request": result.client_cpu_total_s / max(result.requests, 1) * 1e3})
    return {"concurrency": load.concurrency, "runs": rows, "ratio": ratio(rows[1]["rps"], rows[0]["rps"])}


# -- the floors ------------------------------------------------------------------------------


@dataclass
class App:
    """A floor app in a session of its own (its Ray cluster with it), its output in a file."""

    proc: subprocess.Popen
    url: str
    log: Path

    @property
    def session(self) -> int:
        return self.proc.pid


def tail(path: Path, lines: int = 30) -> str:
    """The last lines of a log, which is removed."""
    text = "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    path.unlink(missing_ok=True)
    return text


def start_app(module: str, *args: str, timeout_s: float = 300) -> App:
    """``python -m module --port P *args`` in a session of its own, once ``/ready`` answers."""
    from single_controller.rendezvous import free_port

    port = free_port()
    log = Path(tempfile.mkstemp(prefix="floor-app-", suffix=".log")[1])
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", module, "--port", str(port), *args], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return App(proc, url, log)
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            stop_session(proc)
            raise RuntimeError(f"{module} exited with {proc.returncode}:\n{tail(log)}")
        time.sleep(0.5)
    stop_session(proc)
    raise RuntimeError(f"{module} did not answer within {timeout_s:g} s:\n{tail(log)}")


def session_pids(session: int) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == session:
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
    return pids


def stop_session(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """Stop a floor app as Ctrl-C would (its Ray cluster stops with it), then kill whatever
    of its session is left, so that the next target has the machine alone."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    for pid in session_pids(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.wait(timeout=30)


@contextmanager
def running_app(module: str, *args: str) -> Iterator[App]:
    app = start_app(module, *args)
    try:
        yield app
    finally:
        stop_session(app.proc)
        app.log.unlink(missing_ok=True)


#: The floors of a floor run, by name: the module and its arguments.
FLOORS = {
    "add": ("bench.floor_app", ("--ranks", "8")),
    "infer_plain": ("bench.infer_floor_app", ("--mode", "plain")),
    "infer_compiled": ("bench.infer_floor_app", ("--mode", "compiled")),
}


#: The floors as the page names them.
FLOOR_NAMES = {"add": "the `add` floor", "infer_plain": "the inference floor (plain calls)",
               "infer_compiled": "the inference floor (compiled graph)"}


def floor_run(settings: Settings, floors: tuple[str, ...] = tuple(FLOORS), scaling: bool = False) -> dict[str, Any]:
    """Each named floor started alone, measured and stopped. ``scaling``: requests/s with P
    and 2P client processes as well (:func:`client_scaling`), of the ``add`` floor at
    ``ADD_CONCURRENCY`` clients where it runs, else of the last inference floor at the
    largest of ``INFER_CONCURRENCY``."""
    out: dict[str, Any] = {}
    scaled = ("add" if "add" in floors else [f for f in floors if f != "add"][-1]) if scaling else None
    for name in floors:
        module, args = FLOORS[name]
        started = time.perf_counter()
        say(f"floor {name}: starting")
        with running_app(module, *args) as app:
            say(f"floor {name}: measuring")
            if name == "add":
                out[name] = measure_add(app.url, *ADD_FLOOR, settings)
                load = Load.of_json(app.url, *ADD_FLOOR, concurrency=ADD_CONCURRENCY, processes=settings.processes,
                                    warmup_s=settings.warmup_s, window_s=settings.window_s)
            else:
                body, headers = infer_body()
                load = Load(app.url, "/v2/models/mlp/infer", body, headers, concurrency=INFER_CONCURRENCY[-1],
                            processes=settings.processes, warmup_s=settings.warmup_s, window_s=settings.window_s)
                # the scaling figure follows on this floor: its last window is awaited
                out[name] = measure_infer(app.url, "/v2/models/mlp/infer", settings, TargetCpu([app.session]),
                                          last=name != scaled)
            if name == scaled:
                out["client_scaling"] = {"target": name, **client_scaling(load)}
        out[name]["seconds"] = time.perf_counter() - started  # its start, figures and stop
    return out


# -- the service -----------------------------------------------------------------------------


@contextmanager
def request_path(path: str) -> Iterator[None]:
    """The environment a ``ServeProcess`` is built in for a request path: Serve's own proxy
    is ``HYBRIDFLOW_SERVE_HAPROXY=0`` (tests/serve_process.py reads it when built)."""
    if path not in PATHS:
        raise ValueError(f"unknown request path {path!r}; known: {', '.join(PATHS)}")
    saved = os.environ.get("HYBRIDFLOW_SERVE_HAPROXY")
    os.environ["HYBRIDFLOW_SERVE_HAPROXY"] = "1" if path == "haproxy" else "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("HYBRIDFLOW_SERVE_HAPROXY", None)
        else:
            os.environ["HYBRIDFLOW_SERVE_HAPROXY"] = saved


def service_run(path: str, config: os.PathLike[str], settings: Settings, add: bool = True,
                extra: Callable[[ServeProcess], dict[str, Any]] | None = None) -> dict[str, Any]:
    """``serve run config`` on ``path``: the ``add`` (``add``: when the config has its
    group), then ``extra(proc)``'s figures (under ``figures``), then each of
    ``SERVED_MODELS`` with CPU per request; stopped at the end."""
    with request_path(path):
        proc = ServeProcess(config=config)
    started = time.perf_counter()
    say(f"service on {path}: starting")
    proc.start(timeout_s=600, ready_path="/readyz")
    say(f"service on {path}: measuring")
    out: dict[str, Any] = {"start_s": time.perf_counter() - started}
    try:
        if add:
            out["add"] = measure_add(proc.url, *ADD_SERVICE, settings)
        if extra is not None:
            out["figures"] = extra(proc)
        cpu = TargetCpu([proc.proc.pid], RANK_CLASSES)
        for i, (name, model) in enumerate(SERVED_MODELS.items()):
            out[name] = measure_infer(proc.url, f"/v2/models/{model}/infer", settings, cpu,
                                      last=i == len(SERVED_MODELS) - 1)
    finally:
        proc.kill()
    out["seconds"] = time.perf_counter() - started
    return out


# -- the figures -----------------------------------------------------------------------------


def role_ms(measured: dict[str, Any], concurrency: int, *roles: str) -> float:
    """CPU ms per request of the named roles in a measured window."""
    by_role = measured[f"cpu_{concurrency}"]["roles_ms"]
    return sum(by_role.get(role, 0.0) for role in roles)


def path_ms(measured: dict[str, Any], concurrency: int, excluded: str) -> float:
    """CPU ms per request of every process of the target but ``excluded``'s role."""
    by_role = measured[f"cpu_{concurrency}"]["roles_ms"]
    return sum(ms for role, ms in by_role.items() if role != excluded)


def mean(values: list[float | None]) -> float | None:
    """The mean, or None where a run has no figure (no request answered in its window)."""
    return None if any(v is None for v in values) else sum(values) / len(values)


def ratio(served: float | None, floor: float | None) -> float | None:
    """``served / floor``; None where either is missing or the floor's is not above zero (a
    CPU figure read below zero, say), which no ratio would mean."""
    if served is None or floor is None or floor <= 0:
        return None
    return served / floor


#: The CPU targets' concurrency.
CPU_AT = INFER_CONCURRENCY[0]


def infer_summary(measured: dict[str, Any], ranks_role: str) -> dict[str, float]:
    """One infer target's figures, flat: lone p50/p99, requests/s and p99 at each
    concurrency, and at ``CPU_AT`` clients the CPU ms per request of the machine, of the
    target's processes, of the path (every process but the layer's) and of the layer's
    processes, the ingress replica
    (the floor app), the proxy, the controllers, Ray's daemons and other processes."""
    out = {"lone_p50_ms": measured["lone_p50_ms"], "lone_p99_ms": measured["lone_p99_ms"]}
    for c in INFER_CONCURRENCY:
        out[f"rps_{c}"] = measured[f"rps_{c}"]
        out[f"p50_ms_{c}"] = measured[f"p50_ms_{c}"]
        out[f"p99_ms_{c}"] = measured[f"p99_ms_{c}"]
        out[f"cpu_ms_{c}"] = measured[f"cpu_{c}"]["machine_ms"]
    out["processes_cpu_ms"] = measured[f"cpu_{CPU_AT}"]["processes_ms"]
    out["path_cpu_ms"] = path_ms(measured, CPU_AT, ranks_role)
    out["layer_cpu_ms"] = role_ms(measured, CPU_AT, ranks_role)
    out["front_cpu_ms"] = role_ms(measured, CPU_AT, INGRESS, FLOOR_APP)
    out["proxy_cpu_ms"] = role_ms(measured, CPU_AT, PROXY)
    out["controllers_cpu_ms"] = role_ms(measured, CPU_AT, CONTROLLERS)
    out["ray_daemons_cpu_ms"] = role_ms(measured, CPU_AT, RAY_DAEMONS)
    out["others_cpu_ms"] = role_ms(measured, CPU_AT, OTHER)
    return out


def averaged(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's mean over a floor's runs."""
    return {key: mean([run.get(key) for run in runs]) for key in runs[0]}


def figures(floor_runs: list[dict[str, Any]], services: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The flat figures of ``bench.run`` and its ratios: every floor averaged over the floor
    runs that measured it, each path's service figures, and their ratios."""
    out: dict[str, Any] = {}
    add_runs = [run["add"] for run in floor_runs if "add" in run]
    if add_runs:
        for key in ("lone_p50_ms", "lone_p99_ms", f"rps_{ADD_CONCURRENCY}"):
            out[f"add_floor_{key}"] = mean([run[key] for run in add_runs])
        out["add_floor_runs"] = len(add_runs)
    floors: dict[str, dict[str, float]] = {}
    for name, role in (("plain", FLOOR_ACTOR), ("compiled", FLOOR_ACTOR)):
        runs = [infer_summary(run[f"infer_{name}"], role) for run in floor_runs if f"infer_{name}" in run]
        if runs:
            floors[name] = averaged(runs)
            out.update({f"infer_floor_{name}_{key}": value for key, value in floors[name].items()})
            out[f"infer_floor_{name}_runs"] = len(runs)
    for path, service in services.items():
        if "add" in service and add_runs:
            add = service["add"]
            out[f"add_lone_p50_ms_{path}"] = add["lone_p50_ms"]
            out[f"add_lone_p99_ms_{path}"] = add["lone_p99_ms"]
            out[f"add_rps_{ADD_CONCURRENCY}_{path}"] = add[f"rps_{ADD_CONCURRENCY}"]
            out[f"add_p50_floor_ratio_{path}"] = ratio(add["lone_p50_ms"], out["add_floor_lone_p50_ms"])
            out[f"add_rps_floor_ratio_{path}"] = ratio(add[f"rps_{ADD_CONCURRENCY}"],
                                                       out[f"add_floor_rps_{ADD_CONCURRENCY}"])
        for kind in SERVED_MODELS:
            if kind not in service:
                continue
            summary = infer_summary(service[kind], RANKS)
            prefix = "infer" if kind == "unbatched" else "infer_batched"
            out.update({f"{prefix}_{key}_{path}": value for key, value in summary.items()})
            for name, floor in floors.items():
                for key in ("lone_p50_ms", *(f"rps_{c}" for c in INFER_CONCURRENCY), f"cpu_ms_{CPU_AT}"):
                    out[f"{prefix}_{key}_vs_{name}_{path}"] = ratio(summary[key], floor.get(key))
        if "unbatched" in service and "plain" in floors:
            plain = floors["plain"]
            out[f"infer_path_cpu_ratio_{path}"] = ratio(out[f"infer_path_cpu_ms_{path}"], plain["path_cpu_ms"])
            out[f"infer_rank_cpu_ratio_{path}"] = ratio(out[f"infer_layer_cpu_ms_{path}"], plain["layer_cpu_ms"])
        if "batched" in service and "plain" in floors:
            out[f"infer_batched_cpu_ratio_{path}"] = ratio(out[f"infer_batched_cpu_ms_{CPU_AT}_{path}"],
                                                           floors["plain"][f"cpu_ms_{CPU_AT}"])
    # a failed request counts in no figure: how many there were, over every window of every run
    records = [r for run in [*floor_runs, *services.values()] for r in run.values() if isinstance(r, dict)]
    out["served_errors"] = sum(v for r in records for k, v in r.items()
                               if (k == "lone_errors" or k.startswith("errors_")) and isinstance(v, int))
    scaling = next((run["client_scaling"] for run in floor_runs if "client_scaling" in run), None)
    if scaling is not None:
        (low, high) = scaling["runs"]
        out["client_scaling_target"] = f"{FLOOR_NAMES[scaling['target']]} at {scaling['concurrency']} clients"
        out["client_scaling_processes"] = [low["processes"], high["processes"]]
        out["client_scaling_rps"] = [low["rps"], high["rps"]]
        out["client_scaling_ratio"] = scaling["ratio"]
    return out

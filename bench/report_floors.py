"""The benchmarks page's tables of the served path against its hand-written floors
(``bench.floor_runs``'s figures, from ``bench.run`` or ``bench.gpu``): the load generator's
settings, each served inference figure beside both floors', and the CPU per request of
each process on the path. Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bench.report_format import number, show, table

#: Keys of ``bench.floor_runs.figures``: the tables here describe them.
PREFIXES = ("add_floor_", "add_lone_", "add_rps_", "add_p50_", "infer_", "client_scaling_", "gpu_", "served_errors")
#: Keys of the run's record that are no figure of their own.
RECORDS = ("load_generator", "served_runs")
PATHS = {"haproxy": "HAProxy (`make serve`)", "serve_proxy": "Serve's proxy (plain `serve run`)"}
FLOORS = {"plain": "floor: app over one actor, plain calls", "compiled": "floor: app over one actor, compiled graph"}
SERVED = {"infer": "unbatched `mlp_unbatched`", "infer_batched": "batched `mlp`"}


def described(key: str) -> bool:
    """Whether the tables of this module (or the section they follow) show ``key``."""
    return key.startswith(PREFIXES) or key in RECORDS


def load_generator_lines(settings: Any, errors: Any = None) -> list[str]:
    if not isinstance(settings, Mapping):
        return []
    failed = (f" Requests that failed, over every window of these runs: {errors} (a failed request counts in "
              "no figure)." if isinstance(errors, int) else "")
    shape = show("", settings.get("infer_shape"))
    return ["", "The load generator (`bench/load_generator.py`): closed-loop clients over "
            f"{settings.get('processes')} client processes; a lone client for {number(settings.get('lone_s', 0))} s; "
            f"windows of {number(settings.get('window_s', 0))} s after a warm-up of at least "
            f"{number(settings.get('warmup_s', 0))} s that lasts until every client has had an answer; the "
            f"target's idle CPU read for {number(settings.get('idle_s', 0))} s before its load. `add` at "
            f"{settings.get('add_concurrency')} clients; inference at "
            f"{' and '.join(str(c) for c in settings.get('infer_concurrency', []))} clients, one {shape} "
            f"FP32 binary body, its answer in binary.{failed}"]


def _targets(results: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """``(label, key prefix, key suffix)`` of the infer targets in the results: the floors
    first, then the served models on each path."""
    rows = [(FLOORS[f], f"infer_floor_{f}_", "") for f in FLOORS if f"infer_floor_{f}_lone_p50_ms" in results]
    for path_key, path_label in PATHS.items():
        for prefix, served in SERVED.items():
            if f"{prefix}_lone_p50_ms_{path_key}" in results:
                rows.append((f"{served}, {path_label}", f"{prefix}_", f"_{path_key}"))
    return rows


def _cell(results: Mapping[str, Any], prefix: str, key: str, suffix: str) -> str:
    value = results.get(f"{prefix}{key}{suffix}")
    text = show(key, value)
    if not suffix:  # a floor: its own figure
        return text
    ratios = [f"{number(ratio)}x {floor}" for floor in FLOORS
              if isinstance(ratio := results.get(f"{prefix}{key}_vs_{floor}{suffix}"), (int, float))]
    return f"{text} ({', '.join(ratios)})" if ratios else text


def served_lines(results: Mapping[str, Any]) -> list[str]:
    """Each served inference figure beside the floors' (a floor's: its mean over its runs),
    with its ratio to each floor."""
    rows = _targets(results)
    if not rows:
        return []
    concurrency = sorted({int(k.rsplit("_", 1)[1]) for k in results
                          if k.startswith("infer_floor_plain_rps_") and k.rsplit("_", 1)[1].isdigit()})
    keys = ["lone_p50_ms", "lone_p99_ms", *(f"rps_{c}" for c in concurrency),
            *(f"p99_ms_{c}" for c in concurrency[-1:]), *(f"cpu_ms_{c}" for c in concurrency[:1])]
    header = ["target", "lone p50", "lone p99", *(f"requests/s at {c}" for c in concurrency),
              *(f"p99 at {c}" for c in concurrency[-1:]), *(f"CPU ms/request at {c}" for c in concurrency[:1])]
    body = [[label, *(_cell(results, prefix, key, suffix) for key in keys)] for label, prefix, suffix in rows]
    return ["", "### Inference: the service against both floors", "",
            "Each served figure with its ratio to the plain floor and to the compiled-graph floor (requests/s: "
            "higher is better; the rest: lower). CPU: the whole machine's per request, the load generator's own "
            "CPU and the target's idle rate left out.", "", *table(header, body)]


#: The CPU table's columns: a figure of ``bench.floor_runs.infer_summary`` and its heading.
ROLES = (("processes_cpu_ms", "all its processes"), ("layer_cpu_ms", "layer (rank / actor)"), ("path_cpu_ms", "path (all but the layer)"),
         ("front_cpu_ms", "ingress replica / app"), ("proxy_cpu_ms", "proxy"), ("controllers_cpu_ms", "controllers"),
         ("ray_daemons_cpu_ms", "Ray's daemons"), ("others_cpu_ms", "other processes"))


def cpu_lines(results: Mapping[str, Any]) -> list[str]:
    """CPU ms per request of each process on the path, by role, for each infer target."""
    rows = _targets(results)
    if not rows:
        return []
    body = [[label, *(show("_ms", results.get(f"{prefix}{key}{suffix}")) for key, _ in ROLES)]
            for label, prefix, suffix in rows]
    return ["", "### Inference: CPU per request, process by process", "",
            "CPU ms per request at 16 clients of each of the target's processes, read from /proc at the load "
            "window's start and end, by role (`bench.cold_start.role_of`), each less its idle rate. The path is "
            "every process but the layer's: the proxy (HAProxy, or Serve's proxy actor), the ingress replica or "
            "the floor's app process, the controllers (Serve's and the service's), Ray's daemons (raylet, GCS, "
            "dashboard, agents, `serve run`) and other processes (the other groups' ranks, the no-op app). A "
            "process that polls while idle (a compiled graph's actor and driver) may poll less under load, so its "
            "figure can read below zero.", "",
            *table(("target", *(heading for _, heading in ROLES)), body)]


def scaling_lines(results: Mapping[str, Any]) -> list[str]:
    processes, rps = results.get("client_scaling_processes"), results.get("client_scaling_rps")
    if not isinstance(processes, list) or not isinstance(rps, list):
        return []
    target = results.get("client_scaling_target", "the `add` floor at 32 clients")
    rows = [[str(p), number(r)] for p, r in zip(processes, rps, strict=False)]
    return ["", "### The load generator is not what is measured", "",
            f"Requests/s of {target} with the bench's client processes and with twice as many.", "",
            *table(("client processes", "requests/s"), rows)]


def floors_lines(results: Mapping[str, Any]) -> list[str]:
    """Every table of this module that the results have figures for."""
    return [*load_generator_lines(results.get("load_generator"), results.get("served_errors")),
            *scaling_lines(results), *served_lines(results),
            *cpu_lines(results)]

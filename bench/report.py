"""docs/benchmarks.md, rendered from the bench's results: the page is generated, never
edited by hand.

    python -m bench.report [bench/results/latest.json]

``make bench`` (``bench.run``) renders it at the end of every run. The page has a table
per section of ``latest.json``: each figure, what it compares, the figures it is computed
from and, where the bench sets one, its target. Figures the sections below do not name
(a figure added to ``bench.run`` later) are listed in a last table, so that no measured
figure is left off. Where the results directory holds them, the page adds the results of
the other bench tools (``bench.hops``, ``bench.call_cpu``, ``bench.gpu``) and of other
recorded ``bench.run`` runs, each with the command that writes it. Without a results
file the page says that no run is recorded yet.

Standard library only: rendering needs no Ray, torch or service.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.report_floors import described as floors_described
from bench.report_floors import floors_lines
from bench.report_format import number, show, table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
COMMAND = "python -m bench.report bench/results/latest.json"

#: Keys of a results file that describe the run rather than measure anything.
META = frozenset({"quick", "machine", "when", "bench_seconds", "bench_part_seconds", "targets"})


@dataclass(frozen=True)
class Figure:
    """One row: the figure under ``key``, what it compares, the keys it is computed from,
    and which way is better (``lower`` or ``higher``; None where neither is)."""

    key: str
    what: str
    inputs: tuple[str, ...] = ()
    better: str | None = None


@dataclass(frozen=True)
class Section:
    title: str
    floor: str
    figures: tuple[Figure, ...]


F = Figure
#: The section the served-against-floors tables (``bench.report_floors``) follow.
FLOORS_TITLE = "The service against hand-written floors, each run alone"
SECTIONS = (
    Section(
        "The library: worker-group calls (no HTTP)",
        "A Ray cluster of 4 CPUs in the bench's own process; the floor is plain Ray on the same "
        "4 actors, timed in alternating rounds with the group's call.",
        (
            F("one_to_all_ratio", "ONE_TO_ALL over 4 workers vs raw `ray.get([a.m.remote(x) ...])`, p50",
              ("one_to_all_p50_ms", "fanout_raw_p50_ms"), "lower"),
            F("one_to_all_compiled_ratio", "the same call through the group's compiled graph (`wg.compile()`) "
              "vs raw fan-out", ("one_to_all_compiled_p50_ms", "fanout_raw_p50_ms"), "lower"),
            F("compiled_graph_ratio_to_raw", "a bare Ray compiled graph over the 4 actors vs raw fan-out",
              ("compiled_graph_fanout_p50_ms", "fanout_raw_p50_ms"), "lower"),
            F("execute_all_add_p50_ms", "`execute_all_sync` over 4 workers, p50 (the HTTP figure's library floor)"),
            F("group_call_loop_over_thread", "a group call awaited on an event loop (as the controller makes it) "
              "vs a blocking call in a thread", ("group_call_on_loop_p50_ms", "group_call_in_thread_p50_ms"), "lower"),
            F("colocated_start_ratio", "starting 2 worker classes on one pool of 4: one colocated group vs a "
              "group each", ("start_colocated_s", "start_separate_groups_s", "colocated_roles"), "lower"),
            F("tensor_return_ratio", "ONE_TO_ALL to 4 ranks that each answer a one-element tensor: ranks "
              "sending tensors out of band vs torch's pickling",
              ("tensor_return_out_of_band_p50_ms", "tensor_return_p50_ms"), "lower"),
            F("compiled_idle_cores", "cores the 4 ranks of an idle compiled graph keep busy (after "
              "`teardown()`: `plain_idle_cores`)", ("plain_idle_cores",), "lower"),
            F("transport_socket_over_tasks", "the controller's transports from its event loop: a ONE_TO_ALL "
              "call over the group's socket channel (`transport: socket`, what `auto` picks) vs a Ray task per "
              "rank (`tasks`), p50; the cores the 4 idle ranks keep busy with each",
              ("transport_socket_p50_ms", "transport_tasks_p50_ms", "transport_socket_idle_cores",
               "transport_tasks_idle_cores"), "lower"),
            F("transport_compiled_over_tasks", "the same call over the group's compiled graph (`transport: "
              "compiled`) vs a Ray task per rank, p50; the cores its 4 idle ranks keep busy",
              ("transport_compiled_p50_ms", "transport_tasks_p50_ms", "transport_compiled_idle_cores"), "lower"),
        ),
    ),
    Section(
        "The tensor-parallel MLP layer",
        "`MLPLayerWorker` on a `MegatronRayWorkerGroup` of tp=4 (CPU, gloo) against the same "
        "weights in one process with torch.",
        (
            F("mlp_ratio", "tp=4 forward vs single-process torch (`mlp_shape`: seq, batch, hidden, ffn)",
              ("mlp_tp4_s", "mlp_single_process_s", "mlp_shape"), "lower"),
            F("mlp_rel_err", "relative error of the tp=4 output against the single-process one", (), "lower"),
            F("megatron_compute_puts_per_call", "object-store puts per MEGATRON_COMPUTE call (one input shared "
              "by a dp rank's tp ranks)", ("megatron_compute_dp_size",), "lower"),
            F("batching_forward_bound", "the forward alone: a request vs its share of one forward of a full "
              "batch (the most any batcher could gain here)",
              ("layer_forward_lone_ms", "layer_forward_full_batch_ms"), "higher"),
        ),
    ),
    Section(
        "Durable state",
        "Two controllers side by side in one Ray cluster, calls interleaved: `add` on a 4-rank group "
        "through the controller (journal, store, acknowledgement; no HTTP), SQLite against memory.",
        (
            F("state_added_p50_ms", "p50 added to a mutating call by the SQLite store",
              ("state_sqlite_add_p50_ms", "state_memory_add_p50_ms"), "lower"),
            F("state_added_key_p50_ms", "the same with an Idempotency-Key (its answer is recorded too)",
              ("state_sqlite_add_key_p50_ms", "state_memory_add_key_p50_ms"), "lower"),
            F("state_ratio", "SQLite vs memory, p50", ("state_sqlite_add_p50_ms", "state_memory_add_p50_ms",
                                                       "state_calls_per_series"), "lower"),
        ),
    ),
    Section(
        "The HTTP service",
        "`serve run` of `serve_config.yaml` with a no-op Serve app beside it (`bench/noop_app.py`, at "
        "`/noop`), calls interleaved with the no-op route's.",
        (
            F("http_add_ratio", "HTTP `add` on a 4-rank group, p50, vs the no-op route's p50 plus the "
              "library's execute_all", ("http_add_p50_ms", "http_noop_p50_ms", "execute_all_add_p50_ms",
                                        "http_add_floor_ms"), "lower"),
            F("rps_ratio", "`add` requests/s at 32 clients vs the no-op route's", ("rps_add_32", "rps_noop_32"),
              "higher"),
            F("cold_start_ratio", "cold start of `serve run serve_config.yaml` (until `/readyz`) vs a no-op "
              "Serve app", ("cold_start_service_s", "cold_start_noop_s", "service_worker_processes"), "lower"),
            F("cold_start_floor_ratio", "cold start (reported beside its floor, no target) vs one script starting the same worker processes with the "
              "same imports (megatron.core in a Megatron rank); the service's milestones, from Ray's timeline "
              "(`bench/start_timeline.py`): a first rank starts its `__init__`, every rank is up, the ranks' "
              "setup calls (Megatron, `init_model`) have returned",
              ("cold_start_service_s", "cold_start_floor_s", "cold_start_first_rank_s", "cold_start_ranks_up_s",
               "cold_start_ranks_set_up_s"), "lower"),
            F("cold_start_cpu_ratio", "CPU seconds of every process of the two starts: the service's vs the "
              "floor script's, sampled from /proc. On a machine busy throughout the start, wall time follows "
              "CPU: the service's own share is Ray's processes with `serve run`, the dashboard and HAProxy "
              "(`ray`), Serve's controller, proxies and build task (`serve`), the controller and ingress "
              "replicas (`replicas`), and what its ranks do beyond the floor's (`workers`: Megatron's setup, "
              "`init_model`, and the first weight sync where it begins before `/readyz`)",
              ("cold_start_cpu_s", "cold_start_floor_cpu_s", "cold_start_cpu_ray_s", "cold_start_cpu_serve_s",
               "cold_start_cpu_replicas_s", "cold_start_cpu_workers_s", "cold_start_floor_cpu_workers_s",
               "cold_start_machine_busy_fraction"), "lower"),
        ),
    ),
    Section(
        FLOORS_TITLE,
        "Each target runs alone on the machine, as a user would run it instead of the other: the hand-written "
        "floors (`bench/floor_app.py`: FastAPI + uvicorn over the 8 ranks of the `add`'s worker class; "
        "`bench/infer_floor_app.py`: FastAPI + uvicorn over one Ray actor holding a Llama MLP of the served "
        "layer's size, plain calls or a compiled graph), then the service (`serve_config.yaml` with the `mlp` "
        "layer at tp=1) on `make serve`'s path (HAProxy), the floors again, the service on a plain `serve run` "
        "(Serve's proxy). A floor's figure is its mean over its runs. Every figure comes from the load "
        "generator; the CPU figures are read from /proc (`bench/request_cpu.py`).",
        (
            F("add_p50_floor_ratio_haproxy", "HTTP ONE_TO_ALL `add` on 8 ranks (`gpu_accumulator_decorator`), a "
              "lone client's p50, on HAProxy vs the hand-written app over the same worker class and ranks",
              ("add_lone_p50_ms_haproxy", "add_lone_p99_ms_haproxy", "add_floor_lone_p50_ms", "add_floor_lone_p99_ms",
               "add_floor_runs"), "lower"),
            F("add_p50_floor_ratio_serve_proxy", "the same on Serve's proxy",
              ("add_lone_p50_ms_serve_proxy", "add_lone_p99_ms_serve_proxy", "add_floor_lone_p50_ms",
               "add_floor_lone_p99_ms"), "lower"),
            F("add_rps_floor_ratio_haproxy", "the same `add`'s requests/s at 32 clients, HAProxy vs the floor",
              ("add_rps_32_haproxy", "add_floor_rps_32"), "higher"),
            F("add_rps_floor_ratio_serve_proxy", "the same on Serve's proxy",
              ("add_rps_32_serve_proxy", "add_floor_rps_32"), "higher"),
            F("infer_path_cpu_ratio_haproxy", "unbatched `mlp` infer at tp=1 (`[8, 2, 4096]` FP32 binary, 16 "
              "clients), HAProxy: CPU ms per request of every process but the layer's ranks vs the plain floor's "
              "(its app process and Ray's daemons); the ingress replica's share beside the app process's",
              ("infer_path_cpu_ms_haproxy", "infer_floor_plain_path_cpu_ms", "infer_front_cpu_ms_haproxy",
               "infer_floor_plain_front_cpu_ms", "infer_proxy_cpu_ms_haproxy", "infer_controllers_cpu_ms_haproxy",
               "infer_ray_daemons_cpu_ms_haproxy", "infer_floor_plain_ray_daemons_cpu_ms"), "lower"),
            F("infer_path_cpu_ratio_serve_proxy", "the same on Serve's proxy",
              ("infer_path_cpu_ms_serve_proxy", "infer_floor_plain_path_cpu_ms", "infer_front_cpu_ms_serve_proxy",
               "infer_floor_plain_front_cpu_ms", "infer_proxy_cpu_ms_serve_proxy",
               "infer_controllers_cpu_ms_serve_proxy", "infer_ray_daemons_cpu_ms_serve_proxy"), "lower"),
            F("infer_rank_cpu_ratio_haproxy", "the same requests: CPU ms per request of the layer's rank vs the "
              "floor's actor", ("infer_layer_cpu_ms_haproxy", "infer_floor_plain_layer_cpu_ms"), "lower"),
            F("infer_rank_cpu_ratio_serve_proxy", "the same on Serve's proxy",
              ("infer_layer_cpu_ms_serve_proxy", "infer_floor_plain_layer_cpu_ms"), "lower"),
            F("infer_batched_cpu_ratio_haproxy", "batched `mlp` at 16 clients: the whole machine's CPU ms per "
              "request (the load generator's CPU and the idle rate left out) vs the plain floor's; beside it the "
              "sum of the target's own processes (which other work on the machine does not reach)",
              ("infer_batched_cpu_ms_16_haproxy", "infer_floor_plain_cpu_ms_16", "infer_cpu_ms_16_haproxy",
               "infer_batched_processes_cpu_ms_haproxy", "infer_floor_plain_processes_cpu_ms"), "lower"),
            F("infer_batched_cpu_ratio_serve_proxy", "the same on Serve's proxy",
              ("infer_batched_cpu_ms_16_serve_proxy", "infer_floor_plain_cpu_ms_16", "infer_cpu_ms_16_serve_proxy",
               "infer_batched_processes_cpu_ms_serve_proxy", "infer_floor_plain_processes_cpu_ms"), "lower"),
            F("client_scaling_ratio", "a floor's requests/s with twice the client processes vs with the "
              "bench's (near 1.0: the load generator is not what is measured)",
              ("client_scaling_target", "client_scaling_processes", "client_scaling_rps"), None),
        ),
    ),
    Section(
        "Tensors over HTTP",
        "One tensor of `tensor_mib` MiB FP32 per request, the best of a few; the floor is the same "
        "bytes posted to the no-op route.",
        (
            F("safetensors_ratio", "upload through safetensors (`test_actor/checksum`: tensor in, 8 bytes "
              "out) vs the no-op route", ("safetensors_bandwidth_MBps", "noop_bandwidth_MBps", "tensor_mib"),
              "higher"),
            F("oip_binary_ratio", "upload through OIP binary (`/v2/models/checksum/infer`) vs the no-op route",
              ("oip_binary_bandwidth_MBps", "noop_bandwidth_MBps"), "higher"),
            F("safetensors_echo_MBps", "round trip (tensor in and back out, `echo`) through safetensors",
              (), "higher"),
            F("oip_binary_echo_MBps", "round trip through OIP binary", (), "higher"),
            F("json_1MiB_bandwidth_MBps", "a 1 MiB tensor as JSON (`echo`)", (), "higher"),
        ),
    ),
    Section(
        "The Open Inference Protocol over gRPC",
        "tritonclient's gRPC and HTTP clients on the same `[8, 2, 4096]` FP32 input, timed in "
        "alternating rounds (`bench/grpc_path.py`): the `mlp` model, then `echo` (the same tensor in "
        "and out, no forward) through the service's front and straight to the ingress replica's own "
        "ports, so the front's share of each path is the difference.",
        (
            F("grpc_over_http", "`mlp` infer p50: gRPC vs the HTTP binary path",
              ("grpc_mlp_p50_ms", "http_mlp_p50_ms", "shape", "samples", "same_answer"), "lower"),
            F("echo_grpc_over_http", "`echo` p50 through the front: gRPC vs HTTP binary",
              ("grpc_echo_p50_ms", "http_echo_p50_ms"), "lower"),
            F("echo_direct_grpc_over_http", "`echo` p50 straight to the ingress replica: gRPC vs HTTP binary",
              ("grpc_echo_direct_p50_ms", "http_echo_direct_p50_ms"), "lower"),
            F("grpc_front_added_ms", "what the front adds to a gRPC `echo` (through it minus direct)", (), "lower"),
            F("http_front_added_ms", "what the front adds to an HTTP `echo`", (), "lower"),
        ),
    ),
    Section(
        "Dynamic batching (the `mlp` model)",
        "`mlp` (batching) against `mlp_unbatched` (the same group and method, a forward per request), "
        "binary OIP, windows interleaved.",
        (
            F("batching_rps_ratio", "requests/s at `batching_clients` clients: batched vs unbatched",
              ("batching_rps", "batching_rps_unbatched", "batching_clients", "batching_shape",
               "batching_max_batch_size"), "higher"),
            F("batching_latency_ratio", "one client's p50: batched vs unbatched plus the longest wait",
              ("batching_single_p50_ms", "batching_single_p50_unbatched_ms", "batching_max_wait_ms"), "lower"),
        ),
    ),
)

def target_of(key: str, results: Mapping[str, Any], better: str | None) -> str:
    """``<= 1.15 (met)``, from the target the run recorded for the figure, if any."""
    entry = (results.get("targets") or {}).get(key)
    if not isinstance(entry, Mapping) or entry.get("target") is None:
        return ""
    if better is None:  # a figure this page does not describe: the side its value passed on
        value, goal, met = entry.get("value"), entry["target"], entry.get("met")
        better = "lower" if isinstance(value, (int, float)) and (value <= goal) == bool(met) else "higher"
    sign = "<=" if better == "lower" else ">="
    return f"{sign} {show(key, entry['target'])} ({'met' if entry.get('met') else '**missed**'})"


def section_lines(section: Section, results: Mapping[str, Any]) -> list[str]:
    rows = []
    for figure in section.figures:
        if figure.key not in results:
            continue
        sources = "; ".join(f"`{k}` {show(k, results[k])}" for k in figure.inputs if k in results)
        rows.append([f"`{figure.key}`", figure.what, show(figure.key, results[figure.key]), sources,
                     target_of(figure.key, results, figure.better)])
    if not rows:
        return []
    return ["", f"## {section.title}", "", section.floor, "",
            *table(("figure", "what it compares", "value", "from", "target"), rows)]


def hops_lines(hops: Any, title: str) -> list[str]:
    """Where an HTTP call's milliseconds go, from ``bench.hops.breakdown``'s record."""
    if not isinstance(hops, Mapping):
        return []
    rows = [[f"`{key}`", show(key, value)] for key, value in hops.items()
            if key.endswith("_ms") or key == "requests"]
    if not rows:
        return []
    return ["", f"### {title}", "",
            "Medians over the logged requests: each component's time from Serve's access logs (proxy, "
            "ingress, controller replica) and Ray's timeline (the workers); `a_minus_b_ms` is the hop "
            "between two of them.", "", *table(("hop", "p50"), rows)]


def other_lines(results: Mapping[str, Any], described: set[str]) -> list[str]:
    rows = [[f"`{key}`", show(key, value)] for key, value in results.items()
            if key not in described and key not in META and not isinstance(value, Mapping)]
    if not rows:
        return []
    return ["", "## Other figures of the run", "",
            "Figures the run recorded that the sections above do not describe.", "",
            *table(("figure", "value"), rows)]


# -- the other bench tools' results, where the results directory holds them ----------------


def settings_lines(settings: Mapping[str, Any]) -> list[str]:
    rows = []
    for name, run in settings.items():
        if not isinstance(run, Mapping):
            continue
        hops = run.get("hops") or {}
        path = " / ".join(f"{key.removesuffix('_ms').replace('_minus_', ' to ')} {number(v)}"
                          for key, v in hops.items() if "_minus_" in key and isinstance(v, (int, float))
                          and not key.startswith("client"))
        rows.append([name, show("_ms", run.get("add_p50_ms")), show("_ms", run.get("noop_p50_ms")),
                     show("_ms", run.get("add_over_noop_ms")), show("_s", run.get("ready_s")), path or "n/a"])
    if not rows:
        return []
    return ["", "## Serve settings and the hop to the controller", "",
            "Written by `python -m bench.hops` (`bench/results/serve_settings.json`): one `serve run` per "
            "setting of a small service (the 4-rank accumulator and the no-op app), `add` and the no-op "
            "route interleaved. The last column is where `add`'s milliseconds go, hop by hop.", "",
            *table(("setting", "`add` p50", "no-op p50", "`add` - no-op", "ready after", "hops (ms)"), rows)]


def call_cpu_lines(calls: Mapping[str, Any]) -> list[str]:
    rows = []
    for route, run in calls.items():
        if not isinstance(run, Mapping):
            continue
        by_process = run.get("cpu_ms_per_call_by_process") or {}
        largest = ", ".join(f"{name.removeprefix('ray::')} {number(ms)}" for name, ms in by_process.items()
                            if isinstance(ms, (int, float)) and ms >= 0.5)
        rows.append([f"`{route}`", show("_s", run.get("calls_per_s")).removesuffix(" s"),
                     show("_ms", run.get("cpu_ms_per_call")), largest or "n/a"])
    if not rows:
        return []
    return ["", "## CPU time of an HTTP call, by process", "",
            "Written by `python -m bench.call_cpu` (`bench/results/call_cpu.json`): every process's CPU "
            "seconds from `/proc` over a fixed time of calls at a fixed concurrency, divided by the calls.",
            "", *table(("route", "calls/s", "CPU per call", "processes at 0.5 ms or more (ms per call)"), rows)]


def gpu_lines(name: str, gpu: Mapping[str, Any]) -> list[str]:
    machine = gpu.get("machine") or {}
    parts = [str(machine["cuda"])] if machine.get("cuda") else []
    parts += [f"{machine['cpus']} CPUs"] if "cpus" in machine else []
    parts += [f"torch {machine['torch']}"] if "torch" in machine else []
    where = f" on {', '.join(parts)}" if parts else ""
    tools = " ".join(part for part in ("layer", "infer") if part in gpu) or "layer infer"
    quick = " --quick" if gpu.get("quick") else ""
    lines = ["", f"## On a GPU: `{name}`", "", f"Written by `python -m bench.gpu {tools}{quick}`{where}."]
    layer = gpu.get("layer") or {}
    rows = []
    for precision, run in (layer.get("precisions") or {}).items():
        for forward in run.get("forwards") or []:
            rows.append([precision, str(forward.get("layer", "")), show("", forward.get("shape")),
                         str(forward.get("tokens", "")), show("_ms", forward.get("ms")),
                         number(forward["tflops"]) if "tflops" in forward else "n/a",
                         f"{forward['of_measured_peak']:.0%}" if "of_measured_peak" in forward else "n/a",
                         number(run["matmul_peak_tflops"]) if "matmul_peak_tflops" in run else "n/a"])
    if rows:
        lines += ["", "The layer's forward (world size 1) against the card's peak, measured in the same run by a "
                      "square `torch.matmul` in each precision.", "",
                  *table(("precision", "layer", "shape", "tokens", "forward", "TFLOP/s", "of peak",
                          "peak TFLOP/s"), rows)]
    infer = gpu.get("infer")
    if isinstance(infer, Mapping):
        targets = [[f"`{key}`", str(entry.get("label", "")), show(key, entry.get("value")),
                    f"{entry.get('sign', '')} {show(key, entry.get('target'))} "
                    f"({'met' if entry.get('met') else '**missed**'})"]
                   for key, entry in (gpu.get("targets") or {}).items() if isinstance(entry, Mapping)]
        if targets:
            lines += ["", "The served layer (the `mlp` model at tp=1 on the GPU) against the hand-written floors, "
                          "each run alone:", "", *table(("figure", "what it compares", "value", "target"), targets)]
        lines += floors_lines(infer)
        rest = [[f"`{k}`", show(k, v)] for k, v in infer.items() if not floors_described(k) and not isinstance(v, Mapping)]
        if rest:
            lines += ["", "The batched `infer` path served on the GPU (the `mlp` model at tp=1).", "",
                      *table(("figure", "value"), rest)]
    return lines


def run_lines(name: str, run: Mapping[str, Any]) -> list[str]:
    rows = [[f"`{key}`", entry.get("label", ""), show(key, entry.get("value")), str(entry.get("raw", "")),
             target_of(key, run, next((f.better for s in SECTIONS for f in s.figures if f.key == key), None))]
            for key, entry in (run.get("targets") or {}).items() if isinstance(entry, Mapping)]
    if not rows:
        return []
    kind = "`--quick`" if run.get("quick") else "full"
    return ["", f"## Another recorded run: `{name}`", "",
            f"A {kind} run of `python -m bench.run` on {run.get('machine', 'an unrecorded machine')}, "
            f"{run.get('when', 'undated')}: its targeted figures.", "",
            *table(("figure", "what it compares", "value", "from", "target"), rows)]


def companion_lines(results: Mapping[str, Any], directory: Path | None) -> list[str]:
    if directory is None or not directory.is_dir():
        return []
    lines: list[str] = []
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or data == dict(results):
            continue
        if path.name == "serve_settings.json":
            lines += settings_lines(data)
        elif path.name == "call_cpu.json":
            lines += call_cpu_lines(data)
        elif isinstance(data.get("layer"), Mapping) or "infer" in data:  # bench.gpu (weight_sync names its layer)
            lines += gpu_lines(path.name, data)
        elif "targets" in data:
            lines += run_lines(path.name, data)
    return lines


def render(results: Mapping[str, Any], page: Path, results_dir: Path | None = RESULTS) -> str:
    lines = ["# Benchmarks", "",
             f"<!-- Generated by `{COMMAND}` (and at the end of `make bench`): do not edit by hand. -->", "",
             f"This page is generated from the bench's results by `{COMMAND}`; `make bench` "
             "(`python -m bench.run`) measures and renders it again. Every figure is a ratio to a floor "
             "measured side by side in the same run, or a raw measurement with what it is measured on. "
             "`--quick` runs use smaller tensors and fewer samples: they check that the bench works, and "
             "their ratios are noisier."]
    figures = {k: v for k, v in results.items() if k not in META}
    if not figures:
        lines += ["", "No run is recorded yet: `make bench` writes `bench/results/latest.json` and this page."]
    else:
        kind = "`--quick`" if results.get("quick") else "full"
        took = results.get("bench_seconds")
        lines += ["", f"The recorded run: a {kind} run on {results.get('machine', 'an unrecorded machine')}, "
                      f"{results.get('when', 'undated')}"
                      + (f", {number(took)} s in all." if isinstance(took, (int, float)) else ".")]
        if results_dir is not None and (results_dir / "latest.png").is_file():
            picture = Path(os.path.relpath(results_dir / "latest.png", page.parent)).as_posix()
            lines += ["", f"![the targeted ratios against their targets]({picture})"]
        described: set[str] = set()
        for section in SECTIONS:
            lines += section_lines(section, results)
            if section.title == FLOORS_TITLE:
                lines += floors_lines(results)
            described |= {f.key for f in section.figures} | {k for f in section.figures for k in f.inputs}
        described |= {key for key in results if floors_described(key)}
        lines += hops_lines(results.get("http_add_hops"), "Where an HTTP `add`'s time goes")
        described.add("http_add_hops")
        lines += other_lines(results, described)
    lines += companion_lines(results, results_dir)
    return "\n".join(lines) + "\n"


def write_benchmarks_page(results: dict, path: str | os.PathLike[str] = PAGE,
                          results_dir: str | os.PathLike[str] | None = RESULTS) -> Path:
    """Render ``results`` (``bench.run``'s ``latest.json``, as a dict) into the Markdown page
    at ``path``. ``results_dir``: where the other bench tools' results and the plot are
    looked for (None: the page shows ``results`` alone). Returns the page's path."""
    page = Path(path)
    page.parent.mkdir(parents=True, exist_ok=True)
    directory = Path(results_dir) if results_dir is not None else None
    page.write_text(render(results, page, directory))
    return page


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", type=Path, default=RESULTS / "latest.json",
                        help="bench.run's results (default: bench/results/latest.json); a missing file "
                             "renders a page that says no run is recorded yet")
    parser.add_argument("--out", type=Path, default=PAGE, help="the page (default: docs/benchmarks.md)")
    options = parser.parse_args(argv)
    results = json.loads(options.results.read_text()) if options.results.is_file() else {}
    print(write_benchmarks_page(results, options.out, options.results.resolve().parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmarks: every layer against its floor, as ratios measured in one run.

    make bench                 # full run (about 12 minutes on 2 cores)
    python -m bench.run --quick

The library's figures are timed side by side with their floors. The served path's are taken
in whole runs, one target alone on the machine at a time (``bench.floor_runs``): the
hand-written floors, the service on HAProxy, the floors again, the service on Serve's proxy,
every requests/s figure from the load generator (``bench.load_generator``).

Writes bench/results/latest.json (raw numbers and ratios) and bench/results/latest.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.http_figures import bench_http
from bench.library_figures import bench_durable_call, bench_library
from bench.report import write_benchmarks_page
from tests.serve_process import ROOT

RESULTS = ROOT / "bench" / "results"


TARGETS = {
    "add_p50_floor_ratio_haproxy": ("HTTP add, 8 ranks, lone p50, HAProxy / hand-written app alone", 1.0, "max"),
    "add_p50_floor_ratio_serve_proxy": ("the same on Serve's proxy (plain serve run)", 1.5, "max"),
    "add_rps_floor_ratio_haproxy": ("add rps at 32 clients, HAProxy / hand-written app alone", 1.0, "min"),
    "add_rps_floor_ratio_serve_proxy": ("the same on Serve's proxy", 0.67, "min"),
    "infer_path_cpu_ratio_haproxy": ("mlp infer CPU/request of the path, HAProxy / plain app's", 1.0, "max"),
    "infer_path_cpu_ratio_serve_proxy": ("the same on Serve's proxy", 1.0, "max"),
    "infer_rank_cpu_ratio_haproxy": ("mlp infer CPU/request of the ranks / the floor actor's", 1.0, "max"),
    "infer_rank_cpu_ratio_serve_proxy": ("the same on Serve's proxy", 1.0, "max"),
    "infer_batched_cpu_ratio_haproxy": ("batched mlp machine CPU/request / plain app's", 0.7, "max"),
    "infer_batched_cpu_ratio_serve_proxy": ("the same on Serve's proxy", 0.7, "max"),
    "grpc_over_http": ("mlp infer p50: gRPC / HTTP binary", 1.0, "max"),
    "weight_sync_vs_floor": ("weight sync tp4->tp2 / one ray.get of the full model", 1.0, "max"),
    "weight_sync_bytes_fraction_of_full": ("bytes per destination rank / full model (tp4->tp2)", 0.5, "max"),
    "one_to_all_ratio": ("ONE_TO_ALL / raw fan-out p50", 1.15, "max"),
    "one_to_all_compiled_ratio": ("ONE_TO_ALL compiled / raw fan-out p50", 1.0, "max"),
    "http_add_ratio": ("HTTP add / (no-op route + library)", 1.3, "max"),
    "safetensors_ratio": ("safetensors bandwidth / no-op", 0.5, "min"),
    "oip_binary_ratio": ("OIP binary bandwidth / no-op", 0.5, "min"),
    "mlp_ratio": ("tp=4 MLP / single-process torch", 1.3, "max"),
    "rps_ratio": ("add rps / no-op rps (32 clients)", 0.5, "min"),
    "state_added_p50_ms": ("durable store: added ms per mutating call (p50)", 1.0, "max"),
    "batching_rps_ratio": ("mlp rps, 16 clients: batched / unbatched", 4.0, "min"),
    "batching_latency_ratio": ("mlp p50, 1 client: batched / (unbatched + wait)", 1.0, "max"),
}


def _add_raw(path: str) -> str:
    return (f"{{add_lone_p50_ms_{path}:.1f}} (p99 {{add_lone_p99_ms_{path}:.1f}}) vs {{add_floor_lone_p50_ms:.1f}} "
            f"(p99 {{add_floor_lone_p99_ms:.1f}}) ms")


#: Each figure's raw numbers, as the PNG and the JSON's targets show them beside the ratio.
RAW = {
    **{f"add_p50_floor_ratio_{path}": _add_raw(path) for path in ("haproxy", "serve_proxy")},
    **{f"add_rps_floor_ratio_{path}": f"{{add_rps_32_{path}:.0f}} vs {{add_floor_rps_32:.0f}} requests/s"
       for path in ("haproxy", "serve_proxy")},
    **{f"infer_path_cpu_ratio_{path}": f"{{infer_path_cpu_ms_{path}:.1f}} vs {{infer_floor_plain_path_cpu_ms:.1f}} ms; "
                                       f"ingress {{infer_front_cpu_ms_{path}:.1f}} vs app "
                                       f"{{infer_floor_plain_front_cpu_ms:.1f}} ms"
       for path in ("haproxy", "serve_proxy")},
    **{f"infer_rank_cpu_ratio_{path}": f"{{infer_layer_cpu_ms_{path}:.1f}} vs {{infer_floor_plain_layer_cpu_ms:.1f}} ms"
       for path in ("haproxy", "serve_proxy")},
    **{f"infer_batched_cpu_ratio_{path}": f"{{infer_batched_cpu_ms_16_{path}:.1f}} vs "
                                          f"{{infer_floor_plain_cpu_ms_16:.1f}} ms"
       for path in ("haproxy", "serve_proxy")},
    "grpc_over_http": "{grpc_mlp_p50_ms:.1f} vs {http_mlp_p50_ms:.1f} ms",
    "weight_sync_vs_floor": "{weight_sync_p50_s:.3f} vs {weight_sync_floor_full_get_p50_s:.3f} s",
    "weight_sync_bytes_fraction_of_full": "of {weight_sync_full_mib:.0f} MiB",
    "one_to_all_ratio": "{one_to_all_p50_ms:.2f} vs {fanout_raw_p50_ms:.2f} ms",
    "one_to_all_compiled_ratio": "{one_to_all_compiled_p50_ms:.2f} vs {fanout_raw_p50_ms:.2f} ms",
    "http_add_ratio": "{http_add_p50_ms:.1f} vs {http_noop_p50_ms:.1f} + {execute_all_add_p50_ms:.1f} ms",
    "safetensors_ratio": "{safetensors_bandwidth_MBps:.0f} vs {noop_bandwidth_MBps:.0f} MB/s",
    "oip_binary_ratio": "{oip_binary_bandwidth_MBps:.0f} vs {noop_bandwidth_MBps:.0f} MB/s",
    "mlp_ratio": "{mlp_tp4_s:.2f} vs {mlp_single_process_s:.2f} s",
    "rps_ratio": "{rps_add_32:.0f} vs {rps_noop_32:.0f} requests/s",
    "batching_rps_ratio": "{batching_rps:.1f} vs {batching_rps_unbatched:.1f} requests/s; "
                          "forward alone bounds it at {batching_forward_bound:.1f}x",
    "batching_latency_ratio": "{batching_single_p50_ms:.0f} vs {batching_single_p50_unbatched_ms:.0f} + "
                              "{batching_max_wait_ms:g} ms",
}


def raw_numbers(key: str, results: dict[str, Any]) -> str:
    try:
        return RAW[key].format_map(results)
    except (KeyError, ValueError, TypeError):
        return ""


def targets_of(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each targeted figure of the run: its label, target, value, whether it is met, and the
    figures it comes from. A figure of None (a window without an answer, a floor whose CPU
    read at zero or below) has no value and misses its target."""
    out = {}
    for key, (label, target, kind) in TARGETS.items():
        if key in results:
            value = results[key]
            met = value is not None and (value <= target if kind == "max" else value >= target)
            out[key] = {"label": label, "target": target, "value": value, "met": met, "raw": raw_numbers(key, results)}
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in TARGETS if results.get(k) is not None and "_ratio" in k]  # ratios only: one axis
    fig, ax = plt.subplots(figsize=(12, 6))
    values = [results[k] for k in keys]
    colors = [
        "tab:green" if (results[k] <= TARGETS[k][1] if TARGETS[k][2] == "max" else results[k] >= TARGETS[k][1]) else "tab:red"
        for k in keys
    ]
    ax.barh([TARGETS[k][0] for k in keys], values, color=colors)
    for i, k in enumerate(keys):
        ax.plot([TARGETS[k][1]] * 2, [i - 0.4, i + 0.4], color="black", linewidth=2)
        ax.text(values[i], i, f" {values[i]:.2f}x  ({raw_numbers(k, results)})", va="center", fontsize=8)
    ax.set_xlim(0, max(values + [t[1] for t in TARGETS.values()]) * 1.6)
    ax.set_xlabel("ratio to floor (black bar: target; green: met)")
    ax.set_title(f"hybridflow-serve benchmarks ({results['machine']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer samples and smaller tensors")
    parser.add_argument("--skip-http", action="store_true", help="library figures only")
    options = parser.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # A compiled graph's read gives up after 10 s by default; a loaded 2-core machine can
    # stall a round that long, which is noise to measure, not a failure.
    os.environ.setdefault("RAY_CGRAPH_get_timeout", "120")
    results: dict[str, Any] = {
        "quick": options.quick,
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}",
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    started = time.perf_counter()
    parts: dict[str, float] = {}

    def part(name: str, figures: Any) -> None:
        results.update(figures())
        parts[name] = time.perf_counter() - started - sum(parts.values())

    from bench.weight_sync import bench_weight_sync

    part("library", lambda: bench_library(options.quick))
    part("durable_call", lambda: bench_durable_call(options.quick))
    part("weight_sync", lambda: bench_weight_sync(options.quick))
    if not options.skip_http:
        part("http", lambda: bench_http(options.quick, results))
    results["bench_seconds"] = time.perf_counter() - started
    results["bench_part_seconds"] = parts
    targets = targets_of(results)
    if targets:
        results["targets"] = targets
    (RESULTS / "latest.json").write_text(json.dumps(results, indent=2))
    plot(results, RESULTS / "latest.png")
    write_benchmarks_page(results, ROOT / "docs" / "benchmarks.md")  # the page is generated, not edited
    for key, entry in results.get("targets", {}).items():
        value = "n/a" if entry["value"] is None else f"{entry['value']:8.3f}"
        print(f"{entry['label']:50s} {value:>8s}  target {'<=' if TARGETS[key][2] == 'max' else '>='} "
              f"{entry['target']}  {'met' if entry['met'] else 'MISSED'}  ({entry['raw']})")
    print(json.dumps({k: v for k, v in results.items() if k not in ("targets", "served_runs")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

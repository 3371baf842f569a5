"""CPU milliseconds an HTTP call costs, process by process: the 4-rank accumulator's
``add`` against the no-op route, on one ``serve run`` of both (``bench.hops``' config).

    python -m bench.call_cpu [--seconds 10] [--clients 8]   (writes bench/results/call_cpu.json)

Each process's CPU seconds are read from /proc at the start and end of a window of calls at
a fixed concurrency (``bench.load_generator``: its own CPU is not among them), and divided
by the number of calls. On a machine whose cores are the limit,
requests/s is cores over the total, and the rows say which process spends it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.cold_start import _processes
from bench.hops import small_config
from bench.load_generator import Load, run_load
from tests.serve_process import ROOT, ServeProcess

CALLS = {
    "noop": ("/noop/call", {"kwargs": {"x": 1}}),
    "add": ("/v1/groups/gpu_accumulator/add", {"kwargs": {"x": [1, 1, 1, 1]}}),
}


def cpu_by_title(session: int) -> dict[str, float]:
    """CPU seconds so far of the session's processes, summed by title."""
    totals: dict[str, float] = defaultdict(float)
    for _, title, cpu in _processes(session).values():
        totals[title] += cpu
    return totals


def measure(proc: ServeProcess, path: str, body: dict, clients: int, seconds: float) -> dict[str, Any]:
    session = proc.proc.pid
    readings: list[dict[str, float]] = []
    load = Load.of_json(proc.url, path, body, concurrency=clients, warmup_s=seconds / 5, window_s=seconds)
    result = run_load(load, lambda: readings.append(cpu_by_title(session)), lambda: readings.append(cpu_by_title(session)))
    before, after = readings
    calls = max(result.requests, 1)
    per_call = {
        title: (cpu - before.get(title, 0.0)) / calls * 1e3
        for title, cpu in after.items()
        if cpu - before.get(title, 0.0) > 0
    }
    rows = dict(sorted(per_call.items(), key=lambda item: -item[1]))
    return {
        "calls": result.requests,
        "calls_per_s": result.rps,
        "cpu_ms_per_call": sum(rows.values()),
        "cpu_ms_per_call_by_process": {title: round(ms, 3) for title, ms in rows.items() if ms >= 0.05},
        "load_generator_cpu_ms_per_call": result.client_cpu_total_s / calls * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    options = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    directory = Path(tempfile.mkdtemp(dir=ROOT))
    proc = ServeProcess(config=small_config(directory))
    try:
        proc.start(timeout_s=600)
        out = {name: measure(proc, path, body, options.clients, options.seconds) for name, (path, body) in CALLS.items()}
    finally:
        proc.kill()
        shutil.rmtree(directory, ignore_errors=True)
    text = json.dumps(out, indent=1)
    (ROOT / "bench" / "results" / "call_cpu.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

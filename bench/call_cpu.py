"""CPU milliseconds an HTTP call costs, process by process: the 4-rank accumulator's
``add`` against the no-op route, on one ``serve run`` of both (``bench.hops``' config).

    python -m bench.call_cpu [--calls 600] [--clients 8]   (writes bench/results/call_cpu.json)

Each process's CPU seconds are read from /proc before and after a run of calls at a fixed
concurrency, and divided by the number of calls. On a machine whose cores are the limit,
requests/s is cores over the total, and the rows say which process spends it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx

from bench.cold_start import _processes
from bench.hops import small_config
from clients.local_server import ROOT, ServeProcess

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


async def post_many(url: str, path: str, body: dict, clients: int, calls: int) -> None:
    left = calls
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:

        async def client() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                (await http.post(path, json=body)).raise_for_status()

        await asyncio.gather(*(client() for _ in range(clients)))


def measure(proc: ServeProcess, path: str, body: dict, clients: int, calls: int) -> dict[str, Any]:
    session = proc.proc.pid
    asyncio.run(post_many(proc.url, path, body, clients, calls // 6))  # warm up
    before = cpu_by_title(session)
    start = time.perf_counter()
    asyncio.run(post_many(proc.url, path, body, clients, calls))
    wall = time.perf_counter() - start
    after = cpu_by_title(session)
    per_call = {
        title: (cpu - before.get(title, 0.0)) / calls * 1e3
        for title, cpu in after.items()
        if cpu - before.get(title, 0.0) > 0
    }
    rows = dict(sorted(per_call.items(), key=lambda item: -item[1]))
    return {
        "calls_per_s": calls / wall,
        "cpu_ms_per_call": sum(rows.values()),
        "cpu_ms_per_call_by_process": {title: round(ms, 3) for title, ms in rows.items() if ms >= 0.05},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=600)
    parser.add_argument("--clients", type=int, default=8)
    options = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    directory = Path(tempfile.mkdtemp(dir=ROOT))
    proc = ServeProcess(config=small_config(directory))
    try:
        proc.start(timeout_s=600)
        out = {name: measure(proc, path, body, options.clients, options.calls) for name, (path, body) in CALLS.items()}
    finally:
        proc.stop()
        shutil.rmtree(directory, ignore_errors=True)
    text = json.dumps(out, indent=1)
    (ROOT / "bench" / "results" / "call_cpu.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

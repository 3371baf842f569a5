"""What a cold start of ``serve run`` spends: wall time, and the CPU seconds of every
process it started (sampled from /proc while it comes up), by kind of process.

    python -m bench.cold_start [--config serve_config.yaml] [--env K=V ...]

On a machine whose cores are the limit, CPU seconds over cores is the floor of the
wall time, and the kinds say where the CPU goes (Ray's own processes, Serve's, the
controller replicas, the group workers).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from tests.serve_process import CONFIG, ServeProcess

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(stat: str) -> float:
    """User plus system CPU seconds of a process, from the text of its ``/proc/<pid>/stat``
    (the fields after the parenthesised name, which may itself hold spaces)."""
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def _processes(session: int) -> dict[int, tuple[str, str, float]]:
    """``{pid: (kind, title, cpu seconds)}`` of the processes in the session ``session``."""
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
        cpu = cpu_seconds(stat)
        cmdline = cmdline.strip()
        found[pid] = (kind_of(cmdline), cmdline.split()[0] if cmdline.startswith("ray::") else cmdline[:60], cpu)
    return found


def kind_of(cmdline: str) -> str:
    """A process by what it is (Ray titles a worker ``ray::<actor or task>``)."""
    if not cmdline.startswith("ray::"):
        return "starting Ray workers" if "default_worker.py" in cmdline else "ray system and serve run"
    title = cmdline.split()[0]
    if "ServeController" in title or "ProxyActor" in title or "ServeReplica:noop" in title:
        return "serve (controller, proxy)"
    if "ServeReplica" in title:
        return "controller and ingress replicas"
    if title == "ray::IDLE":
        return "idle Ray workers"
    return "group workers and tasks"


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
            for pid, (kind, title, cpu) in now.items():
                previous = self.last.get(pid)
                # a process's title changes when it becomes an actor: keep the latest kind
                self.last[pid] = (kind, title, max(cpu, previous[2] if previous else 0.0))
            self.peak_processes = max(self.peak_processes, len(now))
            self._stop.wait(self.period_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def cpu_by(self, index: int) -> dict[str, float]:
        """CPU seconds by kind (``index`` 0) or by title (1), largest first."""
        totals: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        for entry in self.last.values():
            totals[entry[index]] += entry[2]
            counts[entry[index]] += 1
        return {f"{key} (x{counts[key]})": round(value, 2)
                for key, value in sorted(totals.items(), key=lambda item: -item[1])}


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far (every session's work)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / TICKS, sum(fields) / TICKS


def profile(config: Path, env: dict[str, str], ready_path: str = "/readyz") -> dict[str, Any]:
    # ServeProcess removes a config other than the repository's when it stops: give it a copy
    copy = Path(tempfile.mkstemp(suffix=".yaml", dir=config.parent)[1])
    copy.write_text(config.read_text())
    proc = ServeProcess(config=copy, env=env)
    busy0, total0 = machine_busy()
    start = time.perf_counter()
    proc_started = threading.Event()
    result: dict[str, Any] = {}

    def starter() -> None:
        try:
            proc.start(timeout_s=900, ready_path=ready_path)
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            proc_started.set()

    thread = threading.Thread(target=starter, daemon=True)
    thread.start()
    while proc.proc is None:
        time.sleep(0.01)
    try:
        with Sampler(proc.proc.pid) as sampler:
            proc_started.wait()
            wall = time.perf_counter() - start
        busy1, total1 = machine_busy()
        cpu = sampler.cpu_by(0)
        result.update({
            "wall_s": wall,
            "cpu_s": sum(cpu.values()),
            "cpu_s_by_kind": cpu,
            "cpu_s_by_title": sampler.cpu_by(1),
            "processes": len(sampler.last),
            "peak_processes": sampler.peak_processes,
            # the share of the machine this start got, and how busy the machine was overall
            "cores_used": sum(cpu.values()) / wall,
            "machine_busy_fraction": (busy1 - busy0) / max(total1 - total0, 1e-9),
        })
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

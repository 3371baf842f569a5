"""CPU milliseconds per request of a target under load, read from /proc: the whole
machine's, and each process's by its role on the path (``bench.cold_start.role_of``).

A target is one or more sessions of processes (a ``serve run`` and the Ray cluster it
started, or a floor app and its own Ray). Before the load, the target is read idle for a
while: the machine's busy rate and each process's rate. Then a window of load
(``bench.load_generator``) is read at its start and end. Per request:

- the whole machine: its busy CPU over the window, less the load generator's own CPU
  (its client processes report it) and less the idle rate over the window;
- each role: its processes' CPU over the window less their idle rate.

So a target's idle processes (a compiled graph's polling actor, Serve's controller loop)
count for neither side, and moving work from one process into another does not hide it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from bench.cold_start import command_lines, role_of, title_of
from bench.load_generator import Load, LoadResult, run_load
from bench.machine_cpu import machine_cpu


@dataclass(frozen=True)
class Reading:
    """The CPU seconds so far of the machine and of each of the target's processes."""

    at: float
    machine_busy_s: float
    #: ``{pid: (role, title, cpu seconds)}``
    processes: Mapping[int, tuple[str, str, float]]


def read(sessions: Iterable[int], rank_classes: tuple[str, ...] = ()) -> Reading:
    processes = {}
    for session in sessions:
        for pid, (cmdline, cpu) in command_lines(session).items():
            if cmdline:  # an exiting process reads empty: its last reading stands
                processes[pid] = (role_of(cmdline, rank_classes), title_of(cmdline), cpu)
    busy, _ = machine_cpu()
    return Reading(time.perf_counter(), busy, processes)


def spent(before: Reading, after: Reading) -> dict[int, tuple[str, str, float]]:
    """Each process's CPU seconds between two readings (a process that started in between
    counts from zero); its role and title as last read."""
    out = {}
    for pid, (role, title, cpu) in after.processes.items():
        earlier = before.processes.get(pid)
        out[pid] = (role, title, max(0.0, cpu - (earlier[2] if earlier else 0.0)))
    return out


def by_key(spending: Mapping[int, tuple[str, str, float]], index: int) -> dict[str, float]:
    """CPU seconds summed by role (``index`` 0) or by title (1)."""
    totals: dict[str, float] = defaultdict(float)
    for entry in spending.values():
        totals[entry[index]] += entry[2]
    return dict(totals)


@dataclass(frozen=True)
class IdleRate:
    """CPU seconds per second of the target at rest: the machine's and by role and title."""

    machine: float
    roles: Mapping[str, float]
    titles: Mapping[str, float]


def idle_rate(before: Reading, after: Reading) -> IdleRate:
    seconds = max(after.at - before.at, 1e-9)
    spending = spent(before, after)
    return IdleRate(
        (after.machine_busy_s - before.machine_busy_s) / seconds,
        {k: v / seconds for k, v in by_key(spending, 0).items()},
        {k: v / seconds for k, v in by_key(spending, 1).items()},
    )


def per_request(before: Reading, after: Reading, idle: IdleRate, requests: int,
                generator_cpu_s: float) -> dict[str, Any]:
    """CPU ms per request between two readings: the machine's (the load generator's CPU and
    the idle rate taken out), the target's processes' by role and by title (idle taken out),
    and their sum."""
    seconds = after.at - before.at
    n = max(requests, 1)
    spending = spent(before, after)

    def less_idle(totals: Mapping[str, float], rates: Mapping[str, float]) -> dict[str, float]:
        return {k: (v - rates.get(k, 0.0) * seconds) / n * 1e3 for k, v in totals.items()}

    roles = less_idle(by_key(spending, 0), idle.roles)
    titles = less_idle(by_key(spending, 1), idle.titles)
    machine = (after.machine_busy_s - before.machine_busy_s - generator_cpu_s - idle.machine * seconds) / n * 1e3
    return {
        "machine_ms": machine,
        "processes_ms": sum(roles.values()),
        "roles_ms": dict(sorted(roles.items(), key=lambda item: -item[1])),
        "titles_ms": {k: v for k, v in sorted(titles.items(), key=lambda item: -item[1]) if abs(v) >= 0.05},
        "generator_ms": generator_cpu_s / n * 1e3,
        # what the idle rate took out: a process that polls while idle (a compiled graph's)
        # may poll less under load, and its figure then reads below zero
        "idle_machine_cores": idle.machine,
        "idle_roles_cores": {k: v for k, v in idle.roles.items() if v >= 0.005},
    }


class TargetCpu:
    """A target's CPU under load: its idle rate read once (:meth:`measure_idle`), then each
    load window read at its start and end (:meth:`run`)."""

    def __init__(self, sessions: Iterable[int], rank_classes: tuple[str, ...] = ()) -> None:
        self.sessions = tuple(sessions)
        self.rank_classes = rank_classes
        self.idle: IdleRate | None = None

    def read(self) -> Reading:
        return read(self.sessions, self.rank_classes)

    def measure_idle(self, seconds: float) -> IdleRate:
        before = self.read()
        time.sleep(seconds)
        self.idle = idle_rate(before, self.read())
        return self.idle

    def run(self, load: Load) -> tuple[LoadResult, dict[str, Any]]:
        """``load`` with the window's CPU per request (needs :meth:`measure_idle` first)."""
        if self.idle is None:
            raise RuntimeError("measure_idle() before run()")
        readings: list[Reading] = []
        result = run_load(load, lambda: readings.append(self.read()), lambda: readings.append(self.read()))
        return result, per_request(readings[0], readings[1], self.idle, result.requests, result.client_cpu_total_s)

"""The whole machine's CPU seconds so far, from the ``cpu`` line of ``/proc/stat``: what the
bench's CPU figures and ``make test``'s stage report are read from. Standard library only,
so the suite's runner can read it without loading the service."""

from __future__ import annotations

import os


def busy_and_total(stat_line: str, ticks_per_second: int) -> tuple[float, float]:
    """(busy, total) CPU seconds in ``stat_line`` (``cpu  user nice system idle iowait irq
    softirq steal guest guest_nice``): busy is every field of the first eight but idle and
    iowait; guest and guest_nice are left out, as user and nice hold them already."""
    fields = [int(field) for field in stat_line.split()[1:9]]
    if len(fields) < 5:
        raise ValueError(f"not a /proc/stat cpu line: {stat_line!r}")
    total = sum(fields)
    return (total - fields[3] - fields[4]) / ticks_per_second, total / ticks_per_second


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot (every process's work);
    OSError where there is no ``/proc/stat``."""
    with open("/proc/stat") as stat:
        return busy_and_total(stat.readline(), os.sysconf("SC_CLK_TCK"))

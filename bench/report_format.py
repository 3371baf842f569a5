"""How the benchmarks page writes a figure: its unit read from its key, numbers to three
significant figures, and Markdown tables (``bench.report`` and ``bench.report_floors``).
Standard library only."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

#: Units read from a key's ending.
UNITS = (("_ms", "ms"), ("_s", "s"), ("_MBps", "MB/s"), ("_cores", "cores"), ("_ratio", "x"),
         ("_over_thread", "x"), ("_over_http", "x"), ("_ratio_to_raw", "x"), ("_bound", "x"), ("_mib", "MiB"))


#: Endings that name what a figure was measured on rather than its unit: a request path,
#: a count of clients.
QUALIFIERS = (re.compile(r"_(haproxy|serve_proxy)$"), re.compile(r"_\d+$"))
#: A served figure over a floor's (``bench.floor_runs.figures``).
AGAINST_FLOOR = re.compile(r"_vs_(plain|compiled)(_haproxy|_serve_proxy)?$")


def unit_of(key: str) -> str:
    """A figure's unit, from its key's ending (a path or a client count after it left out):
    ``x`` for a ratio, also one named ``<figure>_vs_<floor>``."""
    if AGAINST_FLOOR.search(key):
        return "x"
    for qualifier in QUALIFIERS:
        key = qualifier.sub("", key)
    for ending, unit in UNITS:
        if key.endswith(ending):
            return unit
    return ""


def number(value: float) -> str:
    """Three significant figures at most, no exponent for everyday sizes."""
    if value == 0 or not math.isfinite(value):
        return str(value)
    size = abs(value)
    if size >= 100:
        return f"{value:,.0f}"
    if size >= 10:
        return f"{value:.1f}"
    if size >= 1:
        return f"{value:.2f}"
    if size >= 0.01:
        return f"{value:.3f}"
    return f"{value:.2e}"


def show(key: str, value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        unit = unit_of(key)
        text = str(value) if isinstance(value, int) else number(value)
        return f"{text}{unit}" if unit == "x" else f"{text} {unit}".rstrip()
    if isinstance(value, list):
        return "[" + ", ".join(show("", v) for v in value) + "]"
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> list[str]:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines

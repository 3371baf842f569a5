"""The machine's CPU seconds that make test's stage report and the bench read from
/proc/stat (bench/machine_cpu.py)."""

from __future__ import annotations

import pytest

from bench.machine_cpu import busy_and_total
from tests.run_suite import machine_busy_seconds


def test_busy_counts_every_field_but_idle_and_iowait_and_the_guests_once():
    # user nice system idle iowait irq softirq steal guest guest_nice
    line = "cpu  300 20 100 5000 80 5 15 10 7 3"
    busy, total = busy_and_total(line, 100)
    assert busy == pytest.approx((300 + 20 + 100 + 5 + 15 + 10) / 100)
    assert total == pytest.approx((300 + 20 + 100 + 5000 + 80 + 5 + 15 + 10) / 100)


def test_a_line_that_is_not_a_cpu_line_is_refused():
    with pytest.raises(ValueError, match="not a /proc/stat cpu line"):
        busy_and_total("intr 12 3", 100)


def test_the_machine_is_busier_after_work_than_before():
    before = machine_busy_seconds()
    if before is None:
        pytest.skip("no /proc/stat here")
    total = 0
    for i in range(3_000_000):  # about 0.1-0.3 CPU-s, in this process
        total += i
    after = machine_busy_seconds()
    assert after - before >= 0.05, (before, after, total)

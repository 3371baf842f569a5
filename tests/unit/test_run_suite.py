"""make test's report of each stage's CPU: the busy seconds read from /proc/stat."""

from __future__ import annotations

import pytest

from tests.run_suite import busy_seconds, machine_busy_seconds


def test_busy_seconds_count_every_field_but_idle_and_iowait():
    # user nice system idle iowait irq softirq steal guest guest_nice
    line = "cpu  300 20 100 5000 80 5 15 10 0 0"
    assert busy_seconds(line, 100) == pytest.approx((300 + 20 + 100 + 5 + 15 + 10) / 100)


def test_the_machine_is_busier_after_work_than_before():
    before = machine_busy_seconds()
    if before is None:
        pytest.skip("no /proc/stat here")
    total = 0
    for i in range(3_000_000):  # about 0.1-0.3 CPU-s, in this process
        total += i
    after = machine_busy_seconds()
    assert after - before >= 0.05, (before, after, total)

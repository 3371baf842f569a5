"""make test's runner (tests/run_suite.py): the failures it repeats at the end, and the
machine's CPU seconds that its stage report and the bench read from /proc/stat
(bench/machine_cpu.py)."""

from __future__ import annotations

import pytest

from bench.machine_cpu import busy_and_total
from tests.run_suite import Run, _run_chain, failures_in, machine_busy_seconds


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


def test_a_chain_keeps_the_names_of_the_tests_that_failed_and_goes_on_after_a_failed_run(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "def test_passes():\n    assert True\n\n"
        "def test_fails():\n    assert 1 == 2, 'one is not two'\n"
    )
    failing, passing = Run("first", ["test_sample.py"], cwd=tmp_path), Run("second", ["test_sample.py", "-k", "passes"], cwd=tmp_path)
    log = tmp_path / "chain.log"
    _run_chain([failing, passing], [], log)
    assert failing.status == 1 and not failing.passed
    assert failing.failures == ["FAILED test_sample::test_fails - AssertionError: one is not two"]
    assert passing.passed and passing.failures == []
    assert "1 failed, 1 passed" in log.read_text()


def test_a_setup_error_is_named_and_a_missing_report_names_nothing(tmp_path):
    (tmp_path / "test_setup.py").write_text(
        "import pytest\n\n@pytest.fixture\ndef broken():\n    raise RuntimeError('no fixture today')\n\n"
        "def test_needs_it(broken):\n    pass\n"
    )
    erring = Run("erring", ["test_setup.py"], cwd=tmp_path)
    _run_chain([erring], [], tmp_path / "chain.log")
    assert erring.failures == ["ERROR test_setup::test_needs_it - failed on setup with \"RuntimeError: no fixture today\""]
    assert failures_in(tmp_path / "absent.xml") == []

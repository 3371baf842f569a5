"""``make test``'s layers: which pytest runs go side by side, in what order, and how long
each took (printed at the end).

    python -m tests.run_suite [pytest arguments for every run]

Two stages, each a set of chains that run side by side; a chain's runs go one after
another. Beside the Ray layer's cluster: the end-to-end tests that start clusters of
their own (restarts, and the small service), the client distribution's own tests and the
Ray tests with a cluster of their own (the multi-node check); then the end-to-end tests on
the session's ``serve run`` (the shipped service and the applications that share its
cluster), and beside them the unit layer (no Ray) and the Ray layer's Megatron and weight
sync modules, on a cluster of their own. Every run goes even if another failed; the
output of a run beside another is printed after it; exit status 5 (no test selected, as
with a ``-k``) fails no run. At the end: each layer's time and the tests that failed in it,
and each stage's time with the machine's CPU seconds in it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from xml.etree import ElementTree

from bench.machine_cpu import machine_cpu

ROOT = Path(__file__).resolve().parent.parent
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
#: pytest's "no tests collected": a selection that leaves a run empty is no failure.
NO_TESTS = 5


@dataclass
class Run:
    name: str
    args: list[str]
    cwd: Path = ROOT
    seconds: float = 0.0
    status: int | None = None
    #: The tests that failed or erred (``failures_in``), repeated at the end of the suite:
    #: a log cut to its tail still names them.
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.status in (0, NO_TESTS)


#: The Ray layer's modules that run in the second stage, on a cluster of their own (the
#: Megatron groups and weight syncs): the first stage waits on the Ray layer, the second
#: has cores to spare.
RAY_SECOND_STAGE = ("tests/ray/test_megatron_group.py", "tests/ray/test_served_weight_sync.py",
                    "tests/ray/test_weight_sync.py")

STAGES: list[list[list[Run]]] = [
    [
        [Run("ray", ["tests/ray", "-m", "not own_cluster", *(f"--ignore={m}" for m in RAY_SECOND_STAGE)])],
        # The Ray layer alone keeps the two cores busy about 80% of the time (it waits on
        # actors starting): the tests that start small clusters of their own fill its waits.
        [Run("e2e, own clusters", ["tests/e2e", "-m", "own_cluster"]),
         Run("client", ["tests"], cwd=ROOT / "hybridflow-client"),
         Run("ray, own cluster", ["tests/ray", "-m", "own_cluster"])],
    ],
    [
        [Run("e2e, shared cluster", ["tests/e2e", "-m", "not own_cluster"])],
        # The session's service alone keeps the cores busy about 70% of the time (it waits
        # on its groups: rebuilds, health-check periods, timeouts): the unit layer, which
        # starts no cluster, and the rest of the Ray layer fill those waits.
        [Run("unit", ["tests/unit"]),
         Run("ray, Megatron and weights", [*RAY_SECOND_STAGE, "-m", "not own_cluster"])],
    ],
]


def machine_busy_seconds() -> float | None:
    """The machine's busy CPU seconds since boot (None where there is no ``/proc/stat``)."""
    try:
        return machine_cpu()[0]
    except (OSError, ValueError):
        return None


def failures_in(report: Path) -> list[str]:
    """``FAILED <test> - <message>`` (``ERROR`` for a setup or teardown) for each test that
    did not pass, from a pytest JUnit XML report (none where there is no report)."""
    try:
        suites = ElementTree.parse(report).getroot()
    except (OSError, ElementTree.ParseError):
        return []
    found = []
    for case in suites.iter("testcase"):
        for outcome, word in (("failure", "FAILED"), ("error", "ERROR")):
            for element in case.findall(outcome):
                first_line = next(iter((element.get("message") or "").splitlines()), "")
                found.append(f"{word} {case.get('classname')}::{case.get('name')}" + (f" - {first_line}" if first_line else ""))
    return found


def _run_chain(runs: list[Run], extra: list[str], log: Path | None) -> None:
    """The chain's pytest runs one after another, their output to ``log`` (None: to this
    terminal), each run's failed tests kept on it (read from a JUnit report afterwards, so
    nothing waits on the output of a process a test left behind)."""
    out = None if log is None else open(log, "w")  # noqa: SIM115 - closed with the process
    for run in runs:
        report = Path(tempfile.mkstemp(prefix="suite-", suffix=".xml")[1])
        started = time.monotonic()
        done = subprocess.run([*PYTEST, *run.args, *extra, f"--junitxml={report}"], cwd=run.cwd, stdout=out,
                              stderr=subprocess.STDOUT)
        run.status, run.seconds = done.returncode, time.monotonic() - started
        run.failures = failures_in(report)
        report.unlink(missing_ok=True)


def stage(chains: list[list[Run]], extra: list[str]) -> None:
    """The chains side by side: the first in this terminal, the others logged and printed
    after it."""
    logs = [None] + [Path(tempfile.mkstemp(prefix="suite-", suffix=".log")[1]) for _ in chains[1:]]
    threads = [threading.Thread(target=_run_chain, args=(runs, extra, log)) for runs, log in zip(chains, logs, strict=True)]
    for thread in threads[1:]:
        thread.start()
    threads[0].run()
    for thread, runs, log in zip(threads[1:], chains[1:], logs[1:], strict=True):
        thread.join()
        print(f"--- {', then '.join(run.name for run in runs)}:", flush=True)
        print(log.read_text(errors="replace"), flush=True)
        log.unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    started = time.monotonic()
    # Each stage's CPU, the whole machine's (the stages run alone on it): the suite is bound
    # by its CPU work where the busy share is near 100%, and a slower machine shows here.
    stage_use: list[tuple[float, float | None]] = []
    for chains in STAGES:
        began, busy = time.monotonic(), machine_busy_seconds()
        stage(chains, argv)
        after = machine_busy_seconds()
        stage_use.append((time.monotonic() - began, None if busy is None or after is None else after - busy))
    runs = [run for chains in STAGES for chain in chains for run in chain]
    print("--- the suite's layers:")
    for run in runs:
        verdict = "passed" if run.passed else f"FAILED (exit {run.status})"
        print(f"{run.name:22s} {run.seconds:6.0f} s  {verdict}")
        for failure in run.failures:
            print(f"    {failure}")
    for number, (seconds, cpu) in enumerate(stage_use, start=1):
        used = "" if cpu is None else f"  {cpu:6.0f} CPU-s, {100 * cpu / seconds / (os.cpu_count() or 1):3.0f}% of {os.cpu_count()} cores"
        print(f"{f'stage {number}':22s} {seconds:6.0f} s{used}")
    print(f"{'total':22s} {time.monotonic() - started:6.0f} s")
    return 0 if all(run.passed for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

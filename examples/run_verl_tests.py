"""Run verl's own single-controller tests against this library.

    flock /tmp/heavy.lock .venv/bin/python examples/run_verl_tests.py /path/to/verl-checkout

Takes a verl checkout (v0.4.1's ``tests/single_controller``), copies its tests to a
temporary directory outside this project, rewrites their imports by the import table
below (nothing else in them changes), and runs them with this Python (the project's
venv) on a local Ray cluster with 8 logical GPUs: every ``ray.init()`` the tests make
without an address starts a fresh local cluster (never one another process runs) that
declares ``num_gpus=8`` unless the test says otherwise. Tests that need CUDA hardware
are listed and not run; ``test_worker_group_basics`` runs up to its CUDA step, and
``check_worker_alive/main.py`` must end with the driver aborted by SIGABRT.

Prints one line per test file and a result line; exits 0 when every outcome is the
expected one. verl's code is never copied into this project.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

#: verl's import paths and this project's, applied in order (the issue's table).
IMPORT_TABLE: list[tuple[str, str]] = [
    (r"\bfrom verl import DataProto\b", "from single_controller import DataProto"),
    (r"\bfrom verl\.utils\.ray_utils import parallel_put\b", "from single_controller.ray.transfer import parallel_put"),
    (r"\bverl\.protocol\b", "single_controller.protocol"),
    (r"\bverl\.single_controller\b", "single_controller"),
]

#: Test files under tests/single_controller that must pass (pytest, every test).
MUST_PASS = [
    "test_decorator_on_cpu.py",
    "test_high_level_scheduling_api.py",
    "test_colocated_workers.py",
    "test_colocated_workers_fused.py",
    "test_fused_workers_on_cpu.py",
    "test_ray_local_envs_on_cpu.py",
    "test_auto_padding_on_cpu.py",
    "test_data_transfer.py",
    "test_driverfunc_to_worker.py",
    "test_ray_utils_on_cpu.py",
    "base/test_decorator.py",
]
#: Runs until it moves a tensor to CUDA; everything before that step must pass.
UP_TO_CUDA = "test_worker_group_basics.py"
#: A script whose driver must be killed by SIGABRT when its worker exits.
ABORTS = "check_worker_alive/main.py"
#: Not run here, and why.
NOT_RUN = {
    "test_worker_group_torch.py": "needs CUDA GPUs (torch.distributed on cuda tensors)",
    "test_ray_collectives.py": "needs CUDA GPUs (NCCL collectives through ray.util.collective)",
    "test_rvdz.py": "needs CUDA GPUs and verl.utils.rendezvous (outside the import table)",
    "detached_worker/": "needs CUDA GPUs and verl's models and Megatron utilities (outside the import table)",
}
LOCAL_CLUSTER_GPUS = 8
#: Modules verl's tests import beyond this project, and where to get them.
EXTRA_MODULES = {"codetiming": "pip install -e '.[verl-tests]'"}

#: Loaded into every test process (a pytest plugin, or before the script runs).
LOCAL_CLUSTER_PLUGIN = f'''"""ray.init() without an address: a fresh local cluster with {LOCAL_CLUSTER_GPUS} logical GPUs."""
import os

import ray

_ray_init = ray.init


def _init_local(address=None, **kwargs):
    if address is None and not os.environ.get("RAY_ADDRESS"):
        address = "local"  # never attach to a cluster another process started
        kwargs.setdefault("num_gpus", {LOCAL_CLUSTER_GPUS})
        kwargs.setdefault("include_dashboard", False)
    return _ray_init(address, **kwargs)


ray.init = _init_local
'''


@dataclass
class Outcome:
    name: str
    ok: bool
    detail: str
    seconds: float


def rewrite(source: str) -> str:
    for pattern, replacement in IMPORT_TABLE:
        source = re.sub(pattern, replacement, source)
    return source


def stage(checkout: Path, work: Path) -> Path:
    """Copy tests/single_controller to ``work`` with the imports rewritten; refuse a file
    that still imports verl (it needs something outside the table)."""
    src = checkout / "tests" / "single_controller"
    if not src.is_dir():
        raise SystemExit(f"{checkout} has no tests/single_controller: pass a verl checkout (v0.4.1)")
    dst = work / "tests" / "single_controller"
    shutil.copytree(src, dst)
    (work / "tests" / "__init__.py").write_text("")
    for path in dst.rglob("*.py"):
        text = rewrite(path.read_text())
        path.write_text(text)
    (work / "_local_ray_cluster.py").write_text(LOCAL_CLUSTER_PLUGIN)
    return dst


def leftover_verl_imports(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if re.match(r"\s*(from|import) verl\b", line)]


def run(cmd: list[str], cwd: Path, timeout_s: float, env: dict[str, str]) -> tuple[int, str, float]:
    """Run ``cmd`` in a session of its own (so a timeout ends it and what it started)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n[timed out after {timeout_s:g} s]"
    return proc.returncode, out, time.monotonic() - start


def pytest_cases(report: Path) -> list[tuple[str, str, str]]:
    """``(test name, outcome, message)`` per test case of a JUnit report."""
    if not report.exists():
        return []
    cases = []
    for case in ET.parse(report).iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, message = child.tag, (child.get("message") or "") + "\n" + (child.text or "")
        cases.append((case.get("name", "?"), outcome, message))
    return cases


def run_pytest_file(rel: str, work: Path, python: str, env: dict[str, str], timeout_s: float) -> Outcome:
    path = work / "tests" / "single_controller" / rel
    leftovers = leftover_verl_imports(path)
    if leftovers:
        return Outcome(rel, False, f"imports outside the table: {leftovers}", 0.0)
    report = work / f"report-{rel.replace('/', '_')}.xml"
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_local_ray_cluster",
           f"--junitxml={report}", str(path.relative_to(work))]
    code, out, seconds = run(cmd, work, timeout_s, env)
    (work / f"log-{rel.replace('/', '_')}.txt").write_text(out)  # kept with --keep
    cases = pytest_cases(report)
    if rel == UP_TO_CUDA:
        return judge_up_to_cuda(rel, cases, out, seconds)
    passed = [name for name, outcome, _ in cases if outcome == "passed"]
    if code == 0 and cases and len(passed) == len(cases):
        return Outcome(rel, True, f"{len(passed)} passed", seconds)
    failed = [f"{name}: {outcome}: {message.strip().splitlines()[0] if message.strip() else ''}"
              for name, outcome, message in cases if outcome != "passed"]
    return Outcome(rel, False, f"exit {code}; {failed or out[-2000:]}", seconds)


def judge_up_to_cuda(rel: str, cases: list[tuple[str, str, str]], out: str, seconds: float) -> Outcome:
    """Passes when the only failure is the test's CUDA step (``data.to("cuda")`` in
    ``add_one``, sent with ``execute_func_rank_zero``), its last step before shutdown."""
    if not cases:
        return Outcome(rel, False, f"no test ran: {out[-2000:]}", seconds)
    notes = []
    for name, outcome, message in cases:
        if outcome == "passed":
            notes.append(f"{name} passed")
        elif 'data.to("cuda")' in message and "CUDA" in message:
            lines = [re.sub(r"^E\s+", "", line.strip()) for line in message.splitlines()]
            reason = next((line for line in lines if "CUDA" in line and "Error" in line), "")
            notes.append(f"{name}: every step passed up to its CUDA step, which failed as expected ({reason})")
        else:
            return Outcome(rel, False, f"{name} failed before its CUDA step: {message.strip()[:2000]}", seconds)
    return Outcome(rel, True, "; ".join(notes), seconds)


def run_abort_script(work: Path, python: str, env: dict[str, str], wait_time: int) -> Outcome:
    """The script's worker exits after ``wait_time`` s; the driver, which would sleep
    another ``6 * wait_time`` s, must die of SIGABRT first."""
    path = work / "tests" / "single_controller" / ABORTS
    code = (
        "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); "
        "import _local_ray_cluster; sys.argv = [sys.argv[1]]; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    limit = 300 + 6 * wait_time
    rc, out, seconds = run([python, "-c", code, str(path)], work, limit, {**env, "WAIT_TIME": str(wait_time)})
    if rc == -signal.SIGABRT:
        started = "foo started" in out
        return Outcome(ABORTS, started, f"driver aborted by SIGABRT (exit {rc}) {seconds:.1f} s after start, "
                       f"with WAIT_TIME={wait_time} (it would otherwise sleep {6 * wait_time} s more)", seconds)
    return Outcome(ABORTS, False, f"driver was not aborted (exit {rc}): {out[-2000:]}", seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("verl_checkout", type=Path, help="a verl checkout (v0.4.1) holding tests/single_controller")
    parser.add_argument("--python", default=sys.executable, help="interpreter with this project installed")
    parser.add_argument("--only", nargs="*", help="run only these test files (relative to tests/single_controller)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per test file")
    parser.add_argument("--wait-time", type=int, default=3, help="WAIT_TIME for check_worker_alive/main.py")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args()

    checkout = args.verl_checkout.resolve()
    version_file = checkout / "verl" / "version" / "version"
    version = version_file.read_text().strip() if version_file.exists() else "unknown version"
    work = Path(tempfile.mkdtemp(prefix="verl-single-controller-tests-"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(work), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        stage(checkout, work)
        print(f"verl {version} tests/single_controller from {checkout}, imports rewritten by the table, in {work}")
        print(f"python {args.python}; each ray.init() starts a local cluster with {LOCAL_CLUSTER_GPUS} logical GPUs")
        for module, hint in EXTRA_MODULES.items():
            if subprocess.run([args.python, "-c", f"import {module}"], capture_output=True).returncode:
                print(f"note: {module} is missing ({hint}); the tests importing it will fail")
        print()
        wanted = args.only or [*MUST_PASS, UP_TO_CUDA, ABORTS]
        outcomes = []
        for rel in wanted:
            if rel == ABORTS:
                outcome = run_abort_script(work, args.python, env, args.wait_time)
            else:
                outcome = run_pytest_file(rel, work, args.python, env, args.timeout)
            outcomes.append(outcome)
            print(f"{'PASS' if outcome.ok else 'FAIL'}  {outcome.name:38s} {outcome.seconds:6.1f} s  {outcome.detail}",
                  flush=True)
        if not args.only:
            for rel, why in NOT_RUN.items():
                print(f"SKIP  {rel:38s}           not run: {why}")
        good = sum(o.ok for o in outcomes)
        print(f"\nRESULT: {good}/{len(outcomes)} as expected "
              f"({sum(o.seconds for o in outcomes):.0f} s of test runs)")
        return 0 if good == len(outcomes) else 1
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

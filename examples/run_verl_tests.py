"""Run verl's own single-controller tests against this library.

    flock /tmp/heavy.lock .venv/bin/python examples/run_verl_tests.py /path/to/verl --ref v0.7.0

Takes a verl git repository (a checkout, or the bare git directory a mirror holds) and a
ref: the ref's ``tests/single_controller`` is copied to a temporary directory outside this
project (without ``--ref``, the directory's files as they are: a plain source tree works
too), its imports are rewritten by the import table below (nothing else in the tests
changes), and the tests run with this Python (the project's venv) on a local Ray cluster
with 8 logical GPUs: every ``ray.init()`` the tests make without an address starts a
fresh local cluster (never one another process runs) that declares ``num_gpus=8`` unless
the test says otherwise; a cluster start that times out (Ray gives it a fixed 30 s) is
tried again, and the file's line says so.

What each file must do depends on the ref (``PROFILES``): the files that need no CUDA
hardware must pass, every test in them; a file whose tests need CUDA at that ref is
listed and not run; ``test_worker_group_basics`` runs up to its CUDA step where it has
one; ``check_worker_alive/main.py`` must end with the driver aborted by SIGABRT.

Prints one line per test file and a result line; exits 0 when every outcome is the
expected one. verl's code is never copied into this project.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

#: verl's import paths and this project's, applied in order.
IMPORT_TABLE: list[tuple[str, str]] = [
    (r"\bfrom verl import DataProto\b", "from single_controller import DataProto"),
    (r"\bfrom verl\.utils\.ray_utils import parallel_put\b", "from single_controller.ray.transfer import parallel_put"),
    (r"\bfrom verl\.utils import tensordict_utils\b", "from single_controller import tensordict_utils"),
    (r"\bverl\.utils\.tensordict_utils\b", "single_controller.tensordict_utils"),
    (r"\bverl\.utils\.device\b", "single_controller.device"),
    (r"\bverl\.protocol\b", "single_controller.protocol"),
    (r"\bverl\.single_controller\b", "single_controller"),
]

#: The script whose driver must be killed by SIGABRT when its worker exits.
ABORTS = "check_worker_alive/main.py"
#: Runs until it moves a tensor to CUDA where it does; every step before must pass.
BASICS = "test_worker_group_basics.py"

#: Files of v0.4.1 that need no CUDA hardware (every test in them must pass).
_V04_FILES = [
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
#: Added by v0.5 to v0.7 and needing no CUDA hardware.
_V07_FILES = ["test_get_set_dispatch_collect_cpu.py", "test_nested_worker.py"]
_ALWAYS_CUDA = {
    "test_ray_collectives.py": "needs CUDA GPUs (NCCL collectives through ray.util.collective)",
    "test_rvdz.py": "needs CUDA GPUs and verl.utils.rendezvous (outside the import table)",
    "detached_worker/": "needs CUDA GPUs and verl's models and Megatron utilities (outside the import table)",
}


@dataclass(frozen=True)
class Profile:
    """What a ref's tests must do here."""

    name: str
    commit: str
    version: str
    must_pass: list[str]
    #: Whether test_worker_group_basics moves a tensor to CUDA (then it runs up to that step).
    basics_needs_cuda: bool
    not_run: dict[str, str] = field(default_factory=dict)


PROFILES = [
    Profile(
        "v0.4.1", "8d9e350ea58c7ad4b50dd14d9dcb50577242c55f", "0.4.1", _V04_FILES, True,
        {"test_worker_group_torch.py": "needs CUDA GPUs (torch.distributed on cuda tensors)", **_ALWAYS_CUDA},
    ),
    Profile(
        "v0.7.0", "f9c855f7cf04d603c9546bc01776c74806a879c1", "0.7.0.dev", _V04_FILES + _V07_FILES, True,
        {
            "test_worker_group_torch.py": "needs CUDA GPUs at this ref (tensors made on 'cuda')",
            "test_device_mesh_register.py": "needs CUDA GPUs at this ref (nccl, a 'cuda' device mesh)",
            "test_split_resource_pool.py": "needs CUDA GPUs at this ref (tensors moved to 'cuda', nccl)",
            **_ALWAYS_CUDA,
        },
    ),
    Profile(
        "b178a3cd", "b178a3cd56f58b2d502255daba591e92833930a7", "0.8.0.dev",
        _V04_FILES + _V07_FILES + [
            "test_worker_group_torch.py", "test_device_mesh_register.py", "test_split_resource_pool.py", BASICS,
        ],
        False,
        dict(_ALWAYS_CUDA),
    ),
]

LOCAL_CLUSTER_GPUS = 8
#: Starts of a local cluster the plugin tries: Ray gives its raylet a fixed 30 s to
#: register, which a loaded machine can miss; a start that times out is tried again.
LOCAL_CLUSTER_STARTS = 3
#: The environment variable naming the file where the plugin notes each start tried again.
RESTART_LOG_ENV = "VERL_TESTS_CLUSTER_RESTARTS"
#: Modules verl's tests import beyond this project, and where to get them.
EXTRA_MODULES = {"codetiming": "pip install -e '.[verl-tests]'"}

#: Loaded into every test process (a pytest plugin, or before the script runs).
LOCAL_CLUSTER_PLUGIN = f'''"""ray.init() without an address: a fresh local cluster with {LOCAL_CLUSTER_GPUS} logical GPUs
(a start that times out, which a loaded machine can cause, is tried again and noted)."""
import os

import ray

_ray_init = ray.init


def _init_local(address=None, **kwargs):
    if address is not None or os.environ.get("RAY_ADDRESS"):
        return _ray_init(address, **kwargs)
    kwargs.setdefault("num_gpus", {LOCAL_CLUSTER_GPUS})
    kwargs.setdefault("include_dashboard", False)
    for attempt in range(1, {LOCAL_CLUSTER_STARTS} + 1):
        try:
            return _ray_init("local", **kwargs)  # never attach to a cluster another process started
        except Exception as exc:
            if attempt == {LOCAL_CLUSTER_STARTS} or "timed out during startup" not in str(exc):
                raise
            with open(os.environ["{RESTART_LOG_ENV}"], "a") as log:
                log.write("restart\\n")
            ray.shutdown()


ray.init = _init_local
'''


@dataclass
class Outcome:
    name: str
    ok: bool
    detail: str
    seconds: float
    passed: int = 0
    ran: int = 0


def rewrite(source: str) -> str:
    for pattern, replacement in IMPORT_TABLE:
        source = re.sub(pattern, replacement, source)
    return source


def git(repo: Path, *args: str) -> bytes:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True)
    if done.returncode:
        raise SystemExit(f"git {' '.join(args)} in {repo} failed: {done.stderr.decode().strip()}")
    return done.stdout


def resolve_commit(repo: Path, ref: str | None) -> str | None:
    """The commit ``ref`` names (HEAD without one), or None outside a git repository."""
    probe = subprocess.run(["git", "-C", str(repo), "rev-parse", "--git-dir"], capture_output=True)
    if probe.returncode:
        if ref is not None:
            raise SystemExit(f"{repo} is not a git repository: --ref needs one")
        return None
    return git(repo, "rev-parse", f"{ref or 'HEAD'}^{{commit}}").decode().strip()


def export_ref(repo: Path, ref: str, dest: Path) -> Path:
    """``tests/single_controller`` and ``verl/version`` of ``ref``, unpacked under ``dest``."""
    archive = git(repo, "archive", "--format=tar", ref, "tests/single_controller", "verl/version")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def choose_profile(commit: str | None, version: str, expect: str | None) -> tuple[Profile, str]:
    """The profile named by ``expect``, else the one of ``commit``, else of the version file."""
    by_name = {p.name: p for p in PROFILES}
    if expect is not None:
        if expect not in by_name:
            raise SystemExit(f"--expect takes one of {sorted(by_name)}, got {expect!r}")
        return by_name[expect], "as asked (--expect)"
    for profile in PROFILES:
        if commit == profile.commit:
            return profile, f"commit {commit[:12]}"
    for profile in PROFILES:
        if version == profile.version:
            return profile, f"version file {version!r}"
    raise SystemExit(
        f"no expectations for commit {commit} (version {version!r}); known refs: "
        + ", ".join(f"{p.name} ({p.commit[:12]})" for p in PROFILES)
        + "; pass --expect NAME to use one of them"
    )


def stage(source: Path, work: Path) -> Path:
    """Copy ``source``'s tests/single_controller to ``work`` with the imports rewritten."""
    src = source / "tests" / "single_controller"
    if not src.is_dir():
        raise SystemExit(f"{source} has no tests/single_controller: pass a verl repository")
    dst = work / "tests" / "single_controller"
    shutil.copytree(src, dst)
    (work / "tests" / "__init__.py").write_text("")
    for path in dst.rglob("*.py"):
        path.write_text(rewrite(path.read_text()))
    (work / "_local_ray_cluster.py").write_text(LOCAL_CLUSTER_PLUGIN)
    return dst


def leftover_verl_imports(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if re.match(r"\s*(from|import) verl\b", line)]


def list_test_files(tests: Path) -> list[str]:
    """Every test file and script directory of a staged tests/single_controller."""
    found = {
        str(p.relative_to(tests)) for p in tests.rglob("test_*.py")
    } | {f"{d.name}/" for d in tests.iterdir() if d.is_dir() and d.name != "base" and not d.name.startswith("_")}
    return sorted(found)


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
    try:  # what the run left behind (a cluster that failed to start), so the next file starts clean
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
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


def run_pytest_file(rel: str, work: Path, python: str, env: dict[str, str], timeout_s: float,
                    up_to_cuda: bool = False) -> Outcome:
    path = work / "tests" / "single_controller" / rel
    leftovers = leftover_verl_imports(path)
    if leftovers:
        return Outcome(rel, False, f"imports outside the table: {leftovers}", 0.0)
    report = work / f"report-{rel.replace('/', '_')}.xml"
    restarts = work / f"restarts-{rel.replace('/', '_')}.txt"
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_local_ray_cluster",
           f"--junitxml={report}", str(path.relative_to(work))]
    code, out, seconds = run(cmd, work, timeout_s, {**env, RESTART_LOG_ENV: str(restarts)})
    (work / f"log-{rel.replace('/', '_')}.txt").write_text(out)  # kept with --keep
    cases = pytest_cases(report)
    outcome = judge_up_to_cuda(rel, cases, out, seconds) if up_to_cuda else judge(rel, cases, code, out, seconds)
    return note_restarts(outcome, restarts)


def note_restarts(outcome: Outcome, log: Path) -> Outcome:
    """Say in the file's line how many local cluster starts timed out and were tried again."""
    count = len(log.read_text().split()) if log.exists() else 0
    if count:
        outcome.detail += f" ({count} local cluster start(s) timed out and were tried again)"
    return outcome


def judge(rel: str, cases: list[tuple[str, str, str]], code: int, out: str, seconds: float) -> Outcome:
    """Passes when every test case of the file passed."""
    passed = [name for name, outcome, _ in cases if outcome == "passed"]
    if code == 0 and cases and len(passed) == len(cases):
        return Outcome(rel, True, f"{len(passed)} passed", seconds, len(passed), len(cases))
    failed = [f"{name}: {outcome}: {message.strip().splitlines()[0] if message.strip() else ''}"
              for name, outcome, message in cases if outcome != "passed"]
    return Outcome(rel, False, f"exit {code}; {failed or out[-2000:]}", seconds, len(passed), len(cases))


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
            return Outcome(rel, False, f"{name} failed before its CUDA step: {message.strip()[:2000]}", seconds,
                           0, len(cases))
    return Outcome(rel, True, "; ".join(notes), seconds, len(cases), len(cases))


def run_abort_script(work: Path, python: str, env: dict[str, str], wait_time: int) -> Outcome:
    """The script's worker exits after ``wait_time`` s; the driver, which would sleep
    another ``6 * wait_time`` s, must die of SIGABRT first."""
    path = work / "tests" / "single_controller" / ABORTS
    code = (
        "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); "
        "import _local_ray_cluster; sys.argv = [sys.argv[1]]; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    limit = 300 + 6 * wait_time
    restarts = work / "restarts-check_worker_alive.txt"
    script_env = {**env, "WAIT_TIME": str(wait_time), RESTART_LOG_ENV: str(restarts)}
    rc, out, seconds = run([python, "-c", code, str(path)], work, limit, script_env)
    if rc == -signal.SIGABRT:
        started = "foo started" in out
        outcome = Outcome(ABORTS, started, f"driver aborted by SIGABRT (exit {rc}) {seconds:.1f} s after start, "
                          f"with WAIT_TIME={wait_time} (it would otherwise sleep {6 * wait_time} s more)", seconds,
                          int(started), 1)
    else:
        outcome = Outcome(ABORTS, False, f"driver was not aborted (exit {rc}): {out[-2000:]}", seconds, 0, 1)
    return note_restarts(outcome, restarts)


def plan(profile: Profile, staged: list[str]) -> tuple[list[str], list[str]]:
    """The files to run, in order, and the staged files the profile does not know."""
    wanted = [*profile.must_pass]
    if profile.basics_needs_cuda:
        wanted.append(BASICS)
    wanted.append(ABORTS)
    known = set(wanted) | set(profile.not_run) | {"check_worker_alive/"}
    unknown = [rel for rel in staged if rel not in known]
    return wanted, unknown


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("verl", type=Path, help="a verl git repository (checkout or bare), or a verl source tree")
    parser.add_argument("--ref", help="the tag, branch or commit whose tests to run (default: the files as they are)")
    parser.add_argument("--expect", help=f"use this ref's expectations ({', '.join(p.name for p in PROFILES)})")
    parser.add_argument("--python", default=sys.executable, help="interpreter with this project installed")
    parser.add_argument("--only", nargs="*", help="run only these test files (relative to tests/single_controller)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per test file")
    parser.add_argument("--wait-time", type=int, default=3, help="WAIT_TIME for check_worker_alive/main.py")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args()

    repo = args.verl.resolve()
    work = Path(tempfile.mkdtemp(prefix="verl-single-controller-tests-"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(work), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        commit = resolve_commit(repo, args.ref)
        source = export_ref(repo, args.ref, work / "src") if args.ref else repo
        version_file = source / "verl" / "version" / "version"
        version = version_file.read_text().strip() if version_file.exists() else "unknown"
        profile, why = choose_profile(commit, version, args.expect)
        tests = stage(source, work)
        where = f"{args.ref} = {commit}" if args.ref else (f"HEAD = {commit}" if commit else "no git")
        print(f"verl {version} ({where}) tests/single_controller from {repo}, imports rewritten by the table, in {work}")
        print(f"expectations of {profile.name} ({why}); python {args.python}; "
              f"each ray.init() starts a local cluster with {LOCAL_CLUSTER_GPUS} logical GPUs")
        for module, hint in EXTRA_MODULES.items():
            if subprocess.run([args.python, "-c", f"import {module}"], capture_output=True).returncode:
                print(f"note: {module} is missing ({hint}); the tests importing it will fail")
        print()
        wanted, unknown = plan(profile, list_test_files(tests))
        outcomes = [Outcome(rel, False, "not in this ref's expectations: say what it must do", 0.0)
                    for rel in unknown if not args.only]
        for rel in args.only or wanted:
            if rel == ABORTS:
                outcome = run_abort_script(work, args.python, env, args.wait_time)
            else:
                up_to_cuda = rel == BASICS and profile.basics_needs_cuda
                outcome = run_pytest_file(rel, work, args.python, env, args.timeout, up_to_cuda)
            outcomes.append(outcome)
            print(f"{'PASS' if outcome.ok else 'FAIL'}  {outcome.name:38s} {outcome.seconds:6.1f} s  {outcome.detail}",
                  flush=True)
        if not args.only:
            for rel, why_not in profile.not_run.items():
                print(f"SKIP  {rel:38s}           not run: {why_not}")
        good = sum(o.ok for o in outcomes)
        passed, ran = sum(o.passed for o in outcomes), sum(o.ran for o in outcomes)
        up_to = f" ({BASICS} up to its CUDA step)" if profile.basics_needs_cuda and not args.only else ""
        print(f"\nRESULT: {good}/{len(outcomes)} files as expected; {passed}/{ran} tests that need no CUDA "
              f"hardware passed{up_to} ({sum(o.seconds for o in outcomes):.0f} s of test runs)")
        return 0 if good == len(outcomes) else 1
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

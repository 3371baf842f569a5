"""`pip install ./hybridflow-client` into a fresh virtual environment holding nothing else:
nothing of the server's dependencies (torch included) comes with it, the console command
answers, and the client's own tests pass there against the running service."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serve_process import ROOT

SERVER_PACKAGES = {"ray", "fastapi", "megatron-core", "uvicorn", "tensordict", "omegaconf", "starlette", "torch",
                   "hybridflow-serve"}


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory):
    """A fresh venv with the client installed; the install runs in the background while
    the service (the next fixture) starts, and the test waits for both."""
    directory = tmp_path_factory.mktemp("client-install")
    source = directory / "source"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(ROOT / "hybridflow-client", source,
                    ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info", ".ruff_cache"))
    venv, python = directory / "venv", directory / "venv" / "bin" / "python"
    target = shlex.quote(str(source) + "[test]")
    uv = Path(sys.executable).parent / "uv"
    if uv.exists():  # make venv's installer (its cache holds the client's dependencies); pip seeded for pip list
        command = (f"{uv} venv -q --seed --python {shlex.quote(sys.executable)} {shlex.quote(str(venv))} && "
                   f"{uv} pip install -q --python {shlex.quote(str(python))} {target}")
    else:
        command = (f"{shlex.quote(sys.executable)} -m venv {shlex.quote(str(venv))} && "
                   f"{shlex.quote(str(python))} -m pip install --quiet --no-compile {target}")
    install = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield install, python, source
    if install.poll() is None:
        install.kill()


@pytest.mark.timeout(900)
def test_the_client_installs_alone_and_its_tests_pass_against_the_service(client_venv, service):
    install, python, source = client_venv
    output, _ = install.communicate(timeout=540)
    assert install.returncode == 0, output[-3000:]
    installed = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                               check=True).stdout.lower()
    names = {line.split("==")[0] for line in installed.splitlines()}
    assert {"hybridflow-client", "httpx", "numpy", "safetensors"} <= names
    assert not names & SERVER_PACKAGES
    usage = subprocess.run([str(python.parent / "hybridflow"), "--help"], capture_output=True, text=True, timeout=120)
    assert usage.returncode == 0 and "infer" in usage.stdout
    env = {**os.environ, "HYBRIDFLOW_URL": service.url}
    env.pop("HYBRIDFLOW_TOKEN", None)
    tests = subprocess.run([str(python), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(source / "tests")],
                           cwd=source, env=env, capture_output=True, text=True, timeout=600)
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    # the service tests ran (only the torch-mode variants skip, torch being absent)
    assert " passed" in tests.stdout and "HYBRIDFLOW_URL is not set" not in tests.stdout, tests.stdout[-2000:]

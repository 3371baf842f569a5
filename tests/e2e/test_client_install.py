"""`pip install '.[client]'` into a fresh virtual environment: the client and CLI import
and run there, and nothing of the server's dependencies was installed (about 75 s: pip
unpacks torch from the local wheel)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["single_controller", "wire", "app", "deployments", "clients", "bench"]


@pytest.mark.timeout(600)
def test_client_extra_installs_alone_in_a_fresh_venv(tmp_path: Path):
    source = tmp_path / "source"  # a copy, so the build leaves nothing in the checkout
    source.mkdir()
    shutil.copy(ROOT / "pyproject.toml", source)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__", "results"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    install = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--no-compile", f"{source}[client]"],
        capture_output=True, text=True, timeout=540,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    installed = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                               check=True).stdout.lower()
    names = {line.split("==")[0] for line in installed.splitlines()}
    assert {"torch", "numpy", "safetensors", "httpx", "hybridflow-serve"} <= names
    assert not names & {"ray", "fastapi", "megatron-core", "uvicorn", "tensordict", "omegaconf", "starlette"}
    check = subprocess.run(
        [python, "-c", "import clients.python_client, clients.cli, wire.oip_messages; print('ok')"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert check.returncode == 0 and check.stdout.strip() == "ok", check.stderr[-3000:]
    usage = subprocess.run([python, "-m", "clients.cli", "--help"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120)
    assert usage.returncode == 0 and "infer" in usage.stdout

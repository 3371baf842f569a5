"""The client is a distribution of its own (hybridflow-client/): its imports never reach
the server (Ray, FastAPI, megatron-core, the service namespace, the library), its
dependencies are httpx, numpy and safetensors (torch optional), and it has a console
command for the CLI, and it installs alone into a fresh virtual environment. The
service's distribution installs the server, and depends on the client's for the wire
formats."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "hybridflow-client"

#: Top-level modules a client process must never import.
SERVER_ONLY = ["ray", "fastapi", "starlette", "uvicorn", "megatron", "tensordict", "omegaconf", "hybridflow",
               "single_controller", "torch"]

GUARDED_IMPORT = textwrap.dedent(
    """
    import importlib.abc, sys

    BLOCKED = set(sys.argv[1].split(","))

    class NoServer(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"the client imported {name!r}")
            return None

    sys.meta_path.insert(0, NoServer())
    import hybridflow_client, hybridflow_client.python_client, hybridflow_client.cli
    from hybridflow_client import AsyncSingleControllerClient, SingleControllerClient
    assert hybridflow_client.cli.build_parser().parse_args(["groups"]).command == "groups"
    print(sorted(name for name in sys.modules if name.split(".")[0] in BLOCKED))
    """
)


def requirement_names(requirements: list[str]) -> set[str]:
    return {req.split("[")[0].split("=")[0].split("<")[0].split(">")[0].strip().lower() for req in requirements}


def test_the_client_imports_nothing_of_the_server_and_runs_without_torch():
    # torch blocked too: the client works with numpy alone
    result = subprocess.run(
        [sys.executable, "-c", GUARDED_IMPORT, ",".join(SERVER_ONLY)],
        cwd=CLIENT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


def test_the_client_distribution_depends_on_httpx_numpy_and_safetensors_only():
    project = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]
    assert "client" in project["name"]
    assert requirement_names(project["dependencies"]) == {"httpx", "numpy", "safetensors"}
    assert requirement_names(project["optional-dependencies"]["torch"]) == {"torch"}
    assert project["scripts"]["hybridflow"] == "hybridflow_client.cli:main"


def test_make_and_docker_install_the_server_and_the_tests_the_client():
    makefile = (ROOT / "Makefile").read_text()
    assert "-e '.[dev]'" in makefile and "-e ./hybridflow-client" in makefile
    server = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert {"ray", "megatron-core", "fastapi", "pydantic", "uvicorn", "tensordict"} <= requirement_names(
        server["project"]["dependencies"])
    packages = set(server["tool"]["setuptools"]["packages"]["find"]["include"])
    assert {"single_controller*", "hybridflow*"} <= packages and not any("client" in p for p in packages)


def test_the_service_depends_on_the_client_at_its_version():
    """The wire formats are the client distribution's: the service needs it, at the version
    the client's version.py states (a bump of one is a bump of the pin)."""
    server = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    version = re.search(r'__version__ = "([^"]+)"', (CLIENT / "hybridflow_client" / "version.py").read_text())[1]
    assert f"hybridflow-client=={version}" in server["dependencies"]


#: Distributions of the server's stack: none may come with the client.
SERVER_PACKAGES = {"ray", "fastapi", "megatron-core", "uvicorn", "tensordict", "omegaconf", "starlette", "torch",
                   "hybridflow-serve"}


@pytest.mark.timeout(600)
def test_pip_install_of_the_client_alone_brings_nothing_of_the_server(tmp_path):
    """``pip install ./hybridflow-client`` into a fresh virtual environment holding nothing
    else: its dependencies come, nothing of the server's (torch included), and the console
    command answers."""
    source = tmp_path / "source"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(CLIENT, source, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info", ".ruff_cache"))
    venv, python = tmp_path / "venv", tmp_path / "venv" / "bin" / "python"
    uv = Path(sys.executable).parent / "uv"
    if uv.exists():  # make venv's installer, whose cache holds the client's dependencies; pip seeded for pip list
        subprocess.run([str(uv), "venv", "-q", "--seed", "--python", sys.executable, str(venv)], check=True, timeout=300)
        install = [str(uv), "pip", "install", "-q", "--python", str(python), str(source)]
    else:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        install = [str(python), "-m", "pip", "install", "--quiet", "--no-compile", str(source)]
    installed = subprocess.run(install, capture_output=True, text=True, timeout=540)
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                            check=True).stdout.lower()
    names = {line.split("==")[0] for line in listed.splitlines()}
    assert {"hybridflow-client", "httpx", "numpy", "safetensors"} <= names
    assert not names & SERVER_PACKAGES
    usage = subprocess.run([str(python.parent / "hybridflow"), "--help"], capture_output=True, text=True, timeout=120)
    assert usage.returncode == 0 and "infer" in usage.stdout

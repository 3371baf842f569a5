"""The client installs and imports without the server: its imports never reach Ray,
FastAPI, megatron-core or the server packages, and the project's base dependencies are
the client's (the server's sit in the `server` extra)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Top-level modules a client process must never import.
SERVER_ONLY = ["ray", "fastapi", "starlette", "uvicorn", "megatron", "tensordict", "omegaconf", "app", "deployments"]

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
    import clients, clients.python_client, clients.cli
    from clients import AsyncSingleControllerClient, SingleControllerClient
    assert clients.cli.build_parser().parse_args(["groups"]).command == "groups"
    print(sorted(name for name in sys.modules if name.split(".")[0] in BLOCKED))
    """
)


def test_client_modules_import_nothing_of_the_server():
    result = subprocess.run(
        [sys.executable, "-c", GUARDED_IMPORT, ",".join(SERVER_ONLY)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


def requirement_names(requirements: list[str]) -> set[str]:
    return {req.split("[")[0].split("=")[0].split("<")[0].split(">")[0].strip().lower() for req in requirements}


def test_base_dependencies_are_the_clients_and_the_server_is_an_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = requirement_names(project["dependencies"])
    assert base <= {"torch", "numpy", "safetensors", "httpx", "tqdm"}
    assert {"torch", "numpy", "safetensors", "httpx"} <= base
    extras = project["optional-dependencies"]
    assert "httpx" in requirement_names(extras["client"])
    assert {"ray", "megatron-core", "fastapi", "pydantic", "uvicorn", "tensordict"} <= requirement_names(extras["server"])
    assert "pytest" in requirement_names(extras["dev"])


def test_make_and_docker_install_the_server_extra():
    assert "-e '.[server,dev]'" in (ROOT / "Makefile").read_text()
    dockerfile = (ROOT / "Dockerfile").read_text()
    # The image installs the project's wheel with the server extra; the wheel carries
    # every package the service imports.
    assert '.whl)[server]"' in dockerfile
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert {"single_controller*", "wire*", "app*", "deployments*", "clients*"} <= set(packages["include"])

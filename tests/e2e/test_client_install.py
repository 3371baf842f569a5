"""`pip install '.[client]'` into a fresh virtual environment: the client and CLI import
and run there, and nothing of the server's dependencies was installed. The install itself
(``ClientInstall`` in conftest.py) runs in the background from the 40 s call on."""

from __future__ import annotations

import subprocess

import pytest


@pytest.mark.timeout(600)
def test_client_extra_installs_alone_in_a_fresh_venv(client_install):
    install = client_install.result()
    assert install.returncode == 0, install.stderr[-3000:]
    python = str(client_install.python)
    installed = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                               check=True).stdout.lower()
    names = {line.split("==")[0] for line in installed.splitlines()}
    assert {"torch", "numpy", "safetensors", "httpx", "hybridflow-serve"} <= names
    assert not names & {"ray", "fastapi", "megatron-core", "uvicorn", "tensordict", "omegaconf", "starlette"}
    check = subprocess.run(
        [python, "-c", "import clients.python_client, clients.cli, wire.oip_messages; print('ok')"],
        cwd=client_install.directory, capture_output=True, text=True, timeout=120,
    )
    assert check.returncode == 0 and check.stdout.strip() == "ok", check.stderr[-3000:]
    usage = subprocess.run([python, "-m", "clients.cli", "--help"], cwd=client_install.directory,
                           capture_output=True, text=True, timeout=120)
    assert usage.returncode == 0 and "infer" in usage.stdout

"""`make image-test`: the image built from the Dockerfile, run as the README tells a user
(`docker run --init -p ... --shm-size=2g -e HYBRIDFLOW_TOKEN=... hybridflow-serve`), answering
the tutorial over HTTP, refusing calls without the token, and reporting healthy."""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from single_controller.rendezvous import free_port
from tests.docker.support import IMAGE, check_tutorial, container_logs, docker, wait_ready

READY_TIMEOUT_S = 600
TOKEN = "image-test-" + secrets.token_hex(8)


@dataclass
class RunningImage:
    name: str
    url: str
    client: httpx.Client  # sends the token


def _health(name: str) -> str:
    result = docker("inspect", "-f", "{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}", name)
    return result.stdout.strip()


@pytest.fixture(scope="module")
def running() -> Iterator[RunningImage]:
    name = f"hybridflow-imagetest-{os.getpid()}"
    port = free_port()
    docker("run", "-d", "--init", "--name", name, "-p", f"127.0.0.1:{port}:8000", "--shm-size=2g",
           "-e", f"HYBRIDFLOW_TOKEN={TOKEN}", IMAGE)
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=300) as client:

            def exited() -> str | None:
                state = _health(name)
                return None if state.startswith("running") else f"container {state}:\n{container_logs(name)}"

            waited = wait_ready(client, READY_TIMEOUT_S, exited)
            print(f"\n{IMAGE}: /readyz answered 200 {waited:.0f} s after docker run")
            yield RunningImage(name, url, client)
    finally:
        docker("rm", "-f", name, check=False)


def test_image_is_a_venv_run_by_an_unprivileged_user_with_no_build_tools():
    (config,) = json.loads(docker("image", "inspect", IMAGE).stdout)
    print(f"\n{IMAGE}: {config['Size'] / 1e9:.2f} GB")
    assert config["Config"]["Cmd"] == ["serve", "run", "serve_config.yaml"]
    assert config["Config"]["User"] not in ("", "0", "root", "0:0")
    assert config["Config"]["Healthcheck"]["Test"][0] == "CMD"
    # Looked at as root, so caches in any home would be visible.
    probe = (
        "id -u hybridflow; "
        "command -v wget; "  # KubeRay's default probes use it
        "for tool in gcc cc c++ g++ make; do command -v $tool; done; "
        "find / -xdev -type d \\( -path '*/.cache/pip' -o -path '*/pip-cache*' \\) 2>/dev/null; "
        "python -c 'import sys, torch; print(sys.prefix, sys.base_prefix != sys.prefix, torch.__version__)'"
    )
    lines = docker("run", "--rm", "--user", "0", "--entrypoint", "sh", IMAGE, "-c", probe).stdout.split()
    assert lines == ["1000", "/usr/bin/wget", "/opt/venv", "True", "2.13.0+cpu"], lines


def test_the_tutorial_answers_over_http(running):
    check_tutorial(running.client)


def test_calls_without_the_token_answer_401(running):
    before = running.client.post("/v1/groups/accumulator/get_value", json={}).json()["output"]
    with httpx.Client(base_url=running.url, timeout=60) as anonymous:
        body = {"args": [1]}
        assert anonymous.get("/readyz").status_code == 200  # health stays open
        missing = anonymous.post("/v1/groups/accumulator/add", json=body)
        assert missing.status_code == 401 and "error" in missing.json(), missing.text
        wrong = anonymous.post("/v1/groups/accumulator/add", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401, wrong.text
        assert anonymous.get("/v1/groups").status_code == 401
    # Neither refused call was applied.
    assert running.client.post("/v1/groups/accumulator/get_value", json={}).json()["output"] == before


def test_the_healthcheck_reaches_healthy(running):
    # The HEALTHCHECK probes every 30 s: healthy within two probes of the service answering.
    deadline = time.monotonic() + 90
    while (state := _health(running.name)) != "running healthy":
        assert state in ("running starting", "running healthy"), state
        assert time.monotonic() < deadline, f"still {state!r} after 90 s"
        time.sleep(3)

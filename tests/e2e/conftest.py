"""A second service for the end-to-end tests, started once: serve_config.yaml's test_actor
deployment plus a deployment of worker classes from a package outside the project (a
temporary directory on PYTHONPATH), with a bearer token, a 1 KiB body limit and a 3 s
request timeout."""

from __future__ import annotations

import textwrap
from pathlib import Path

import httpx
import pytest
import yaml

from clients.local_server import CONFIG, ServeProcess

TOKEN = "s3cret-token"

#: A worker package the project has never seen.
OWN_WORKERS = '''
import torch

from single_controller.base import Worker
from single_controller.base.decorator import Dispatch, Execute, register


class Counter(Worker):
    """Each rank counts from start + its rank."""

    def __init__(self, start=0):
        super().__init__()
        self.value = start + self.rank

    @register(Dispatch.ONE_TO_ALL)
    def add(self, x):
        self.value += x
        return self.value

    def get(self):
        return self.value

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def scale(self, x):
        return x * self.value


class Viewer(Worker):
    """Reads which GPUs its rank sees (it shares the counter's bundles)."""

    def devices(self):
        return self.get_cuda_visible_devices()
'''

OWN_DEPLOYMENT = {
    "name": "counters",
    "groups": [
        {
            "name": "counter",
            "worker": "my_counters.workers:Counter",
            "init_kwargs": {"start": 5},
            "pool": {"process_on_nodes": [2], "use_gpu": "auto", "name_prefix": "c"},
            "read_only": ["get", "scale"],
        },
        {"name": "counter_view", "worker": "my_counters.workers:Viewer", "pool": {"same_as": "counter"},
         "read_only": ["devices"]},
    ],
    "models": [
        {"name": "scaler", "group": "counter", "method": "scale",
         "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
         "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}]},
    ],
}


@pytest.fixture(scope="session")
def limited(tmp_path_factory):
    packages = tmp_path_factory.mktemp("outside")
    (packages / "my_counters").mkdir()
    (packages / "my_counters" / "__init__.py").write_text("")
    (packages / "my_counters" / "workers.py").write_text(textwrap.dedent(OWN_WORKERS))
    args = yaml.safe_load(Path(CONFIG).read_text())["applications"][0]["args"]
    test_actor = [d for d in args["deployments"] if d["name"] == "test_actor"]
    proc = ServeProcess(
        overrides={"max_body_bytes": 1024, "request_timeout_s": 3, "deployments": [*test_actor, OWN_DEPLOYMENT]},
        env={"SC_AUTH_TOKEN": TOKEN, "PYTHONPATH": str(packages)},
        state_path=tmp_path_factory.mktemp("limited-state") / "state.db",
    )
    proc.start()  # readiness is an open route, so the token is not needed to wait for it
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def client(limited):
    with httpx.Client(base_url=limited.url, timeout=60, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c

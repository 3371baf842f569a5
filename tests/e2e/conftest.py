"""A second service for the end-to-end tests, started by the first test that asks for it:
serve_config.yaml's test_actor deployment, its accumulators cut to the pool of 4, and a
deployment of worker classes from a package outside the project (a temporary directory on
PYTHONPATH), with a bearer token, a 1 KiB body limit, a 3 s request timeout, and the
ingress scaled out to two replicas, so the controllers run in replicas of their own (the
session's service, as shipped, has them inside its one ingress replica).

Every module runs alone and in any order: each asks for the services it uses, and a
service starts on first use."""

from __future__ import annotations

import textwrap
from pathlib import Path

import httpx
import pytest
import yaml

from tests.serve_process import CONFIG, ServeProcess

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
def second_service(tmp_path_factory):
    """The second service's ``serve run``, launched by the first test that asks for it
    (not waited for: ``limited`` waits until it is ready)."""
    packages = tmp_path_factory.mktemp("outside")
    (packages / "my_counters").mkdir()
    (packages / "my_counters" / "__init__.py").write_text("")
    (packages / "my_counters" / "workers.py").write_text(textwrap.dedent(OWN_WORKERS))
    args = yaml.safe_load(Path(CONFIG).read_text())["applications"][0]["args"]
    test_actor = next(d for d in args["deployments"] if d["name"] == "test_actor")
    accumulators = next(d for d in args["deployments"] if d["name"] == "accumulators")
    accumulators = {**accumulators, "groups": [g for g in accumulators["groups"] if g["name"] == "gpu_accumulator"]}
    proc = ServeProcess(
        overrides={"max_body_bytes": 1024, "request_timeout_s": 3, "ingress_replicas": 2,
                   "deployments": [test_actor, accumulators, OWN_DEPLOYMENT]},
        env={"SC_AUTH_TOKEN": TOKEN, "PYTHONPATH": str(packages)},
        state_path=tmp_path_factory.mktemp("limited-state") / "state.db",
    )
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def limited(second_service):
    return second_service.ensure_launched().wait_ready()  # readiness is an open route: no token needed


def pytest_collection_modifyitems(items):
    for item in items:  # the last test to use each service stops it (see below)
        for name in SERVICES:
            if name in item.fixturenames:
                LAST_USER[name] = item.nodeid


#: Session services told to stop (Ctrl-C) as soon as their last test is done, so that an
#: idle service takes no CPU from the starts of the next ones. The next test does not wait
#: for the shutdown; the fixture's own stop() at the end of the session does.
SERVICES = ("service", "second_service")
LAST_USER: dict[str, str] = {}


def pytest_runtest_teardown(item, nextitem):
    for name in SERVICES:
        if nextitem is not None and LAST_USER.get(name) == item.nodeid and name in item.funcargs:
            item.funcargs[name].begin_stop()


@pytest.fixture(scope="session")
def client(limited):
    with httpx.Client(base_url=limited.url, timeout=60, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c

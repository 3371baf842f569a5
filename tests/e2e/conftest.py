"""A second service for the end-to-end tests, started by the first test that asks for it:
serve_config.yaml's test_actor deployment, its accumulators cut to the pool of 4, and a
deployment of worker classes from a package outside the project (a temporary directory on
PYTHONPATH), with a bearer token, a 1 KiB body limit, a 3 s request timeout, and the
ingress scaled out to two replicas, so the controllers run in replicas of their own (the
session's service, as shipped, has them inside its one ingress replica).

Every module runs alone and in any order: each asks for the services it uses, and a
service starts on first use."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import httpx
import pytest
import yaml

from tests.serve_process import CONFIG, ROOT, ServeProcess

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


class ClientInstall:
    """`pip install '.[client]'` into a fresh virtual environment, in a thread: begun by a
    test whose cores are mostly idle (the 40 s call), checked by test_client_install."""

    PACKAGES = ("single_controller", "wire", "app", "deployments", "clients", "bench")

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.python = directory / "venv" / "bin" / "python"
        self.thread: threading.Thread | None = None
        self.outcome: subprocess.CompletedProcess | None = None

    def begin(self) -> ClientInstall:
        if self.thread is None:
            self.thread = threading.Thread(target=self._install, daemon=True)
            self.thread.start()
        return self

    def result(self, timeout_s: float = 600) -> subprocess.CompletedProcess:
        """The install's pip run (begun now if no test began it)."""
        self.begin().thread.join(timeout_s)
        if self.outcome is None:
            raise TimeoutError(f"the client install did not finish within {timeout_s:g} s")
        return self.outcome

    def _install(self) -> None:
        source = self.directory / "source"  # a copy, so the build leaves nothing in the checkout
        try:
            source.mkdir()
            shutil.copy(ROOT / "pyproject.toml", source)
            for package in self.PACKAGES:
                shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__", "results"))
            subprocess.run([sys.executable, "-m", "venv", str(self.python.parent.parent)], check=True, timeout=120)
            self.outcome = subprocess.run(
                [str(self.python), "-m", "pip", "install", "--quiet", "--no-compile", f"{source}[client]"],
                capture_output=True, text=True, timeout=540,
            )
        except Exception as exc:  # reported by result(), in the test that checks the install
            self.outcome = subprocess.CompletedProcess([], 1, "", f"{type(exc).__name__}: {exc}")


@pytest.fixture(scope="session")
def client_install(tmp_path_factory) -> ClientInstall:
    return ClientInstall(tmp_path_factory.mktemp("client-install"))


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

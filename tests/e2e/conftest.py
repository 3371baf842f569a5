"""The end-to-end tests' services beside the session's (tests/conftest.py: serve_config.yaml
as shipped, its controllers inside its one ingress replica), each started by the first test
that asks for it and stopped after its last:

- the second service: serve_config.yaml's test_actor deployment, its accumulators cut to
  the pool of 4, and a deployment of worker classes from a package outside the project (a
  temporary directory on PYTHONPATH), with a bearer token, a 1 KiB body limit, a 3 s
  request timeout, and the ingress scaled out to two replicas, so the controllers run in
  replicas of their own;
- the third service: small groups for the state store's bounds and a group that declares
  a mesh (its workers from another package outside the project), with the byte bounds of
  kept answers and job results lowered (``SMALL_LIMITS``).

Every module runs alone and in any order: each asks for the services it uses.
"""

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


#: Four ranks: mesh "actor" is dp=2 x tp=2, tp rank 0 answers for its dp rank.
MESH_WORKERS = '''
import torch

from single_controller import DataProto
from single_controller import tensordict_utils as tu
from single_controller.base import Worker
from single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register


class Doubler(Worker):
    def __init__(self):
        super().__init__()
        self._register_dispatch_collect_info("actor", dp_rank=self.rank // 2, is_collect=self.rank % 2 == 0)
        self.rows = 0

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def double(self, data):
        who = torch.full((len(data),), self.rank)
        if isinstance(data, DataProto):
            data.batch["x"] = data.batch["x"] * 2
            data.batch["who"] = who
            return data
        values, offsets, ragged_dim = tu.jagged_parts(data["ids"])
        ids = tu.jagged_from_parts(values * 2, offsets, ragged_dim)
        return tu.get_tensordict({"ids": ids, "x": data["x"] * 2, "who": who, "tags": tu.get(data, "tags")},
                                 {"scale": tu.get(data, "scale", 1) * 2})

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def learn(self, data):
        self.rows += len(data)
        return data

    @register(Dispatch.ONE_TO_ALL)
    def rows_seen(self):
        return self.rows
'''

MESH_DEPLOYMENT = {
    "name": "meshes",
    "groups": [{"name": "doubler", "worker": "my_meshes.workers:Doubler",
                "pool": {"process_on_nodes": [4], "name_prefix": "mesh"}, "read_only": ["double", "rows_seen"]}],
}

#: The third service's snapshot interval (calls per snapshot).
SNAPSHOT_EVERY = 100
#: The third service's byte bounds of kept Idempotency-Key answers and finished jobs'
#: results (defaults 256 MiB and 1 GiB): a few answers of 8 MiB pass them.
SMALL_LIMITS = {"idempotency_bytes": 64 << 20, "jobs_result_bytes": 16 << 20}
#: Seconds between Serve's health checks of the third service's ingress replica, which
#: hosts its controllers (Serve's default is 10): a test that watches what the checks do
#: waits a few of them.
SMALL_HEALTH_CHECK_PERIOD_S = 2


def shipped_deployment(name: str, groups: tuple[str, ...] | None = None) -> dict:
    """serve_config.yaml's deployment ``name``, with only the named groups if given."""
    args = yaml.safe_load(Path(CONFIG).read_text())["applications"][0]["args"]
    deployment = next(d for d in args["deployments"] if d["name"] == name)
    if groups is None:
        return deployment
    return {**deployment, "groups": [g for g in deployment["groups"] if g["name"] in groups]}


def write_package(root: Path, name: str, source: str) -> Path:
    """A one-module package ``name`` (``name.workers``) under ``root``; returns ``root``."""
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("")
    (root / name / "workers.py").write_text(textwrap.dedent(source))
    return root


def _small_deployments() -> list[dict]:
    """test_actor on 2 ranks and the plain accumulator actor, from serve_config.yaml."""
    test_actor = shipped_deployment("test_actor")
    test_actor = {"name": "test_actor",
                  "groups": [{**test_actor["groups"][0], "pool": {"process_on_nodes": [2]}}]}
    return [test_actor, shipped_deployment("accumulators", ("accumulator",))]


@pytest.fixture(scope="session")
def small_service(tmp_path_factory):
    """The third service (the state store's bounds, and a group that declares a mesh):
    test_actor on 2 ranks, the plain accumulator, the mesh deployment from a package
    outside the project, snapshots every 100 calls, a SQLite file of its own
    (``.state_path``), a health check every ``SMALL_HEALTH_CHECK_PERIOD_S``, the byte
    bounds ``SMALL_LIMITS``. Started by its first user, stopped after its last."""
    packages = write_package(tmp_path_factory.mktemp("mesh-workers"), "my_meshes", MESH_WORKERS)
    state = tmp_path_factory.mktemp("small-state") / "state.db"
    proc = ServeProcess(overrides={"deployments": [*_small_deployments(), MESH_DEPLOYMENT],
                                   "state": {"snapshot_every": SNAPSHOT_EVERY}, "limits": SMALL_LIMITS},
                        env={"PYTHONPATH": str(packages)}, state_path=state,
                        serve_options={"ingress": {"health_check_period_s": SMALL_HEALTH_CHECK_PERIOD_S}})
    proc.state_path = state
    try:
        yield proc.start()
    finally:
        proc.kill()


@pytest.fixture(scope="session")
def second_service(tmp_path_factory):
    """The second service's ``serve run``, launched by the first test that asks for it
    (not waited for: ``limited`` waits until it is ready)."""
    packages = write_package(tmp_path_factory.mktemp("outside"), "my_counters", OWN_WORKERS)
    test_actor = shipped_deployment("test_actor")
    accumulators = shipped_deployment("accumulators", ("gpu_accumulator",))
    proc = ServeProcess(
        overrides={"max_body_bytes": 1024, "request_timeout_s": 3, "ingress_replicas": 2,
                   "deployments": [test_actor, accumulators, OWN_DEPLOYMENT]},
        env={"SC_AUTH_TOKEN": TOKEN, "PYTHONPATH": str(packages)},
        state_path=tmp_path_factory.mktemp("limited-state") / "state.db",
    )
    try:
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="session")
def limited(second_service):
    return second_service.ensure_launched().wait_ready()  # readiness is an open route: no token needed


#: Fixtures that mean a test runs on a session service (the first or the second).
SESSION_FIXTURES = ("service",)
SECOND_FIXTURES = ("limited", "second_service")


def _service_rank(fixtures: set[str]) -> int:
    session, second = bool(fixtures.intersection(SESSION_FIXTURES)), bool(fixtures.intersection(SECOND_FIXTURES))
    return 3 if second and not session else 2 if second else 1 if session else 0


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "shipped_service: the test uses the session's service, serve_config.yaml as shipped "
        "(set from the fixtures it asks for; `make test` runs these tests beside the others)",
    )


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marker set here
def pytest_collection_modifyitems(items):
    # Every module passes alone and in any order; this order only keeps at most two Ray
    # clusters on the machine at once: modules with a service of their own run first,
    # each alone, then those on the session's service, then those on both, then those on
    # the second alone (each session service stops after its last user).
    for item in items:
        if set(SESSION_FIXTURES).intersection(item.fixturenames):
            item.add_marker(pytest.mark.shipped_service)
    fixtures_of_module: dict[str, set[str]] = {}
    for item in items:
        fixtures_of_module.setdefault(item.nodeid.split("::", 1)[0], set()).update(item.fixturenames)
    items.sort(key=lambda item: _service_rank(fixtures_of_module[item.nodeid.split("::", 1)[0]]))  # stable
    for item in items:  # the last test to use each service stops it (see below)
        for name in SERVICES:
            if name in item.fixturenames:
                LAST_USER[name] = item.nodeid


#: Session services ended (their processes killed: no test reads them after) as soon as
#: their last test is done, so that an idle or shutting-down service takes no CPU from the
#: starts of the next ones.
SERVICES = ("service", "second_service", "small_service")
LAST_USER: dict[str, str] = {}


def pytest_runtest_teardown(item, nextitem):
    for name in SERVICES:
        if nextitem is not None and LAST_USER.get(name) == item.nodeid and name in item.funcargs:
            item.funcargs[name].kill()


@pytest.fixture(scope="session")
def client(limited):
    with httpx.Client(base_url=limited.url, timeout=60, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c

"""The end-to-end tests' services, each started by the first test that asks for it:

- the session's service (``service``): ``serve run serve_config.yaml`` as a user starts
  it (its state in a file of the session's own), its controllers inside its one ingress
  replica. Its Ray cluster is the one the other applications below share: they are more
  Serve applications of this project in it (``tests/serve_app.py``), each under a route
  prefix of its own, deleted after its last test;
- the second application, ``/second``: serve_config.yaml's test_actor deployment, its
  accumulators cut to the pool of 4, and a deployment of worker classes from a package
  outside the project (on the cluster's PYTHONPATH), with a bearer token, a 1 KiB body
  limit, a 3 s request timeout, and the ingress scaled out to two replicas, so the
  controllers run in replicas of their own;
- the small service (``small_service``): ``serve run`` of a cluster of its own, with small
  groups for the state store's bounds and a group that declares a mesh (its workers from
  another package outside the project), health-checked every 2 s, with the byte bounds of
  kept answers and job results lowered (``SMALL_LIMITS``). Its modules need nothing of the
  shipped service, so they are marked ``own_cluster`` and ``make test`` runs them beside
  the session's cluster (a few processes, where the shipped service has dozens).

Modules that restart ``serve run`` start clusters of their own (marked ``own_cluster``).
Every module runs alone and in any order: each asks for the services it uses.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import wait_until_ready
from tests.serve_app import ServeApp, shipped_args
from tests.serve_process import ServeProcess

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
#: The small application's byte bounds of kept Idempotency-Key answers and finished jobs'
#: results (defaults 256 MiB and 1 GiB): a few answers of 8 MiB pass them.
SMALL_LIMITS = {"idempotency_bytes": 64 << 20, "jobs_result_bytes": 16 << 20}
#: Serve's health checks of the small application's ingress replica, which hosts its
#: controllers: every 2 s (Serve's default is 10), failing after 10 s (30), and a worker
#: lost after 5 s without a ping's answer (10): a test that watches what the checks do, or
#: outlasts one, waits a few seconds.
SMALL_HEALTH_CHECK_PERIOD_S = 2
SMALL_HEALTH_CHECK_TIMEOUT_S = 10
SMALL_PING_TIMEOUT_S = 5


def shipped_deployment(name: str, groups: tuple[str, ...] | None = None) -> dict:
    """serve_config.yaml's deployment ``name``, with only the named groups if given."""
    deployment = next(d for d in shipped_args()["deployments"] if d["name"] == name)
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
def outside_packages(tmp_path_factory) -> Path:
    """Worker packages the project has never seen, on the session cluster's PYTHONPATH."""
    root = tmp_path_factory.mktemp("outside")
    write_package(root, "my_counters", OWN_WORKERS)
    return write_package(root, "my_meshes", MESH_WORKERS)


@pytest.fixture(scope="session")
def service(tmp_path_factory, outside_packages):
    """`serve run serve_config.yaml` as a user would start it, shared by the session
    (its cold start is the most expensive step of the suite), with fresh state in a file
    of its own (not the checkout's .hybridflow/state.db)."""
    state = {**shipped_args()["state"], "path": str(tmp_path_factory.mktemp("service-state") / "state.db")}
    # Ray exports recorded metrics every 10 s by default; every 2 s here, so the tests that
    # wait for a metric to show wait less (the service is otherwise as shipped).
    proc = ServeProcess(overrides={"state": state},
                        env={"RAY_metrics_report_interval_ms": "2000", "PYTHONPATH": str(outside_packages)})
    try:
        yield proc.start()
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def http(service):
    # A module before this one may have left groups rebuilding (a killed worker or replica):
    # every module starts on a service whose groups all serve.
    service.wait_ready(timeout_s=300)
    with httpx.Client(base_url=service.url, timeout=300) as client:
        # /readyz says every group came up once: wait until none is rebuilding now
        wait_until_ready(client, [g["name"] for g in client.get("/v1/groups").json()["groups"]], timeout_s=300)
        yield client


def application(service: ServeProcess, name: str, tmp_path_factory, **args) -> ServeApp:
    """Another application in the session service's cluster, its state in a file of its own."""
    state = tmp_path_factory.mktemp(f"{name}-state") / "state.db"
    app = ServeApp(service, name, {**shipped_args(), **args, "state": {**args.get("state", {}), "path": str(state)}})
    app.state_path = state
    return app


@pytest.fixture(scope="session")
def small_service(tmp_path_factory, outside_packages):
    """The small service (the state store's bounds, and a group that declares a mesh):
    ``serve run`` in a cluster of its own, serving test_actor on 2 ranks, the plain
    accumulator, the mesh deployment from a package outside the project, snapshots every
    100 calls, a SQLite file of its own (``.state_path``), the short health checks above,
    the byte bounds ``SMALL_LIMITS``. Started by its first user, stopped after its last."""
    state = tmp_path_factory.mktemp("small-state") / "state.db"
    proc = ServeProcess(overrides={
        "deployments": [*_small_deployments(), MESH_DEPLOYMENT],
        "state": {"path": str(state), "snapshot_every": SNAPSHOT_EVERY}, "limits": SMALL_LIMITS,
        "health_check_period_s": SMALL_HEALTH_CHECK_PERIOD_S, "health_check_timeout_s": SMALL_HEALTH_CHECK_TIMEOUT_S,
        "health_timeout_s": SMALL_PING_TIMEOUT_S,
    }, env={"PYTHONPATH": str(outside_packages)})
    proc.state_path = state
    try:
        yield proc.start()
    finally:
        proc.kill()


@pytest.fixture(scope="session")
def second_service(service, tmp_path_factory):
    """The second application, deployed by the first test that asks for it (not waited
    for: ``limited`` waits until it is ready)."""
    app = application(
        service, "second", tmp_path_factory, max_body_bytes=1024, request_timeout_s=3, ingress_replicas=2,
        auth_token=TOKEN, deployments=[shipped_deployment("test_actor"),
                                       shipped_deployment("accumulators", ("gpu_accumulator",)), OWN_DEPLOYMENT],
    )
    try:
        yield app
    finally:
        app.kill()


@pytest.fixture(scope="session")
def limited(second_service):
    return second_service.deploy().wait_ready()  # readiness is an open route: no token needed


#: The applications deleted after their last test, in the order their modules run: while
#: one of them runs the session's cluster holds it and the shipped service only.
APPLICATIONS = ("second_service",)


def _module_rank(fixtures: set[str], fresh_start: bool) -> tuple[int, int]:
    """Modules on the shipped service alone (or on the small service) first (some read its
    groups as a fresh start leaves them), then those on the second application; among
    each, a module marked ``fresh_start`` first (the README's answers are a fresh start's)."""
    return next((rank + 1 for rank, name in enumerate(APPLICATIONS) if name in fixtures), 0), int(not fresh_start)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by a marker
def pytest_collection_modifyitems(items):
    # Every module passes alone and in any order; this order keeps one extra application at
    # a time in the session's cluster (each is deleted after its last user), and the
    # shipped service's groups as a fresh start leaves them for the modules that run first.
    fixtures_of_module: dict[str, set[str]] = {}
    fresh_modules: set[str] = set()
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        fixtures_of_module.setdefault(module, set()).update(item.fixturenames)
        if item.get_closest_marker("fresh_start"):
            fresh_modules.add(module)

    def order(item: pytest.Item) -> tuple[int, int]:
        module = item.nodeid.split("::", 1)[0]
        return _module_rank(fixtures_of_module[module], module in fresh_modules)

    items.sort(key=order)  # stable
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

"""Restarts of the service with durable state, end to end, under load from 4 clients: (1)
the replica that hosts the ``accumulators`` controller (the ingress, in the shipped
layout) is killed with Ray's API, with a Redis server the test starts as the store (an
application in the small service's cluster: no cluster restarts), and (2) ``serve run``
is stopped with SIGINT and started again, on SQLite. Calls answer 503
with Retry-After while the controller comes back, and afterwards every rank holds exactly
its start value plus the acknowledged adds. A job that finished before (1) still answers
its status and result (the ``jobs`` deployment keeps jobs in memory, outside the ingress:
they outlive the ingress, not ``serve run``); after (2), the same job sent again with its
Idempotency-Key is not applied again and answers as the first did. (3) A start with a
group's world size changed is refused with an error naming the group, the change and the
fix, instead of replaying the stored state into the wrong shape.

The clients send every add with an Idempotency-Key and retry it until it is answered:
an add in flight when the controller died may have been recorded without its answer
reaching the client (in doubt), and the retry resolves it (the first answer if it was
recorded, applied now if not), so "acknowledged" is exact.

The service is the tutorial's ``accumulators`` deployment cut to two groups (the plain
actor and a pool of 2) so that the starts stay short; the full deployment's restore is the
same code.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter

import httpx
import pytest

from tests.e2e.cluster import kill_replica
from tests.e2e.jobs import wait_for_job
from tests.redis_server import start_redis
from tests.serve_app import ServeApp, shipped_args
from tests.serve_process import ServeProcess

pytestmark = pytest.mark.own_cluster  # serve run is stopped and started again

GROUPS = ("accumulator", "gpu_accumulator")
ADDS = {"accumulator": {"args": [1]}, "gpu_accumulator": {"kwargs": {"x": [1, 2]}}}
STEP = {"accumulator": [1], "gpu_accumulator": [1, 2]}

def _accumulators(gpu_ranks: int = 2) -> dict:
    (deployment,) = [d for d in shipped_args()["deployments"] if d["name"] == "accumulators"]
    groups = [g for g in deployment["groups"] if g["name"] in GROUPS]
    for group in groups:
        if group["name"] == "gpu_accumulator":
            group["pool"] = {"process_on_nodes": [gpu_ranks]}
    return {**deployment, "groups": groups}


@pytest.fixture(scope="module")
def restartable(tmp_path_factory):
    """``serve run`` of its own, its state in a SQLite file (``.state_location``)."""
    location = tmp_path_factory.mktemp("state-sqlite") / "state.db"
    proc = ServeProcess(overrides={"deployments": [_accumulators()]}, state_path=location)
    proc.start()
    proc.state_location = location
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def on_redis(small_service, tmp_path_factory):
    """The accumulators as another application in the small service's cluster (a replica's
    death restarts no cluster), their state on a Redis server the test starts."""
    server = start_redis(tmp_path_factory.mktemp("state-redis"))
    args = shipped_args()
    app = ServeApp(small_service, "restarts",
                   {**args, "deployments": [_accumulators()], "state": {**args["state"], "path": server.url}})
    try:
        yield app.start()
    finally:
        app.kill()
        server.stop()


def finished_job(client: httpx.Client, key: str | None = None) -> tuple[str, list]:
    """Runs an add on ``gpu_accumulator`` as a job (with ``key`` as its Idempotency-Key if
    given) until it succeeds: its id and its answer, each rank's value after the add."""
    headers = {"Idempotency-Key": key} if key else None
    job = client.post("/v1/jobs/gpu_accumulator/add", json=ADDS["gpu_accumulator"], headers=headers)
    assert job.status_code == 202, job.text
    job_id = job.json()["id"]
    final, _ = wait_for_job(client, job_id, timeout=60)
    assert final["status"] == "succeeded", final
    return job_id, client.get(f"/v1/jobs/{job_id}/result").json()["output"]


def assert_job_kept(client: httpx.Client, job_id: str, answer: list) -> None:
    """The job's record outlived the restart: its status and its result as first answered."""
    status = client.get(f"/v1/jobs/{job_id}")
    assert status.status_code == 200 and status.json()["status"] == "succeeded", status.text
    result = client.get(f"/v1/jobs/{job_id}/result")
    assert result.status_code == 200 and result.json()["output"] == answer, result.text


def values(client: httpx.Client) -> dict[str, list[float]]:
    out = {}
    for group in GROUPS:
        response = client.post(f"/v1/groups/{group}/get_value", json={})
        assert response.status_code == 200, response.text
        output = response.json()["output"]
        out[group] = [float(output)] if group == "accumulator" else [item["data"][0] for item in output]
    return out


class Load:
    """4 clients adding in a loop, each add under a key of its own, retried until answered."""

    def __init__(self, url: str, clients: int = 4) -> None:
        self.url = url
        self.acknowledged = Counter()
        self.statuses = Counter()
        self.missing_retry_after = 0
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=300)
        assert not any(thread.is_alive() for thread in self.threads), "a client never got its add answered"
        assert not self.errors, self.errors

    def _client(self) -> None:
        with httpx.Client(base_url=self.url, timeout=300) as client:
            turn = 0
            while not self.stop.is_set():
                group = GROUPS[turn % 2]
                turn += 1
                try:
                    self._add_until_answered(client, group, f"load-{uuid.uuid4().hex}")
                except Exception as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    return

    def _add_until_answered(self, client: httpx.Client, group: str, key: str) -> None:
        deadline = time.monotonic() + 280
        while time.monotonic() < deadline:
            try:
                response = client.post(f"/v1/groups/{group}/add", json=ADDS[group], headers={"Idempotency-Key": key})
            except httpx.TransportError:  # the service is down (stopped, starting)
                self.statuses["no answer"] += 1
                time.sleep(0.5)
                continue
            if not response.headers.get("content-type", "").startswith("application/json"):
                # Serve's own answer while the application is not deployed (yet, or any more)
                self.statuses[f"serve {response.status_code}"] += 1
                time.sleep(0.5)
                continue
            self.statuses[response.status_code] += 1
            if response.status_code == 200:
                self.acknowledged[group] += 1
                return
            assert response.status_code >= 500, response.text  # never refused: retried until applied
            if response.status_code == 503 and not response.headers.get("retry-after"):
                self.missing_retry_after += 1
            time.sleep(0.5)
        raise AssertionError(f"add {key} on {group} was never answered")

    def expected(self, start: dict[str, list[float]]) -> dict[str, list[float]]:
        return {g: [v + self.acknowledged[g] * s for v, s in zip(start[g], STEP[g], strict=True)] for g in GROUPS}


# On Redis: the store that outlives the service (the SIGINT restart below restores from
# SQLite; the store's contract is checked on both backends in tests/unit/test_state_store.py).
def test_killed_controller_replica_comes_back_with_every_acknowledged_add(on_redis):
    # The shipped layout: the controllers live in the one ingress replica, so that is the
    # replica whose death loses them; while Serve restarts it, its proxy answers 5xx itself.
    with httpx.Client(base_url=on_redis.url, timeout=60) as client:
        job_id, answer = finished_job(client)
        start = values(client)
        with Load(on_redis.url) as load:
            time.sleep(2)
            assert kill_replica(on_redis, "ingress").startswith("SERVE_REPLICA::")
            time.sleep(2)
            on_redis.wait_ready(timeout_s=180)  # /readyz again, after Serve restarted the replica
            time.sleep(1)  # some load on the restored groups
        assert sum(n for status, n in load.statuses.items() if status != 200) > 0, load.statuses
        assert all(status == 200 or str(status).startswith("serve ") or status == "no answer"
                   or status >= 500 for status in load.statuses), load.statuses
        assert load.missing_retry_after == 0  # the service's own 503s say when to retry
        assert min(load.acknowledged.values()) > 0
        assert values(client) == load.expected(start)
        assert_job_kept(client, job_id, answer)


# On SQLite: the store that lives in a file of serve run's own.
def test_serve_run_stopped_with_sigint_and_started_again_restores_every_group(restartable):
    with httpx.Client(base_url=restartable.url, timeout=60) as client:
        _, answer = finished_job(client, key="a-job-before-the-restart")
        start = values(client)
    with Load(restartable.url) as load:
        time.sleep(2)
        restartable.stop()  # SIGINT, as Ctrl-C
        restartable.start(fresh=False)
        time.sleep(1)
    assert load.statuses["no answer"] > 0, load.statuses
    with httpx.Client(base_url=restartable.url, timeout=60) as client:
        assert values(client) == load.expected(start)
        # the job list did not outlive serve run; the same job again with its key is not
        # applied again: it answers the first call's values
        assert finished_job(client, key="a-job-before-the-restart")[1] == answer
        assert values(client) == load.expected(start)


# On SQLite only: the controller refuses before anything backend-specific happens (the
# stored metadata is compared on every backend in tests/unit/test_state_store.py).
def test_a_group_whose_world_size_changed_is_refused_at_start_naming_it_and_the_fix(restartable):
    restartable.kill()  # the changed start reads what the store holds
    changed = ServeProcess(overrides={"deployments": [_accumulators(gpu_ranks=1)]}, fresh=False,
                           state_path=restartable.state_location)
    with pytest.raises(RuntimeError) as refused:
        changed.start(timeout_s=300)
    message = str(refused.value)
    assert "group 'gpu_accumulator' of deployment 'accumulators'" in message
    assert "world size: stored 2, configured 1" in message
    assert "make serve-fresh" in message and "on_mismatch: reset" in message

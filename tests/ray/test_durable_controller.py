"""The controller's durable state on a real Ray cluster, with the controller in an actor
of its own, placed as Serve places a replica (bundle 0 of a placement group that holds
its workers' bundles too) and running the same GroupController, groups and store, so a
test can kill it: its workers are its child actors and die with it.

- Crash consistency: a controller killed right after every rank applied a call but
  before the store recorded it, and one killed right after the store recorded it but
  before the answer left; after recovery neither call is missing or counted twice, and
  retrying with its Idempotency-Key resolves it (both backends).
- Bounded recovery: after 5,000 acknowledged adds (through the controller, as the
  ingress sends them, without the HTTP hop: 64 callers at a time), a killed worker is
  replaced and the group is ready again within 10 s (a snapshot and a short tail), and
  the stored journal holds at most snapshot_every entries.

The groups have 2 ranks, not the tutorial's 4: on 2 cores that halves the time the adds
and the worker starts take, and the paths are the same.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridflow.config import StateConfig, load_config
from hybridflow.control.contract import CallRequest, CallResult
from hybridflow.control.durability import GroupDurability
from hybridflow.state.backends import open_store
from tests.ray.conftest import kill_rank
from tests.redis_server import start_redis

GPU_ACCUMULATOR = {
    "name": "gpu_accumulator",
    "worker": "single_controller.models.tutorial_workers:GPUAccumulator",
    "pool": {"process_on_nodes": [4]},
    "read_only": ["get_value"],
}
SCOPE = "accumulators/gpu_accumulator"
ADD = {"x": [1, 1]}


@ray.remote(num_cpus=0)
class ControllerHost:
    """A controller replica without Serve. With ``crash=(when, key)`` the call under
    Idempotency-Key ``key`` ends this process, as a SIGKILL would, right ``before`` (or
    ``after``) the state store records it: every rank has applied the call by then."""

    def __init__(self, state: dict[str, Any], crash: tuple[str, str] | None, ranks: int) -> None:
        self.config = service_config(state, ranks)
        if crash is not None:
            when, key = crash
            record = GroupDurability.record

            async def record_or_crash(durability, pending, result):
                if pending.idempotency_key == key and result.error is None and when == "before":
                    os._exit(1)
                await record(durability, pending, result)
                if pending.idempotency_key == key and when == "after":
                    os._exit(1)

            GroupDurability.record = record_or_crash

    async def start(self) -> None:
        from hybridflow.control.builder import PoolSet, units
        from hybridflow.control.controller import GroupController

        deployment, plan = self.config.deployments[0], plan_of(self.config)
        pools = PoolSet(plan, ray.util.get_current_placement_group())
        self.controller = GroupController(deployment, plan, units(deployment, plan, pools), state=self.config.state)
        await self.controller.open()
        await self.controller.start()
        self.health = asyncio.get_running_loop().create_task(self._check_health())

    async def _check_health(self) -> None:
        while True:  # as Serve's health check does (a FAILED rebuild is retried there)
            await asyncio.sleep(1)
            await self.controller.check_health()

    async def call(self, method: str, kwargs: dict | None = None, key: str | None = None) -> CallResult:
        fingerprint = None if key is None else f"{method}:{sorted((kwargs or {}).items())}"
        return await self.controller.call(CallRequest("gpu_accumulator", method, kwargs=kwargs or {},
                                                      idempotency_key=key, fingerprint=fingerprint))

    async def values(self) -> list[float]:
        result = await self.call("get_value")
        assert result.error is None, result.error
        return [t.item() for t in result.output]

    async def add_many(self, n: int, concurrency: int, kwargs: dict) -> dict[str, int]:
        """``n`` adds through the controller, ``concurrency`` at a time: how many got each
        answer ("acknowledged", or the error's message)."""
        answers: dict[str, int] = {}

        async def client(count: int) -> None:
            for _ in range(count):
                error = (await self.call("add", kwargs)).error
                answer = "acknowledged" if error is None else error.message
                answers[answer] = answers.get(answer, 0) + 1

        await asyncio.gather(*(client(n // concurrency + (i < n % concurrency)) for i in range(concurrency)))
        await self.controller.groups["gpu_accumulator"].durability.snapshots.settled()
        return answers

    async def summary(self) -> dict[str, Any]:
        summary = await self.controller.describe_group("gpu_accumulator")
        return {"status": summary.status, "replayed": summary.replayed_calls, "rebuilds": summary.rebuilds,
                "journal": summary.journal_length, "workers": [r["actor_name"] for r in summary.ranks or []]}


def service_config(state: dict[str, Any], ranks: int) -> Any:
    group = {**GPU_ACCUMULATOR, "pool": {"process_on_nodes": [ranks]}}
    return load_config({"deployments": [{"name": "accumulators", "groups": [group]}], "state": state})


def plan_of(config: Any) -> Any:
    from hybridflow.control.placement import GpuBudget, plan_deployment

    return plan_deployment(config.deployments[0], config, GpuBudget(ray.cluster_resources().get("GPU", 0)))


class Replica:
    """A ControllerHost in a placement group of its own, which goes when the host does
    (Serve removes a replica's placement group with it)."""

    def __init__(self, state: dict[str, Any], crash: tuple[str, str] | None = None, ranks: int = 2) -> None:
        bundles = plan_of(service_config(state, ranks)).replica_bundles()
        self.group = placement_group(bundles, strategy="STRICT_PACK")
        ray.get(self.group.ready(), timeout=60)
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=0)
        self.host = ControllerHost.options(scheduling_strategy=strategy).remote(state, crash, ranks)
        ray.get(self.host.start.remote(), timeout=180)

    def __getattr__(self, method: str) -> Any:
        return lambda *args: ray.get(getattr(self.host, method).remote(*args), timeout=600)

    def crash(self, *args: Any) -> None:
        """A call that ends the controller's process."""
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(self.host.call.remote(*args), timeout=60)
        self.remove()

    def remove(self) -> None:
        ray.kill(self.host)
        remove_placement_group(self.group)


def wait_gone(actor_names: list[str], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    for name in actor_names:
        while True:
            try:
                ray.get_actor(name)
            except ValueError:
                break
            assert time.monotonic() < deadline, f"worker {name} outlived its controller"
            time.sleep(0.2)


@pytest.fixture(params=["sqlite", "redis"])
def state(request, tmp_path) -> dict[str, Any]:
    if request.param == "sqlite":
        return {"path": str(tmp_path / "state.db")}
    server = start_redis(tmp_path)
    request.addfinalizer(server.stop)
    return {"redis_url": server.url}


def test_a_controller_killed_between_applied_and_acknowledged_loses_and_repeats_nothing(ray_cluster, state):
    replica = Replica(state, crash=("before", "crash-1"))
    start = replica.values()
    assert start == [0.0, 1.0]
    for i in range(5):
        assert replica.call("add", ADD, f"add-{i}").error is None
    workers = replica.summary()["workers"]

    # 1. Every rank applied it, the store never recorded it, no answer left.
    replica.crash("add", ADD, "crash-1")
    wait_gone(workers)  # the ranks that applied it die with their controller
    replica = Replica(state, crash=("after", "crash-2"))
    assert replica.values() == [v + 5 for v in start]  # not counted
    retried = replica.call("add", ADD, "crash-1")  # the client's retry applies it, once
    assert [t.item() for t in retried.output] == [v + 6 for v in start]
    assert replica.call("add", ADD, "crash-1").output[0].item() == start[0] + 6
    workers = replica.summary()["workers"]

    # 2. The store recorded it (with its answer), then the controller died before answering.
    replica.crash("add", ADD, "crash-2")
    wait_gone(workers)
    replica = Replica(state)
    assert replica.values() == [v + 7 for v in start]  # acknowledged: it counts
    retried = replica.call("add", ADD, "crash-2")  # the retry gets the first answer
    assert retried.error is None and [t.item() for t in retried.output] == [v + 7 for v in start]
    assert replica.values() == [v + 7 for v in start]  # and is not applied again
    other_body = replica.call("add", {"x": [2, 2]}, "crash-2")
    assert other_body.error is not None and other_body.error.kind.value == "idempotency_conflict"
    replica.remove()


def test_after_5000_adds_a_killed_worker_is_replaced_within_10s_from_a_snapshot(ray_cluster, tmp_path):
    """Five snapshots' worth of history: the rebuild replays the tail after the last one,
    not the history, so its time does not grow with the number of calls made."""
    every = StateConfig().snapshot_every
    state = {"path": str(tmp_path / "state.db")}
    replica = Replica(state)
    started = time.monotonic()
    assert replica.add_many(5_000, 64, ADD) == {"acknowledged": 5_000}
    adding_s = time.monotonic() - started
    stored = open_store(state["path"]).load(SCOPE)
    assert len(stored.entries) <= every and stored.snapshot_seq >= 5_000 - every
    assert replica.add_many(300, 8, ADD) == {"acknowledged": 300}  # a tail after the last snapshot
    assert len(open_store(state["path"]).load(SCOPE).entries) <= every
    assert replica.summary()["journal"] <= every

    killed = time.monotonic()
    kill_rank(ray.get_actor(replica.summary()["workers"][1]))
    assert replica.call("add", ADD).error.kind.value == "unavailable"  # noticed at once
    # checking (the failed call's ping of the ranks), then rebuilding, then ready
    while (summary := replica.summary())["status"] != "ready" or summary["rebuilds"] < 1:
        assert time.monotonic() - killed < 60, summary
        time.sleep(0.1)
    recovered_s = time.monotonic() - killed
    tail = open_store(state["path"]).load(SCOPE)
    print(f"5,300 adds in {adding_s:.1f} s; worker replaced and group ready in {recovered_s:.1f} s: snapshot at "
          f"{tail.snapshot_seq}, {summary['replayed']} calls replayed")
    assert summary["rebuilds"] == 1 and summary["replayed"] == len(tail.entries) >= 1
    assert recovered_s <= 10
    assert replica.values() == [rank + 5_300.0 for rank in range(2)]
    replica.remove()

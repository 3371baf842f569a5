"""`make cluster-test`: a two-node Ray cluster from the image (deploy/cluster.sh: a head
and a worker container on one Docker network, each with its own CPU count), the
application deployed with `serve deploy` and served on the head's port 8000.

Checks: both nodes joined; a pool declared over two nodes (`process_on_nodes: [2, 2]`)
has ranks on both node IDs with local ranks 0, 1 on each; the tutorial answers; stopping
the worker container (under load) and starting it again brings every group with ranks on
it back; and those a guarantee covers answer 503 with Retry-After meanwhile and lose no
acknowledged call. The journal covers a group whose controller outlives the node; the
durable state store (on a volume both nodes share) covers every group.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml

from single_controller.rendezvous import free_port
from tests.docker.support import IMAGE, ROOT, check_tutorial, container_logs, docker, wait_ready

NAME = f"hybridflow-clustertest-{os.getpid()}"
HEAD, WORKER = f"{NAME}-head", f"{NAME}-worker"
#: Logical CPUs. Ray places each replica's placement group on the node with the larger
#: share left, so a head twice the worker's size draws the controllers (and the spread
#: pool's controller) to the head, where they outlive the worker.
HEAD_CPUS, WORKER_CPUS = 4, 2
READY_TIMEOUT_S = 600
#: How long the worker's groups get to answer 503 after its container stops (Ray declares
#: a node dead after missing heartbeats for about 30 s).
OUTAGE_TIMEOUT_S = 120
#: How long the groups get to serve again after the worker's container starts again.
RECOVERY_TIMEOUT_S = 300
CALL_TIMEOUT_S = 20

#: The extra deployment the two-node check declares.
SPREAD = {
    "name": "spread",
    "groups": [
        {
            "name": "spread",
            "worker": "single_controller.models.tutorial_workers:GPUAccumulator",
            "pool": {"process_on_nodes": [2, 2]},
            "read_only": ["get_value"],
        }
    ],
}


def cluster_sh(*args: str, port: int = 0, timeout: float = 600) -> str:
    env = {**os.environ, "IMAGE": IMAGE, "NAME": NAME, "PORT": str(port),
           "HEAD_CPUS": str(HEAD_CPUS), "WORKER_CPUS": str(WORKER_CPUS)}
    result = subprocess.run([str(ROOT / "deploy" / "cluster.sh"), *args], env=env, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, f"cluster.sh {' '.join(args)}: {result.stdout}{result.stderr}"
    return result.stdout


def alive_nodes() -> list[dict[str, Any]]:
    listing = docker("exec", HEAD, "ray", "list", "nodes", "--format", "json", "--limit", "100").stdout
    return [node for node in json.loads(listing) if node["state"] == "ALIVE"]


def application_args(config: Path) -> dict[str, Any]:
    return yaml.safe_load(config.read_text())["applications"][0].get("args") or {}


def config_declaring_spread(tmp: Path) -> Path:
    """serve_config.yaml plus the two-node `spread` deployment, and an ingress replica per
    node (Serve spreads them), so HTTP keeps answering when the worker goes."""
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    args = config["applications"][0]["args"]
    args["deployments"].append(SPREAD)
    args["ingress_replicas"] = 2
    path = tmp / "serve_config.spread.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@dataclass
class Cluster:
    url: str
    client: httpx.Client
    args: dict[str, Any]  # the application's args as deployed


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    port = free_port()
    spread_config = config_declaring_spread(tmp_path_factory.mktemp("config"))
    try:
        started = time.monotonic()
        cluster_sh("up", port=port)
        print(f"\ncluster up in {time.monotonic() - started:.0f} s")
        cluster_sh("deploy", str(spread_config))
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=300) as client:

            def head_down() -> str | None:
                state = docker("inspect", "-f", "{{.State.Status}}", HEAD).stdout.strip()
                return None if state == "running" else f"head {state}:\n{container_logs(HEAD)}"

            waited = wait_ready(client, READY_TIMEOUT_S, head_down)
            print(f"/readyz 200 {waited:.0f} s after serve deploy")
            yield Cluster(url, client, application_args(spread_config))
    finally:
        cluster_sh("down")


def test_head_and_worker_joined_with_their_cpus(cluster):
    nodes = alive_nodes()
    cpus = sorted((node["is_head_node"], node["resources_total"].get("CPU")) for node in nodes)
    assert cpus == [(False, WORKER_CPUS), (True, HEAD_CPUS)], nodes


def test_a_pool_over_two_nodes_has_ranks_on_both(cluster):
    nodes = {node["node_id"] for node in alive_nodes()}
    detail = cluster.client.get("/v1/groups/spread").json()
    ranks = sorted(detail["ranks"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    first, second = ranks[0]["node_id"], ranks[2]["node_id"]
    assert [r["node_id"] for r in ranks] == [first, first, second, second]
    assert {first, second} == nodes and first != second
    assert [r["local_rank"] for r in ranks] == [0, 1, 0, 1]
    answer = cluster.client.post("/v1/groups/spread/add", json={"kwargs": {"x": [1, 1, 1, 1]}})
    assert answer.status_code == 200, answer.text
    assert [t["data"][0] for t in answer.json()["output"]] == [1, 2, 3, 4]


def test_the_tutorial_answers(cluster):
    check_tutorial(cluster.client)


# -- losing the worker node ------------------------------------------------------------------


@dataclass
class Outcome:
    at: float
    status: int | None  # None: no answer within CALL_TIMEOUT_S (in doubt)
    retry_after: str | None
    item: Any = None  # what a mutating call added


@dataclass
class Probe:
    """One group under load while the worker node goes and comes back: a call every
    half second (mutating where the group's state can be read back), every outcome kept."""

    group: str
    kind: str  # "history" (record/history), "count" (add 1 to every rank / get_value), "layer", "read"
    world_size: int
    read_method: str = ""
    layer_x: torch.Tensor | None = None
    outcomes: list[Outcome] = field(default_factory=list)

    def request(self, client: httpx.Client, n: int) -> tuple[httpx.Response, Any]:
        if self.kind == "history":
            item = f"{self.group}-{n}"
            return client.post(f"/v1/groups/{self.group}/record", json={"args": [item]}), item
        if self.kind == "count":
            x = [1] * self.world_size if self.world_size > 1 else 1
            body = {"kwargs": {"x": x}} if self.world_size > 1 else {"args": [1]}
            return client.post(f"/v1/groups/{self.group}/add", json=body), x
        if self.kind == "layer":
            return client.post("/v2/models/mlp/infer", json=layer_body(self.layer_x)), None
        return client.post(f"/v1/groups/{self.group}/{self.read_method}", json={}), None

    def run(self, url: str, stop: threading.Event) -> None:
        with httpx.Client(base_url=url, timeout=CALL_TIMEOUT_S) as client:
            n = 0
            while not stop.is_set():
                n += 1
                at = time.monotonic()
                try:
                    response, item = self.request(client, n)
                    self.outcomes.append(Outcome(at, response.status_code, response.headers.get("retry-after"), item))
                except httpx.HTTPError:
                    self.outcomes.append(Outcome(at, None, None, f"{self.group}-{n}" if self.kind == "history" else 1))
                time.sleep(0.5)

    def answered_503_after(self, t: float) -> bool:
        return any(o.at >= t and o.status == 503 and (o.retry_after or "").isdigit() for o in self.outcomes)

    def answering_after(self, t: float, count: int = 2) -> bool:
        """The last ``count`` calls since ``t`` had answers other than 503 (whether those
        answers are right is the state check's business)."""
        recent = [o for o in self.outcomes if o.at >= t][-count:]
        return len(recent) == count and all(o.status not in (None, 503) for o in recent)

    def statuses(self) -> str:
        """Statuses in order, runs collapsed: '200x12 503x4 200x9' (None: no answer)."""
        runs: list[list[Any]] = []
        for o in self.outcomes:
            if runs and runs[-1][0] == o.status:
                runs[-1][1] += 1
            else:
                runs.append([o.status, 1])
        return " ".join(f"{status}x{n}" for status, n in runs)


def layer_body(x: torch.Tensor) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.flatten().tolist()}]}


def read_state(client: httpx.Client, probe: Probe) -> Any:
    if probe.kind == "read":
        return None
    if probe.kind == "layer":
        response = client.post("/v2/models/mlp/infer", json=layer_body(probe.layer_x))
        assert response.status_code == 200, f"mlp infer: {response.status_code} {response.text[:300]}"
        return response.json()["outputs"][0]["data"]
    method = "history" if probe.kind == "history" else "get_value"
    response = client.post(f"/v1/groups/{probe.group}/{method}", json={})
    assert response.status_code == 200, f"{probe.group}.{method}: {response.status_code} {response.text[:300]}"
    output = response.json()["output"]
    if probe.kind == "history":
        return output
    return [t["data"][0] for t in output] if isinstance(output, list) else [output]


def probe_for(client: httpx.Client, group: str, detail: dict[str, Any]) -> Probe:
    methods = {m["name"] for m in detail["methods"]}
    world = detail["world_size"]
    if {"record", "history"} <= methods:
        return Probe(group, "history", world)
    if group == "accumulator" or detail.get("worker_class") == "GPUAccumulator":
        return Probe(group, "count", world)
    if group == "mlp":
        hidden = client.get("/v2/models/mlp").json()["inputs"][0]["shape"][-1]
        return Probe(group, "layer", world, layer_x=torch.rand(2, 1, hidden, generator=torch.Generator().manual_seed(5)))
    read = next(m for m in ("get_value", "history", "foo") if m in methods)
    return Probe(group, "read", world, read_method=read)


def check_no_acknowledged_call_lost(probe: Probe, before: Any, after: Any) -> str | None:
    """None when the state after holds every acknowledged call, in order, and nothing
    but acknowledged or in-doubt calls; else what is wrong."""
    acked = [o.item for o in probe.outcomes if o.status == 200]
    doubt = [o.item for o in probe.outcomes if o.status is None]
    if probe.kind == "history":
        for rank, (old, new) in enumerate(zip(before, after, strict=True)):
            added = new[len(old):]
            if new[: len(old)] != old:
                return f"rank {rank} lost history it had before the outage"
            kept = [item for item in added if item in acked]
            if kept != acked:
                return f"rank {rank}: acknowledged {len(acked)} records, {len(kept)} kept ({acked[:3]}... vs {added[:3]}...)"
            if any(item not in acked and item not in doubt for item in added):
                return f"rank {rank} holds records that were refused"
        return None
    if probe.kind == "count":
        for rank, (old, new) in enumerate(zip(before, after, strict=True)):
            if not len(acked) <= new - old <= len(acked) + len(doubt):
                return f"rank {rank}: {new - old:g} adds applied, {len(acked)} acknowledged ({len(doubt)} in doubt)"
        return None
    if probe.kind == "layer":
        diff = (torch.tensor(after) - torch.tensor(before)).abs().max().item()
        return None if diff <= 1e-5 else f"the layer answers differently after the outage (max diff {diff:.2e})"
    return None


def group_owners(args: dict[str, Any]) -> dict[str, str]:
    """Each group -> the deployment (the controller) that owns it."""
    return {g["name"]: d["name"] for d in args["deployments"] for g in d["groups"]}


def replica_nodes() -> dict[str, list[str]]:
    """Each Serve deployment of the application -> the nodes its replicas run on."""
    listing = docker("exec", HEAD, "ray", "list", "actors", "--format", "json", "--limit", "10000",
                     "--filter", "state=ALIVE").stdout
    prefix = "ServeReplica:hybridflow:"
    nodes: dict[str, list[str]] = {}
    for actor in json.loads(listing):
        if actor.get("class_name", "").startswith(prefix):
            nodes.setdefault(actor["class_name"][len(prefix):], []).append(actor["node_id"])
    return nodes


def durable_state_in_use(args: dict[str, Any]) -> str | None:
    """Where the controllers keep durable state that a replica restarted on the
    other node reaches: a Redis store the config names, or a state file the controllers
    have written on the volume both nodes mount; None where there is neither."""
    state = args.get("state") or {}
    if state.get("redis_url") or str(state.get("path") or "").startswith("redis://"):
        return state.get("redis_url") or state["path"]
    listing = docker("exec", HEAD, "find", "/home/hybridflow/app/.hybridflow", "-type", "f", "-size", "+0").stdout
    return listing.split()[0] if listing.split() else None


@dataclass
class WorkerLoss:
    """What happened to the groups with ranks on the worker node while it was stopped and
    started again. ``guaranteed``: the groups whose acknowledged calls must survive (and
    which must answer 503 meanwhile): their controller outlived the node (the journal's
    guarantee), or the controllers' state is durable."""

    probes: list[Probe]
    guaranteed: list[str]
    controller_lost: list[str]
    answered_503: dict[str, bool]
    recovered: bool
    problems: dict[str, str | None]  # group -> what was lost (None: nothing)


@pytest.fixture(scope="module")
def worker_loss(cluster) -> WorkerLoss:
    client = cluster.client
    worker_node = next(n["node_id"] for n in alive_nodes() if not n["is_head_node"])
    groups = [g["name"] for g in client.get("/v1/groups").json()["groups"]]
    details = {g: client.get(f"/v1/groups/{g}").json() for g in groups}
    affected = [g for g in groups if any(r.get("node_id") == worker_node for r in details[g]["ranks"])]
    placement = {g: sorted({(r.get("node_id") or "?")[:8] for r in details[g]["ranks"]}) for g in groups}
    print(f"\nworker node {worker_node[:8]}; ranks by node: {placement}")
    assert affected, f"no group has ranks on the worker node, nothing to check: {placement}"

    args = cluster.args
    owners, replicas = group_owners(args), replica_nodes()
    controller_lost = [g for g in affected if worker_node in replicas.get(owners.get(g, ""), [])]
    durable = durable_state_in_use(args)
    guaranteed = [g for g in affected if durable or g not in controller_lost]
    print(f"replicas by node: { {name: [n[:8] for n in nodes] for name, nodes in sorted(replicas.items())} }")
    print(f"controllers on the worker node: {sorted({owners.get(g) for g in controller_lost})}; "
          f"durable state: {durable}; guarantee covers: {guaranteed}")

    probes = [probe_for(client, g, details[g]) for g in affected]
    before = {p.group: read_state(client, p) for p in probes}
    stop = threading.Event()
    threads = [threading.Thread(target=p.run, args=(cluster.url, stop), daemon=True) for p in probes]
    for thread in threads:
        thread.start()
    try:
        time.sleep(5)  # acknowledged calls while both nodes are up
        stopped_at = time.monotonic()
        cluster_sh("stop-worker")
        watched = [p for p in probes if p.group in guaranteed]
        while watched and not all(p.answered_503_after(stopped_at) for p in watched):
            if time.monotonic() - stopped_at > OUTAGE_TIMEOUT_S:
                break
            time.sleep(1)
        if not watched:
            time.sleep(45)  # long enough for Ray to declare the node dead
        outage_s = time.monotonic() - stopped_at
        answered_503 = {p.group: p.answered_503_after(stopped_at) for p in probes}

        started_at = time.monotonic()
        cluster_sh("start-worker")
        recovered = False
        while time.monotonic() - started_at < RECOVERY_TIMEOUT_S:
            ready = client.get("/readyz", timeout=CALL_TIMEOUT_S).status_code == 200
            if ready and all(p.answering_after(started_at) for p in probes):
                recovered = True
                break
            time.sleep(2)
        recovery_s = time.monotonic() - started_at
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=CALL_TIMEOUT_S + 5)
    print(f"worker down {outage_s:.0f} s; groups answering {recovery_s:.0f} s after docker start")
    problems: dict[str, str | None] = {}
    for p in probes:
        try:
            problems[p.group] = check_no_acknowledged_call_lost(p, before[p.group], read_state(client, p))
        except AssertionError as exc:
            problems[p.group] = f"state unreadable: {exc}"
        print(f"  {p.group} ({p.kind}): {p.statuses()}; {problems[p.group] or 'nothing lost'}")
    return WorkerLoss(probes, guaranteed, controller_lost, answered_503, recovered, problems)


def test_losing_the_worker_node_then_starting_it_again_brings_every_group_back(worker_loss):
    assert worker_loss.recovered, f"not every group answering within {RECOVERY_TIMEOUT_S} s of starting the worker"


def test_groups_on_the_lost_node_answer_503_with_retry_after(worker_loss):
    if not worker_loss.guaranteed:
        pytest.skip(f"no guarantee covers this layout: the controllers of {worker_loss.controller_lost} ran on "
                    "the lost node and state is not durable")
    silent = [g for g in worker_loss.guaranteed if not worker_loss.answered_503[g]]
    assert not silent, f"no 503 with Retry-After within {OUTAGE_TIMEOUT_S} s of losing the worker: {silent}"


def test_no_acknowledged_call_is_lost(worker_loss):
    if not worker_loss.guaranteed:
        pytest.skip(f"no guarantee covers this layout: the controllers of {worker_loss.controller_lost} ran on "
                    "the lost node and state is not durable")
    lost = {g: worker_loss.problems[g] for g in worker_loss.guaranteed if worker_loss.problems[g]}
    assert not lost, f"acknowledged calls lost: {lost}"

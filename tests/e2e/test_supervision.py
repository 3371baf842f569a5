"""A group's supervision against a running service (an application of this project in the
session's cluster, whose groups of independent workers, ``examples.independent_workers:Tally``,
are declared as YAML declares them), driven as a user would, over HTTP with the token:

- ``replace_rank``: a rank SIGKILLed under concurrent mutating calls is replaced alone:
  only its process changes, every rank holds every acknowledged call exactly, and the
  event stream shows ``rank_lost`` then ``rank_replaced``;
- ``halt``: one kill fails the group naming the rank and its node, its calls get 503
  without ``Retry-After``, and ``POST /v1/admin/groups/{group}/restart`` brings it back
  with its state;
- the restart bound: workers that die in ``__init__`` after their first start halt their
  group after ``max_restarts``, the backoff between tries visible in the events' times;
- a Megatron group declared with ``replace_rank`` is refused at start, with the reason;
- the metrics count the restarts, replaced ranks, halts and time not ready of each group.

The application's settings shorten every wait: Serve's health check of the ingress (which
hosts the controllers) every second, a backoff of 1 s doubling to 2 s; the session's
cluster exports Ray's metrics every 2 s.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from hybridflow_client.python_client import SingleControllerClient
from tests.e2e.cluster import metrics_endpoints, scrape_until
from tests.e2e.conftest import application
from tests.serve_app import ServeApp, shipped_args

TOKEN = "supervision-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TALLY = "examples.independent_workers:Tally"
READ_ONLY = ["contents", "identity"]
BACKOFF = {"initial": 1, "max": 2}


def tally(name: str, ranks: int, supervision: dict, **extra) -> dict:
    return {"name": name, "worker": TALLY, "pool": {"process_on_nodes": [ranks], "name_prefix": name},
            "read_only": READ_ONLY, "supervision": supervision, **extra}


def test_a_megatron_group_with_replace_rank_is_refused_at_start(service):
    megatron = {"name": "layer", "worker": "single_controller.models.mlp_worker:MLPLayerWorker",
                "pool": {"process_on_nodes": [2]}, "megatron": {"tensor_model_parallel_size": 2},
                "supervision": {"on_rank_lost": "replace_rank"}}
    refused = ServeApp(service, "refused", {**shipped_args(), "deployments": [{"name": "layers", "groups": [megatron]}]})
    with pytest.raises(RuntimeError) as failed:  # the build refuses it: nothing is deployed
        refused.deploy()
    assert ("deployments[layers].groups[layer].supervision.on_rank_lost: replace_rank is refused: a Megatron "
            "group's ranks share process groups, which one new rank cannot join alone") in str(failed.value)
    assert not refused.deployed


@pytest.fixture(scope="module")
def supervised(service, tmp_path_factory):
    marks = tmp_path_factory.mktemp("marks")
    deployment = {"name": "supervised", "groups": [
        tally("replaced", 3, {"on_rank_lost": "replace_rank"}),
        tally("halted", 2, {"on_rank_lost": "halt"}),
        tally("bounded", 1, {"max_restarts": 2, "restart_window_s": 60, "backoff_s": BACKOFF},
              init_kwargs={"refuse_restart_in": str(marks)}),
    ]}
    app = application(service, "supervised", tmp_path_factory, deployments=[deployment], state={"snapshot_every": 5},
                      auth_token=TOKEN, health_check_period_s=1)
    try:
        yield app.start()
    finally:
        app.kill()


@pytest.fixture(scope="module")
def client(supervised):
    with httpx.Client(base_url=supervised.url, timeout=60, headers=AUTH) as http:
        yield http


def group(client: httpx.Client, name: str) -> dict:
    answer = client.get(f"/v1/groups/{name}")
    assert answer.status_code == 200, answer.text
    return answer.json()


def wait_status(client: httpx.Client, name: str, status: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = group(client, name)
        if found["status"] == status:
            return found
        time.sleep(0.2)
    raise AssertionError(f"{name} is {found['status']} ({found['last_error']}), not {status}")


def read(client: httpx.Client, name: str, method: str) -> list:
    answer = client.post(f"/v1/groups/{name}/{method}", json={})
    assert answer.status_code == 200, answer.text
    return answer.json()["output"]


def sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def group_events(url: str, name: str, until) -> list:
    """The group's kept events, read from the stream until ``until(events)`` holds (or the
    stream stays quiet for 5 s: every event asked for has happened by then)."""
    got: list = []
    with SingleControllerClient(url, token=TOKEN, timeout=5) as events_client:
        try:
            for event in events_client.events(group=name, since=0, reconnect=False):
                got.append(event)
                if until(got):
                    break
        except httpx.ReadTimeout:
            pass
    return got


def test_the_event_stream_needs_the_token(supervised, client):
    assert httpx.get(f"{supervised.url}/v1/events", timeout=10).status_code == 401
    unknown = client.get("/v1/events", params={"group": "nope"})
    assert unknown.status_code == 404 and "unknown group 'nope'" in unknown.json()["error"]


async def _records_while(url: str, count: int, kill_at: int, pid: int) -> list[tuple[str, int]]:
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=AUTH,
                                 limits=httpx.Limits(max_connections=count)) as http:
        sent = []
        for index in range(count):
            sent.append(asyncio.ensure_future(http.post("/v1/groups/replaced/record", json={"args": [f"r{index}"]})))
            if index == kill_at:
                sigkill(pid)
            await asyncio.sleep(0.01)
        answers = await asyncio.gather(*sent)
    return [(f"r{index}", answer.status_code) for index, answer in enumerate(answers)]


def test_a_rank_killed_under_concurrent_calls_is_replaced_alone(supervised, client):
    before = group(client, "replaced")["ranks"]
    outcomes = asyncio.run(_records_while(supervised.url, 60, 20, before[1]["pid"]))
    assert {status for _, status in outcomes} <= {200, 503}
    assert 503 in {status for _, status in outcomes}  # some met the lost rank: refused, never half-applied
    after = wait_status(client, "replaced", "ready")
    assert [a["pid"] == b["pid"] for a, b in zip(after["ranks"], before, strict=True)] == [True, False, True]
    assert after["replaced_ranks"] == 1 and after["rebuilds"] == 0 and after["restarts"] == 1
    acknowledged = sorted(item for item, status in outcomes if status == 200)
    held = [rank["records"] for rank in read(client, "replaced", "contents")]
    assert all(records == held[0] for records in held)  # one order on every rank, the new one too
    assert sorted(held[0]) == acknowledged  # every acknowledged call, once; nothing else
    events = group_events(supervised.url, "replaced", lambda got: any(e.kind == "rank_replaced" for e in got))
    kinds = [(e.kind, e.data.get("rank")) for e in events if e.kind in ("rank_lost", "rank_replaced")]
    assert kinds == [("rank_lost", 1), ("rank_replaced", 1)]
    lost = next(e for e in events if e.kind == "rank_lost")
    assert lost["node"] == before[1]["node_ip"] and lost.group == "replaced"


def test_halt_fails_the_group_until_an_operator_restarts_it(supervised, client):
    for item in ("h1", "h2"):
        assert client.post("/v1/groups/halted/record", json={"args": [item]}).status_code == 200
    ranks = group(client, "halted")["ranks"]
    sigkill(ranks[1]["pid"])
    failed = wait_status(client, "halted", "failed")
    assert failed["last_error"].startswith(f"rank 1 on node {ranks[1]['node_ip']} was lost (")
    refused = client.post("/v1/groups/halted/contents", json={})
    assert refused.status_code == 503 and "retry-after" not in refused.headers
    assert "rank 1 on node" in refused.json()["error"]
    assert client.get("/readyz").status_code == 200  # the group says so itself; the service serves
    restarted = client.post("/v1/admin/groups/halted/restart")
    assert restarted.status_code == 202 and restarted.json()["status"] == "rebuilding"
    wait_status(client, "halted", "ready")
    assert [rank["records"] for rank in read(client, "halted", "contents")] == [["h1", "h2"]] * 2
    events = group_events(supervised.url, "halted", lambda got: got[-1].kind == "group_status"
                          and got[-1]["status"] == "ready" and any(e.kind == "group_halted" for e in got))
    kinds = [e.kind for e in events]
    assert kinds.index("rank_lost") < kinds.index("group_halted")


def test_workers_that_die_in_init_halt_their_group_after_max_restarts(supervised, client):
    sigkill(group(client, "bounded")["ranks"][0]["pid"])
    failed = wait_status(client, "bounded", "failed")
    deadline = time.monotonic() + 120
    while not failed["last_error"].startswith("restarted 2 times in 60 s"):
        assert time.monotonic() < deadline, failed["last_error"]
        time.sleep(0.5)
        failed = group(client, "bounded")
    assert "refuses to start a second time" in failed["last_error"] and failed["restarts"] == 2
    events = group_events(supervised.url, "bounded", lambda got: got[-1].kind == "group_halted")
    statuses = [(e["status"], e.at) for e in events if e.kind == "group_status"]
    assert [s for s, _ in statuses] == ["ready", "rebuilding", "failed", "rebuilding", "failed"]
    # between a failed start and the next try: the backoff, 1 s, then doubled
    assert statuses[3][1] - statuses[2][1] >= BACKOFF["initial"] - 0.01
    assert events[-1].at - statuses[4][1] >= 2 * BACKOFF["initial"] - 0.01
    assert events[-1]["reason"].startswith("restarted 2 times in 60 s")


def test_the_metrics_count_restarts_replaced_ranks_halts_and_time_not_ready(supervised, client):
    """After the tests above (a module runs in order): what each group went through."""
    expected = {(name, metric): group(client, name)[field] for name in ("replaced", "bounded")
                for metric, field in (("restarts", "restarts"), ("replaced_ranks", "replaced_ranks"))}
    assert expected[("replaced", "replaced_ranks")] == 1 and expected[("bounded", "restarts")] == 2

    def shown(samples) -> bool:
        return all(samples.total(f"ray_hybridflow_group_{metric}_total", group=name) == value
                   for (name, metric), value in expected.items()) and all(
            samples.total("ray_hybridflow_group_halts_total", group=name) == 1 for name in ("halted", "bounded"))

    samples = scrape_until(metrics_endpoints(supervised), shown, application=supervised.app_name)
    # the bounded group has not been ready since its first rank was killed; the others were for a while
    assert samples.total("ray_hybridflow_group_unready_seconds_total", group="bounded") > 0
    assert samples.total("ray_hybridflow_group_unready_seconds_total", group="halted") > 0

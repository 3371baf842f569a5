"""Serve's health checks against a busy group, on the small service (health-checked
every 2 s, a check failing after 10 s, a worker lost after 5 s without a ping's answer):
a call that runs longer than a health check may take, and a queue of calls behind it,
neither make the group rebuild nor the replica restart."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.e2e.cluster import replicas
from tests.e2e.conftest import SMALL_HEALTH_CHECK_TIMEOUT_S

pytestmark = pytest.mark.own_cluster  # the small service: serve run in a cluster of its own

@pytest.fixture(scope="module")
def http(small_service):
    with httpx.Client(base_url=small_service.url, timeout=120) as client:
        yield client


async def _post_all(url: str, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=len(requests))) as c:
        return await asyncio.gather(*(c.post(path, json=body) for path, body in requests))


def test_a_call_longer_than_a_health_check_and_a_queue_behind_it_never_trip_it(small_service, http):
    """A busy worker is not a lost one: the pings Serve's health check sends wait behind the
    running call without the group being rebuilt, and calls waiting on the controller hold
    no thread the health check needs (the replica is not restarted either)."""
    seconds = SMALL_HEALTH_CHECK_TIMEOUT_S + 2
    group = http.get("/v1/groups/test_actor").json()
    replica = replicas(small_service, "ingress")  # the controllers live in the ingress
    assert replica != "[]"
    started = time.monotonic()
    responses = asyncio.run(_post_all(small_service.url, (
        [("/v1/groups/test_actor/sleep", {"kwargs": {"seconds": seconds}})]
        + [("/v1/groups/test_actor/sleep", {"kwargs": {"seconds": 0.01}})] * 80  # queued behind it
    )))
    assert time.monotonic() - started >= seconds
    assert [r.status_code for r in responses] == [200] * 81, [r.text for r in responses if r.status_code != 200][:3]
    assert responses[0].json()["output"] == [float(seconds)] * group["world_size"]
    after = http.get("/v1/groups/test_actor").json()
    assert after["rebuilds"] == group["rebuilds"] and after["status"] == "ready"
    assert replicas(small_service, "ingress") == replica

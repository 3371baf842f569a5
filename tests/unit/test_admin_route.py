"""``POST /v1/admin/groups/{group}/reset`` on the service's real app, over a backend
stand-in that records what it is asked: token-protected like every route, 404 for a
group the service does not serve (the backend's UNKNOWN_GROUP), 202 with the group."""

from __future__ import annotations

import httpx
import pytest

from hybridflow.control.contract import ControllerError, ErrorKind, GroupSummary, MethodSummary
from hybridflow.http.app import create_app
from hybridflow.http.settings import IngressSettings
from tests.unit.served_app import served

TOKEN = "s3cret"


class ResettingBackend:
    def __init__(self) -> None:
        self.resets: list[str] = []

    async def reset_group(self, group: str) -> GroupSummary | ControllerError:
        if group not in ("counter", "other"):
            return ControllerError(ErrorKind.UNKNOWN_GROUP, f"unknown group {group!r}")
        self.resets.append(group)
        return GroupSummary(
            name=group, deployment="d", world_size=2, resource_pool="pool [2]", worker_class="Counter",
            status="rebuilding", last_error=f"{group}: reset by an operator", rebuilds=0, replayed_calls=0,
            journal_length=0, methods=[MethodSummary("add", "ONE_TO_ALL", "ALL", True, False)],
        )


@pytest.fixture(scope="module")
def backend():
    return ResettingBackend()


@pytest.fixture(scope="module")
def url(backend):
    settings = IngressSettings(auth_token=TOKEN, groups={"counter": "d", "other": "d"})
    with served(create_app(backend, settings)) as base:
        yield base


def test_a_reset_needs_the_token_and_a_served_group(url, backend):
    with httpx.Client(base_url=url) as client:
        assert client.post("/v1/admin/groups/counter/reset").status_code == 401
        wrong = client.post("/v1/admin/groups/counter/reset", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]
        authorized = {"Authorization": f"Bearer {TOKEN}"}
        unknown = client.post("/v1/admin/groups/nope/reset", headers=authorized)
        assert unknown.status_code == 404 and "unknown group 'nope'" in unknown.json()["error"]
        assert backend.resets == []
        reset = client.post("/v1/admin/groups/counter/reset", headers=authorized)
    assert reset.status_code == 202, reset.text
    assert reset.json()["status"] == "rebuilding" and reset.json()["name"] == "counter"
    assert backend.resets == ["counter"]

"""The labels the controller's metrics carry, on a real controller whose groups never
started (no Ray): names a client makes up never become series, and every error kind is
counted under the status the ingress answers for it. (tests/e2e/test_observability.py
reads the exported series themselves.)"""

from __future__ import annotations

import asyncio

import pytest
import yaml

from hybridflow.config import load_config
from hybridflow.control import metrics
from hybridflow.control.contract import CallRequest, ControllerError, ErrorKind
from hybridflow.control.controller import GroupController
from hybridflow.control.placement import GpuBudget, plan_deployment
from hybridflow.http.errors import STATUS_OF
from tests.serve_process import CONFIG


@pytest.fixture(scope="module")
def controller():
    config = load_config(yaml.safe_load(CONFIG.read_text())["applications"][0]["args"])
    deployment = next(d for d in config.deployments if d.name == "test_actor")
    return GroupController(deployment, plan_deployment(deployment, config, GpuBudget(0)), [])


def test_labels_are_the_served_names_or_unknown(controller):
    assert metrics.call_labels(controller, CallRequest("test_actor", "foo")) == {"group": "test_actor", "method": "foo"}
    assert metrics.call_labels(controller, CallRequest("test_actor", "x" * 50)) == {
        "group": "test_actor", "method": "(unknown)"}
    assert metrics.call_labels(controller, CallRequest("elsewhere", "foo")) == {
        "group": "(unknown)", "method": "(unknown)"}


def test_every_error_kind_is_counted_under_its_http_status():
    metrics.use_status_codes({kind.value: status for kind, status in STATUS_OF.items()})
    assert metrics.outcome(None) == {"kind": "ok", "code": "200"}
    for kind in ErrorKind:
        assert metrics.outcome(ControllerError(kind, "")) == {"kind": kind.value, "code": str(STATUS_OF[kind])}
    assert metrics.outcome(ControllerError(ErrorKind.UNAVAILABLE, "")) == {"kind": "unavailable", "code": "503"}


def test_a_call_leaves_nothing_in_flight_however_it_ends(controller):
    async def scenario():
        starting = await controller.call(CallRequest("test_actor", "foo", kwargs={"y": 1}))
        unknown = await controller.call(CallRequest("test_actor", "nope"))
        return starting, unknown

    starting, unknown = asyncio.run(scenario())
    assert starting.error.kind is ErrorKind.UNAVAILABLE and unknown.error.kind is ErrorKind.UNKNOWN_METHOD
    running = metrics._metrics().running
    assert running[("test_actor", "foo")] == 0 and running[("test_actor", "(unknown)")] == 0


def test_replayed_calls_pass_through_and_snapshot_ages_are_kept(controller):
    assert metrics.calls_replayed("test_actor", 3) == 3 and metrics.calls_replayed("test_actor", 0) == 0
    metrics.snapshot_taken("test_actor", taken_at=1000.0)
    metrics.sample_groups(controller)  # the health check's refresh of the gauges
    assert metrics._metrics().snapshots == {"test_actor": 1000.0}

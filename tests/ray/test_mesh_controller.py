"""Mesh-dispatched methods through the controller (no Serve): a mesh's first call asks
the ranks off the event loop, a method dispatched by a mesh the ranks never declared is
the caller's error with nothing journaled, and describe_group shows the meshes (none for
a plain actor)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.control.builder import PoolSet, units
from hybridflow.control.contract import CallRequest, ErrorKind
from hybridflow.control.controller import GroupController
from hybridflow.control.placement import GpuBudget, plan_deployment
from single_controller.protocol import DataProto

GROUPS = [{"name": "mesh", "worker": "tests.ray.mesh_workers:MeshDoubler",
           "pool": {"process_on_nodes": [4], "name_prefix": "meshctl"}, "read_only": ["double"]},
          {"name": "plain", "worker": "single_controller.models.tutorial_workers:Accumulator", "plain_actor": True,
           "read_only": ["get_value"]}]


@pytest.fixture(scope="module")
def controller(ray_cluster, loop):
    config = load_config({"deployments": [{"name": "meshes", "groups": GROUPS}]})
    deployment = config.deployments[0]
    plan = plan_deployment(deployment, config, GpuBudget(0))
    pools = PoolSet(plan)
    made = GroupController(deployment, plan, units(deployment, plan, pools), request_timeout_s=60)
    asyncio.run_coroutine_threadsafe(made.start(), loop).result(timeout=300)
    yield made
    made.shutdown()
    pools.remove()


def run(loop, coro):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=120)


def test_a_meshs_first_call_asks_the_ranks_off_the_event_loop(loop, controller, monkeypatch):
    group = controller.groups["mesh"].group
    assert group.meshes(cached=True) == {}
    asked: list[threading.Thread] = []
    mesh_layout = group.mesh_layout

    def recorded(name):
        asked.append(threading.current_thread())
        return mesh_layout(name)

    monkeypatch.setattr(group, "mesh_layout", recorded)
    data = DataProto.from_dict({"x": torch.tensor([1.0, 2.0, 3.0, 4.0])})
    result = run(loop, controller.call(CallRequest("mesh", "double", kwargs={"data": data})))
    assert result.ok, result.error
    assert result.output.batch["x"].tolist() == [2.0, 4.0, 6.0, 8.0]
    assert result.output.batch["who"].tolist() == [0, 0, 2, 2]
    loop_thread = run(loop, _current_thread())
    assert asked and asked[0] is not loop_thread  # the ranks were asked from a thread of their own
    assert group.meshes(cached=True)["actor"].collect_ranks == [0, 2]


async def _current_thread() -> threading.Thread:
    return threading.current_thread()


def test_a_method_dispatched_by_an_undeclared_mesh_is_the_callers_error(loop, controller):
    state = controller.groups["mesh"]
    journal = len(state.journal)
    data = DataProto.from_dict({"x": torch.ones(4)})
    result = run(loop, controller.call(CallRequest("mesh", "elsewhere", kwargs={"data": data})))
    assert result.error.kind is ErrorKind.BAD_ARGUMENTS and "undeclared" in result.error.message
    assert len(state.journal) == journal and state.status == "ready"


def test_describe_group_shows_each_meshs_dp_size_and_collecting_ranks(loop, controller):
    summary = run(loop, controller.describe_group("mesh"))
    assert summary.meshes == {"actor": {"dp_size": 2, "collect_ranks": [0, 2]}}
    assert "_query_meshes" not in controller.groups["mesh"].methods
    plain = run(loop, controller.describe_group("plain"))  # a plain actor declares no mesh, and that is no error
    assert plain.meshes is None and plain.last_error is None

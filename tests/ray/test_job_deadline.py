"""A job whose call passes its deadline, in the layout with the controllers inside the
ingress: the jobs deployment's logic (its class, without Serve) reaches the controllers
as the ingress hands them over (``Controllers.call``), and the job ends ``failed`` as a
timeout, 504 to the API, never as an unknown group."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hybridflow.config import load_config
from hybridflow.control.contract import CallRequest
from hybridflow.control.controllers import Controllers
from hybridflow.control.placement import GpuBudget, plan_deployment
from hybridflow.http.routes.jobs import public
from hybridflow.serve.jobs import JobsDeployment

ARGS = {
    "request_timeout_s": 1,
    "deployments": [{"name": "slow", "groups": [
        {"name": "sleeper", "worker": "examples.transport_check:TransportCheckActor", "init_kwargs": {"x": 2},
         "pool": {"process_on_nodes": [2], "name_prefix": "sleeper"}, "read_only": ["sleep"]}]}],
    "state": {"path": None},
}


def run_jobs(fence_s: float, seconds: float) -> dict:
    """One job calling ``sleeper.sleep(seconds)``, while the group's fence (a weight sync's
    commit holds it) stays closed for ``fence_s``: the job as the API shows it."""
    config = load_config(ARGS)
    deployment = config.deployments[0]
    plan = plan_deployment(deployment, config, GpuBudget(0))
    service = config.model_dump(mode="json", exclude={"deployments"})

    async def scenario() -> dict:
        controllers = Controllers.build([deployment.model_dump(mode="json")], [plan], service)
        await controllers.begin()
        while not (await controllers.ready())["sleeper"]:
            await asyncio.sleep(0.2)
        # the ingress's call, as the jobs deployment reaches it through its handle
        ingress = SimpleNamespace(call=SimpleNamespace(remote=controllers.call))
        jobs = JobsDeployment.func_or_class({"slow": ingress}, {"sleeper": ["sleep"]}, config.limits.model_dump())
        fence = controllers.group_owner["sleeper"].groups["sleeper"].fence

        async def hold() -> None:
            async with fence.held():
                await asyncio.sleep(fence_s)

        holding = asyncio.ensure_future(hold())
        await asyncio.sleep(0)
        try:
            job = await jobs.submit("slow", CallRequest("sleeper", "sleep", kwargs={"seconds": seconds}))
            while (await jobs.status(job["id"]))["status"] in ("queued", "running"):
                await asyncio.sleep(0.1)
            return public(await jobs.status(job["id"]))
        finally:
            await holding
            controllers.shutdown()

    return asyncio.run(scenario())


def test_a_job_past_the_deadline_on_the_ranks_is_a_failed_timeout(ray_cluster):
    final = run_jobs(fence_s=0, seconds=3)
    assert (final["status"], final["error_kind"], final["status_code"]) == ("failed", "timeout", 504), final
    assert "did not finish within 1 s" in final["error"]


def test_a_job_waiting_behind_a_weight_sync_past_the_deadline_is_a_failed_timeout(ray_cluster):
    final = run_jobs(fence_s=4, seconds=0)
    assert (final["status"], final["error_kind"], final["status_code"]) == ("failed", "timeout", 504), final
    assert "waited 1 s for a weight sync" in final["error"]

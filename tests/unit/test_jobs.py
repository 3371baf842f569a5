"""The jobs deployment's class, without Serve: its calls go to a controller stand-in at
the handle boundary (``handle.call.remote(request)``) that holds every call until the test
lets it go and records what it was asked. A job cancelled while it waits for a slot lets
go of its place and its tensors at once, the jobs listed stay bounded, and an
Idempotency-Key gives a repeat the first job and carries on to the controller's call."""

from __future__ import annotations

import asyncio
import gc
import weakref
from types import SimpleNamespace

import torch

from hybridflow.control.contract import CallRequest, CallResult, ControllerError, ErrorKind
from hybridflow.serve.jobs import JobsDeployment
from tests.unit.fresh_interpreter import assert_fresh_python_prints_ok

Jobs = JobsDeployment.func_or_class


class HeldController:
    """Answers a call with its first argument once :attr:`release` is set."""

    def __init__(self) -> None:
        self.requests: list[CallRequest] = []
        self.release = asyncio.Event()
        self.call = SimpleNamespace(remote=self._call)

    async def _call(self, request: CallRequest) -> CallResult:
        self.requests.append(request)
        await self.release.wait()
        return CallResult(output=request.args[0] if request.args else None)


def run(coro):
    return asyncio.run(coro)


def jobs_with(controller: HeldController, **limits) -> Jobs:
    return Jobs({"d": controller}, {"g": ["read"]}, {"jobs_running": 1, "jobs_queued": 2, "jobs_kept": 5, **limits})


async def turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_job_cancelled_in_the_queue_lets_go_of_its_place_and_its_tensors():
    async def scenario():
        controller = HeldController()
        jobs = jobs_with(controller)
        running = await jobs.submit("d", CallRequest("g", "write", [torch.ones(4)]))
        await turns()
        held = []
        for _ in range(200):
            tensor = torch.zeros(1 << 12)
            held.append(weakref.ref(tensor))
            job = await jobs.submit("d", CallRequest("g", "write", [tensor]))
            del tensor
            assert not isinstance(job, ControllerError), job  # a cancelled job no longer holds a place
            assert (await jobs.cancel(job["id"]))["status"] == "cancelled"
        await turns()
        gc.collect()
        alive = sum(ref() is not None for ref in held)
        listed = await jobs.list_jobs()
        # the queue takes two more, then refuses
        queued = [await jobs.submit("d", CallRequest("g", "write", [i])) for i in range(3)]
        controller.release.set()
        await turns(20)
        return running, alive, listed, queued, await jobs.status(running["id"]), len(controller.requests)

    running, alive, listed, queued, status, calls = run(scenario())
    assert alive == 0
    assert len(listed) <= 1 + 2 + 5 and sum(job["status"] == "cancelled" for job in listed) == 5
    assert [isinstance(job, ControllerError) for job in queued] == [False, False, True]
    assert queued[2].kind is ErrorKind.OVER_LIMIT
    assert status["status"] == "succeeded"
    assert calls == 3  # the cancelled jobs never reached the controller


def test_an_idempotency_key_gives_a_repeat_the_first_job():
    async def scenario():
        controller = HeldController()
        jobs = jobs_with(controller)
        first = await jobs.submit("d", CallRequest("g", "write", [1], {}, "key-1", "body-1"))
        repeat = await jobs.submit("d", CallRequest("g", "write", [1], {}, "key-1", "body-1"))
        other_body = await jobs.submit("d", CallRequest("g", "write", [2], {}, "key-1", "body-2"))
        other_method = await jobs.submit("d", CallRequest("g", "read", [2], {}, "key-1", "body-2"))
        controller.release.set()
        await turns(20)
        after = await jobs.submit("d", CallRequest("g", "write", [1], {}, "key-1", "body-1"))
        return first, repeat, other_body, other_method, after, controller.requests

    first, repeat, other_body, other_method, after, requests = run(scenario())
    assert repeat["id"] == first["id"] and after["id"] == first["id"] and after["status"] == "succeeded"
    assert isinstance(other_body, ControllerError) and other_body.kind is ErrorKind.IDEMPOTENCY_CONFLICT
    assert "different request body" in other_body.message
    assert other_method["id"] != first["id"]  # a key is per group and method, as on calls
    # the job's call carries the key on: the controller applies it once, even for a repeat
    # that arrives after this deployment restarted
    assert [(r.method, r.idempotency_key, r.fingerprint) for r in requests] == [
        ("write", "key-1", "body-1"), ("read", "key-1", "body-2")]


def test_split_pieces_and_forgotten_jobs_leave_no_keys_behind():
    async def scenario():
        controller = HeldController()
        controller.release.set()
        jobs = jobs_with(controller, jobs_kept=1)
        rows = torch.arange(8.0).reshape(4, 2)
        split = await jobs.submit("d", CallRequest("g", "read", [[rows]], {}, "key-s", "body-s"), split=2)
        await turns(20)
        for i in range(3):
            await jobs.submit("d", CallRequest("g", "write", [i], {}, f"key-{i}", f"body-{i}"))
            await turns(20)
        return split, controller.requests, jobs._keys, len(jobs.jobs)

    split, requests, keys, kept = run(scenario())
    assert split["split"] == 2
    assert [r.idempotency_key for r in requests[:2]] == [None, None]  # pieces of a read-only method
    assert kept == 1 and list(keys) == [("g", "write", "key-2")]


def test_the_jobs_replica_starts_without_torch():
    # Its replica starts beside the ingress at every cold start; torch comes with the first
    # job that carries tensors (unpickling them imports it) or splits.
    assert_fresh_python_prints_ok(
        "import sys, hybridflow.serve.jobs; "
        "loaded = [m for m in ('torch', 'hybridflow.wire.split') if m in sys.modules]; "
        "assert not loaded, f'the jobs module loaded {loaded}'; print('ok')"
    )

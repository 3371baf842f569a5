"""Long calls as jobs: a call submitted here answers at once with an id and runs in the
background; its state (status, progress, result) lives in this deployment, outside the
ingress, so it survives an ingress replica restarting.

A job may ``split`` its input: every tensor of its dp-list argument (as MEGATRON_COMPUTE
takes) is cut into that many pieces along dim 0, the pieces run one
after another (progress = pieces done / pieces) and the outputs are concatenated along
dim 0. Only for methods whose output rows depend on their input rows alone, such as the
MLP layer (position-wise over seq).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
from ray import serve

from wire.split import split_call

#: Finished jobs kept (oldest results dropped first).
MAX_FINISHED_JOBS = 100


@dataclass
class Job:
    id: str
    group: str
    method: str
    controller: str
    split: int
    status: str = "queued"  # queued | running | succeeded | failed | cancelled
    progress: float = 0.0
    error: str | None = None
    status_code: int | None = None
    submitted_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    outcome: dict[str, Any] | None = None
    task: asyncio.Task | None = None

    def describe(self) -> dict[str, Any]:
        now = time.time()
        return {
            "id": self.id,
            "group": self.group,
            "method": self.method,
            "status": self.status,
            "progress": round(self.progress, 4),
            "split": self.split,
            "error": self.error,
            "status_code": self.status_code,
            "submitted_at": self.submitted_at,
            "elapsed_s": round((self.finished_at or now) - (self.started_at or now), 3),
        }


def join_outputs(outputs: list[Any]) -> Any:
    """Concatenate the pieces' outputs (lists of tensors, one per dp rank) along dim 0."""
    if len(outputs) == 1:
        return outputs[0]
    return [torch.cat([piece[i] for piece in outputs], dim=0) for i in range(len(outputs[0]))]


@serve.deployment(name="jobs", max_ongoing_requests=256, ray_actor_options={"num_cpus": 0.05})
class JobsDeployment:
    def __init__(self, controllers: dict[str, Any]) -> None:
        self.controllers = controllers
        self.jobs: dict[str, Job] = {}

    async def submit(
        self, controller: str, group: str, method: str, args: list, kwargs: dict, split: int = 1
    ) -> dict[str, Any]:
        try:
            pieces = split_call(args, kwargs, split)
        except ValueError as exc:  # answered as a 422 before anything is queued
            return {"error": str(exc)}
        job = Job(id=uuid.uuid4().hex, group=group, method=method, controller=controller, split=split)
        self.jobs[job.id] = job
        job.task = asyncio.get_running_loop().create_task(self._run(job, pieces))
        self._forget_old()
        return job.describe()

    async def _run(self, job: Job, pieces: list[tuple[list, dict]]) -> None:
        job.status, job.started_at = "running", time.time()
        handle = self.controllers[job.controller]
        outputs = []
        try:
            for index, (args, kwargs) in enumerate(pieces):
                outcome = await handle.handle_call.remote(job.group, job.method, args, kwargs, None)
                if outcome["status"] >= 400:
                    job.status, job.error, job.status_code = "failed", outcome["error"], outcome["status"]
                    return
                outputs.append(outcome["output"])
                job.progress = (index + 1) / len(pieces)
            outcome["output"] = join_outputs(outputs)
            job.outcome = outcome
            job.status, job.status_code = "succeeded", 200
        except asyncio.CancelledError:
            job.status = "cancelled"
        except Exception as exc:  # keep the job record; report what happened
            job.status, job.error, job.status_code = "failed", f"{type(exc).__name__}: {exc}", 500
        finally:
            job.finished_at = time.time()
            job.task = None

    def _forget_old(self) -> None:
        finished = [j for j in self.jobs.values() if j.finished_at is not None]
        for job in sorted(finished, key=lambda j: j.finished_at)[:-MAX_FINISHED_JOBS]:
            self.jobs.pop(job.id, None)

    async def status(self, job_id: str) -> dict[str, Any] | None:
        job = self.jobs.get(job_id)
        return None if job is None else job.describe()

    async def result(self, job_id: str) -> dict[str, Any] | None:
        job = self.jobs.get(job_id)
        if job is None:
            return None
        return {"job": job.describe(), "outcome": job.outcome}

    async def cancel(self, job_id: str) -> dict[str, Any] | None:
        job = self.jobs.get(job_id)
        if job is None:
            return None
        if job.task is not None:
            job.task.cancel()
            try:
                await job.task
            except asyncio.CancelledError:
                pass
            job.status = "cancelled"
        return job.describe()

    async def list_jobs(self) -> list[dict[str, Any]]:
        return [job.describe() for job in self.jobs.values()]

"""Long calls as jobs: a call submitted here answers at once with an id and runs in the
background; its state (status, progress, result) lives in this deployment, outside the
ingress, so it survives an ingress replica restarting.

A job may ``split`` its input: every tensor of its dp-list argument (as MEGATRON_COMPUTE
takes) is cut into that many pieces along dim 0, the pieces run one after another
(progress = pieces done / pieces) and the outputs are concatenated along dim 0. Only for
read-only methods whose output rows depend on their input rows alone, such as the MLP
layer: a mutating method's pieces would be applied in part when a piece fails or the job
is cancelled. Cancelling ends the job at once and starts no further piece; a call already
on the workers finishes there and, when it changes state, is journaled like any
acknowledged call (the controller settles it whoever stopped waiting). A job cancelled
while it waits for a slot lets go of its place in the queue and of its arguments at once.

With an ``Idempotency-Key``, a repeat of a job with the same body (and split) gets the
first job, and the same key with another body is refused; the job's call carries the key
to the controller, so even a repeat that arrives after this deployment restarted (or after
the job was forgotten) is not applied twice: it gets the first call's answer.

Bounded: ``jobs_running`` at once, ``jobs_queued`` waiting (more are refused), and the
finished ones (cancelled ones too) kept by count and by their results' bytes, oldest
dropped first; the jobs listed are never more than those three bounds together.

Each change of a job's status is a ``job`` event (``GET /v1/events``), sent in order to the
controller that owns its group, which numbers it among its groups' events; at most
:data:`EVENTS_WAITING` wait to be sent (more are dropped: the jobs never wait for events).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ray import serve

from hybridflow.config import LimitsConfig
from hybridflow.control.contract import CallRequest, CallResult, ControllerError, ErrorKind, first_line
from hybridflow.state.idempotency import estimate_bytes
from hybridflow_client.wire.errors import WireError

if TYPE_CHECKING:
    from hybridflow.wire.split import SplitCall

#: Job events waiting to be sent to their controllers.
EVENTS_WAITING = 1000


@dataclass
class Job:
    id: str
    request: CallRequest
    controller: str
    split: int
    status: str = "queued"  # queued | running | succeeded | failed | cancelled
    progress: float = 0.0
    error: str | None = None
    error_kind: str | None = None
    cancel_requested: bool = False
    submitted_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    outcome: CallResult | None = None
    result_bytes: int = 0
    task: asyncio.Task | None = None
    #: (group, method, Idempotency-Key) when the job was submitted with one.
    key: tuple[str, str, str] | None = None
    #: The status its latest event told.
    told: str | None = None

    def describe(self) -> dict[str, Any]:
        now = time.time()
        return {
            "id": self.id,
            "group": self.request.group,
            "method": self.request.method,
            "status": self.status,
            "progress": round(self.progress, 4),
            "split": self.split,
            "error": self.error,
            "error_kind": self.error_kind,
            "cancel_requested": self.cancel_requested,
            "submitted_at": self.submitted_at,
            "elapsed_s": round((self.finished_at or now) - (self.started_at or now), 3),
        }


def join_outputs(outputs: list[Any]) -> Any:
    """Concatenate the pieces' outputs (lists of tensors, one per dp rank) along dim 0."""
    if len(outputs) == 1:
        return outputs[0]
    import torch  # loaded already: the outputs are tensors (the replica starts without torch)

    return [torch.cat([piece[i] for piece in outputs], dim=0) for i in range(len(outputs[0]))]


@serve.deployment(name="jobs", max_ongoing_requests=256, ray_actor_options={"num_cpus": 0.05})
class JobsDeployment:
    def __init__(
        self, controllers: dict[str, Any] | None, read_only: dict[str, list[str]], limits: dict[str, Any] | None = None
    ) -> None:
        self.controllers = controllers
        self.read_only = {group: set(methods) for group, methods in read_only.items()}
        self.limits = LimitsConfig.model_validate(limits or {})
        self.jobs: dict[str, Job] = {}
        #: Idempotency-Key -> (body fingerprint and split, job id), for the jobs kept.
        self._keys: dict[tuple[str, str, str], tuple[str | None, str]] = {}
        self._slots = asyncio.Semaphore(self.limits.jobs_running)
        #: (controller, group, fields) of the job events not sent yet, and their sender.
        self._events: asyncio.Queue[tuple[str, str, dict[str, Any]]] | None = None
        self._sender: asyncio.Task | None = None

    async def submit(self, controller: str, request: CallRequest, split: int = 1) -> dict[str, Any] | ControllerError:
        key = fingerprint = None
        if request.idempotency_key is not None:
            key = (request.group, request.method, request.idempotency_key)
            fingerprint = None if request.fingerprint is None else f"{request.fingerprint}/split={split}"
            earlier = self._repeat(key, fingerprint)
            if earlier is not None:
                return earlier
        if split > 1 and request.method not in self.read_only.get(request.group, set()):
            return ControllerError(
                ErrorKind.BAD_ARGUMENTS,
                f"split runs pieces one after another: only read-only methods may be split, and "
                f"{request.group}.{request.method} changes state",
            )
        from hybridflow.wire.split import split_call  # with torch, which the replica starts without

        try:
            pieces = split_call(request.args, request.kwargs, split, self.limits.wire())
        except WireError as exc:
            return ControllerError(ErrorKind.BAD_ARGUMENTS, str(exc))
        queued = sum(1 for job in self.jobs.values() if job.status == "queued")
        if queued >= self.limits.jobs_queued:
            return ControllerError(
                ErrorKind.OVER_LIMIT, f"{queued} jobs are waiting already; retry later", retry_after_s=5.0
            )
        job = Job(id=uuid.uuid4().hex, request=request, controller=controller, split=split, key=key)
        self.jobs[job.id] = job
        if key is not None:
            self._keys[key] = (fingerprint, job.id)
        job.task = asyncio.get_running_loop().create_task(self._run(job, pieces))
        self._tell(job)
        return job.describe()

    def _repeat(self, key: tuple[str, str, str], fingerprint: str | None) -> dict[str, Any] | ControllerError | None:
        """The job first submitted under this key (None: none kept), or the refusal of
        another body under it."""
        earlier = self._keys.get(key)
        if earlier is None or earlier[1] not in self.jobs:
            return None
        if earlier[0] is not None and fingerprint is not None and earlier[0] != fingerprint:
            return ControllerError(
                ErrorKind.IDEMPOTENCY_CONFLICT,
                f"Idempotency-Key {key[2]!r} was used with a different request body (or split) for job {earlier[1]}",
            )
        return self.jobs[earlier[1]].describe()

    async def _run(self, job: Job, pieces: SplitCall) -> None:
        try:
            async with self._slots:
                if job.cancel_requested:
                    return
                job.status, job.started_at = "running", time.time()
                self._tell(job)
                await self._run_pieces(job, pieces)
        except asyncio.CancelledError:
            job.status = "cancelled"
        except Exception as exc:  # keep the job record; say what happened, no traceback
            job.status, job.error = "failed", f"{type(exc).__name__}: {first_line(exc)}"
            job.error_kind = ErrorKind.UNAVAILABLE.value
        finally:
            self._finish(job)

    async def _run_pieces(self, job: Job, pieces: SplitCall) -> None:
        handle = self._controller(job.controller)
        request, outputs, outcome = job.request, [], None
        for index, (args, kwargs) in enumerate(pieces):
            # A whole call keeps the job's key: the controller applies it once, whoever repeats it.
            keyed = (request.idempotency_key, request.fingerprint) if job.split == 1 else (None, None)
            outcome = await handle.call.remote(
                CallRequest(request.group, request.method, args, kwargs, *keyed, operation=request.operation)
            )
            if outcome.error is not None:
                job.status, job.error = "failed", outcome.error.message
                job.error_kind = outcome.error.kind.value
                return
            outputs.append(outcome.output)
            job.progress = (index + 1) / job.split
        outcome.output = join_outputs(outputs)
        job.outcome, job.result_bytes = outcome, estimate_bytes(outcome.output)
        job.status = "succeeded"

    def _finish(self, job: Job) -> None:
        """A job ends (done, failed, or cancelled, queued or running): it lets go of its
        arguments and task, and the oldest finished jobs past the bounds go."""
        if job.finished_at is None:
            job.finished_at = time.time()
        self._tell(job)
        job.task = None
        job.request = CallRequest(job.request.group, job.request.method)  # its tensors are no longer needed
        self._forget_old()

    def _tell(self, job: Job) -> None:
        """A ``job`` event for the job's status, unless its latest already told it."""
        if job.told == job.status:
            return
        job.told = job.status
        if self._events is None:
            self._events = asyncio.Queue(EVENTS_WAITING)
        if not self._events.full():
            self._events.put_nowait((job.controller, job.request.group, {"job_id": job.id, "status": job.status}))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(self._send_events())

    async def _send_events(self) -> None:
        """Send the waiting job events one at a time, so each controller gets them in order."""
        while self._events is not None and not self._events.empty():
            controller, group, fields = self._events.get_nowait()
            try:
                await self._controller(controller).publish_event.remote("job", group, fields)
            except Exception:  # the controller is restarting: events are not worth a job's wait
                pass

    def _controller(self, name: str) -> Any:
        """The handle that runs ``name``'s calls: its controller replica's, or, where the
        ingress hosts the controllers (``controllers`` is None), the ingress's."""
        if self.controllers is None:
            self.controllers = {}
        if name not in self.controllers:
            self.controllers[name] = serve.get_deployment_handle("ingress", serve.get_replica_context().app_name)
        return self.controllers[name]

    def _forget_old(self) -> None:
        finished = sorted((j for j in self.jobs.values() if j.finished_at is not None), key=lambda j: j.finished_at)
        kept_bytes = sum(j.result_bytes for j in finished)
        while finished and (len(finished) > self.limits.jobs_kept or kept_bytes > self.limits.jobs_result_bytes):
            old = finished.pop(0)
            kept_bytes -= old.result_bytes
            self.jobs.pop(old.id, None)
            if old.key is not None and self._keys.get(old.key, (None, None))[1] == old.id:
                del self._keys[old.key]

    async def status(self, job_id: str) -> dict[str, Any] | None:
        job = self.jobs.get(job_id)
        return None if job is None else job.describe()

    async def result(self, job_id: str) -> dict[str, Any] | None:
        job = self.jobs.get(job_id)
        return None if job is None else {"job": job.describe(), "outcome": job.outcome}

    async def cancel(self, job_id: str) -> dict[str, Any] | None:
        """End the job: no further piece starts (one on the workers finishes there); a
        queued job leaves the queue, with its arguments, now."""
        job = self.jobs.get(job_id)
        if job is None:
            return None
        if job.status in ("queued", "running"):
            job.cancel_requested = True
            job.status = "cancelled"
            if job.task is not None:
                job.task.cancel()
            if job.started_at is None:  # it holds no slot; its task may never have run
                described = job.describe()
                self._finish(job)
                return described
        return job.describe()

    async def list_jobs(self) -> list[dict[str, Any]]:
        return [job.describe() for job in self.jobs.values()]

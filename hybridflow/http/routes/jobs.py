"""``/v1/jobs``: long calls that answer at once with an id and run in the jobs deployment."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from hybridflow.control.contract import ErrorKind
from hybridflow.http.auth import require_token
from hybridflow.http.errors import STATUS_OF, ApiError
from hybridflow.http.routes.common import call_request, errors, found, jobs, settings
from hybridflow.http.routes.groups import answer
from hybridflow.http.schemas import CALL_BODY_DOC, CallResponse, JobStatus

router = APIRouter(tags=["jobs"], dependencies=[Depends(require_token)])


def public(job: dict[str, Any]) -> dict[str, Any]:
    """A job as the API shows it: a failed job's error kind (``error_kind``) and the status
    a call would have answered for it (``status_code``)."""
    kind = job.get("error_kind")
    return {**job, "status_code": STATUS_OF[ErrorKind(kind)] if kind else (200 if job["status"] == "succeeded" else None)}


async def _job(request: Request, job_id: str, action: str = "status") -> dict[str, Any]:
    answer = found(await getattr(jobs(request), action)(job_id))
    if answer is None:
        raise ApiError(404, f"unknown job {job_id!r}")
    if "job" in answer:
        return {**answer, "job": public(answer["job"])}
    return public(answer)


@router.post(
    "/v1/jobs/{group}/{method}",
    status_code=202,
    response_model=JobStatus,
    responses=errors(400, 401, 404, 413, 415, 422, 429, 503, 504),
    openapi_extra=CALL_BODY_DOC,
)
async def submit_job(group: str, method: str, request: Request, split: int = 1) -> Any:
    """Run a call as a job; poll ``GET /v1/jobs/{id}``. ``split`` cuts the dp-list argument's
    tensors into that many pieces along dim 0 (read-only row-wise methods only) for progress.
    With an ``Idempotency-Key``, a repeat with the same body and split gets the first job
    (the call is applied once), and the same key with another body gets 422."""
    limit = settings(request).max_split
    if not 1 <= split <= limit:
        raise ApiError(422, f"split must be within [1, {limit}], got {split}")
    call = await call_request(request, group, method)
    job = found(await jobs(request).submit(settings(request).deployment_of(group), call, split))
    return JSONResponse(public(job), status_code=202, headers={"Location": f"/v1/jobs/{job['id']}"})


@router.get("/v1/jobs", responses=errors(401, 404, 503, 504))
async def list_jobs(request: Request) -> dict[str, Any]:
    return {"jobs": [public(job) for job in found(await jobs(request).list_jobs())]}


@router.get("/v1/jobs/{job_id}", response_model=JobStatus, responses=errors(401, 404, 503, 504))
async def job_status(job_id: str, request: Request) -> dict[str, Any]:
    """Status (queued, running, succeeded, failed, cancelled), progress 0..1, elapsed time."""
    return await _job(request, job_id)


#: A failed job's result answers the status its call would have (``status_code``), a
#: cancelled one's 410.
RESULT_STATUSES = sorted({401, 404, 406, 409, 410, 503, 504, *STATUS_OF.values()})


@router.get("/v1/jobs/{job_id}/result", response_model=CallResponse, responses=errors(*RESULT_STATUSES))
async def job_result(job_id: str, request: Request) -> Response:
    """The finished job's answer, as the call route gives it (JSON or safetensors)."""
    found = await _job(request, job_id, "result")
    job = found["job"]
    if job["status"] in ("queued", "running"):
        raise ApiError(409, f"job {job_id} is {job['status']} ({job['progress']:.0%})")
    if job["status"] != "succeeded":
        raise ApiError(job["status_code"] or 410, f"job {job_id} {job['status']}: {job['error'] or ''}".strip())
    return await answer(request, job["group"], job["method"], found["outcome"])


@router.delete("/v1/jobs/{job_id}", response_model=JobStatus, responses=errors(401, 404, 503, 504))
async def cancel_job(job_id: str, request: Request) -> dict[str, Any]:
    """Cancel a job: no further pieces start (a call already on the workers finishes there)."""
    return await _job(request, job_id, "cancel")

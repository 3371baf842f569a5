"""The HTTP ingress: a FastAPI app on a Serve deployment that turns requests into calls
on the controller deployments (which own the worker groups) and answers JSON.

Routes: /healthz, /readyz, /v1/groups[/{group}[/{method}]], and the Open Inference
Protocol under /v2. Every error is ``{"error": "..."}``.
"""


import hmac
import warnings
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from app import call_body, oip
from app.backend import Backend
from app.errors import ApiError, error_response, install_error_handlers
from app.oip_models import InferResponse, ModelMetadata, ServerMetadata
from app.schemas import CallRequest, CallResponse, ErrorResponse, GroupDetail, GroupList, Health, JobStatus
from app.settings import ServiceSettings

# Ray warns on every zero-copy send (see deployments.application.INGRESS_RUNTIME_ENV): the
# ingress never writes to the tensors it sends, which is what the warning is about.
warnings.filterwarnings("ignore", message="Zero-copy tensor serialization is enabled")

#: Routes that answer without a bearer token (liveness and readiness probes).
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"})

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in {
        400: "malformed body",
        401: "missing or wrong bearer token",
        404: "unknown group, method or model",
        413: "body over the size limit",
        415: "unsupported Content-Type",
        422: "arguments that do not fit the method",
        503: "group not ready or rebuilding after a worker died (see Retry-After)",
        504: "call ran past the request timeout",
    }.items()
}

CALL_BODY_DOC = {
    "requestBody": {
        "required": False,
        "content": {
            "application/json": {"schema": CallRequest.model_json_schema()},
            "application/x-safetensors": {
                "schema": {"type": "string", "format": "binary"},
                "description": "keyword tensors by name; list items as name.0, name.1, ...",
            },
        },
    }
}

INFER_BODY_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"type": "object", "description": "OIP v2 inference request"}},
            "application/octet-stream": {
                "schema": {"type": "string", "format": "binary"},
                "description": "binary tensor data extension: JSON header (Inference-Header-Content-Length "
                "bytes) followed by the tensors' raw bytes",
            },
        },
    }
}

def _call_answer(group: str, method: str, outcome: dict[str, Any], accept: str | None) -> Response:
    if call_body.wants_safetensors(accept):
        return Response(call_body.output_as_safetensors(outcome["output"]), media_type=call_body.SAFETENSORS)
    return JSONResponse(
        {
            "group": group,
            "method": method,
            "dispatch_mode": outcome["dispatch_mode"],
            "execute_mode": outcome["execute_mode"],
            "world_size": outcome["world_size"],
            "output": call_body.output_as_json(outcome["output"]),
        }
    )


fastapi_app = FastAPI(
    title="HybridFlow single controller",
    version=oip.SERVER_VERSION,
    description="Worker groups of the verl single-controller tutorial, driven over HTTP.",
)
install_error_handlers(fastapi_app)


@serve.deployment(name="ingress", max_ongoing_requests=256)
@serve.ingress(fastapi_app)
class Ingress:
    def __init__(
        self, controllers: dict[str, Any], settings: dict[str, Any] | None = None, jobs: Any = None
    ) -> None:
        self.settings = ServiceSettings.from_args(settings)
        self.backend = Backend(controllers, self.settings, jobs)

    # -- guards ---------------------------------------------------------------------
    def _guard(self, request: Request) -> None:
        token = self.settings.auth_token
        if token and request.url.path not in OPEN_PATHS:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                raise ApiError(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})

    async def _body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"body of {declared} bytes is over the limit of {limit} bytes")
        body = await request.body()
        if len(body) > limit:
            raise ApiError(413, f"body of {len(body)} bytes is over the limit of {limit} bytes")
        return body

    # -- health ---------------------------------------------------------------------
    @fastapi_app.get("/healthz", response_model=Health, tags=["health"])
    async def healthz(self) -> dict[str, Any]:
        """Liveness: the ingress answers."""
        return {"status": "live"}

    @fastapi_app.get("/readyz", response_model=Health, responses={503: ERRORS[503]}, tags=["health"])
    async def readyz(self) -> Any:
        """Readiness: every group of every controller is ready."""
        groups = await self.backend.ready()
        if groups and all(groups.values()):
            return {"status": "ready", "groups": groups}
        waiting = sorted(name for name, ok in groups.items() if not ok) or ["controllers"]
        return error_response(503, f"not ready: {', '.join(waiting)}")

    # -- /v1 ------------------------------------------------------------------------
    @fastapi_app.get("/v1/groups", response_model=GroupList, responses={401: ERRORS[401]}, tags=["groups"])
    async def list_groups(self, request: Request) -> dict[str, Any]:
        """Every group: name, world size, resource pool, methods with their modes."""
        self._guard(request)
        return {"groups": await self.backend.describe()}

    @fastapi_app.get(
        "/v1/groups/{group}",
        response_model=GroupDetail,
        responses={401: ERRORS[401], 404: ERRORS[404]},
        tags=["groups"],
    )
    async def get_group(self, group: str, request: Request) -> dict[str, Any]:
        """One group with per-rank details (rank, local rank, node; tp/dp/pp for Megatron)."""
        self._guard(request)
        return await self.backend.describe_group(group)

    @fastapi_app.post(
        "/v1/groups/{group}/{method}",
        response_model=CallResponse,
        responses={
            **{c: ERRORS[c] for c in (400, 401, 404, 413, 415, 422, 503, 504)},
            200: {"content": {"application/x-safetensors": {}}, "description": "collected output"},
        },
        openapi_extra=CALL_BODY_DOC,
        tags=["groups"],
    )
    async def call_method(self, group: str, method: str, request: Request) -> Any:
        """Call ``method`` on ``group`` with its registered dispatch mode (a method without
        ``@register`` runs like ``execute_all_sync``: one value per rank)."""
        self._guard(request)
        body = await self._body(request)
        args, kwargs = call_body.parse_call_body(request.headers.get("content-type"), body)
        outcome = await self.backend.call(
            group, method, args, kwargs, request.headers.get("idempotency-key") or None
        )
        return _call_answer(group, method, outcome, request.headers.get("accept"))

    # -- jobs: long calls that answer at once and run in the background ---------------
    @fastapi_app.post(
        "/v1/jobs/{group}/{method}",
        status_code=202,
        response_model=JobStatus,
        responses={c: ERRORS[c] for c in (400, 401, 404, 413, 415, 422)},
        openapi_extra=CALL_BODY_DOC,
        tags=["jobs"],
    )
    async def submit_job(self, group: str, method: str, request: Request, split: int = 1) -> Any:
        """Run a call as a job; poll ``GET /v1/jobs/{id}``. ``split`` cuts the first argument's
        tensors into that many pieces along dim 0 (row-wise methods only) for progress."""
        self._guard(request)
        if not 1 <= split <= 4096:
            raise ApiError(422, f"split must be within [1, 4096], got {split}")
        body = await self._body(request)
        args, kwargs = call_body.parse_call_body(request.headers.get("content-type"), body)
        job = await self.backend.submit_job(group, method, args, kwargs, split)
        return JSONResponse(job, status_code=202, headers={"Location": f"/v1/jobs/{job['id']}"})

    @fastapi_app.get("/v1/jobs", tags=["jobs"], responses={401: ERRORS[401]})
    async def list_jobs(self, request: Request) -> dict[str, Any]:
        self._guard(request)
        return {"jobs": await self.backend.list_jobs()}

    @fastapi_app.get("/v1/jobs/{job_id}", response_model=JobStatus, tags=["jobs"], responses={404: ERRORS[404]})
    async def job_status(self, job_id: str, request: Request) -> dict[str, Any]:
        """Status (queued, running, succeeded, failed, cancelled), progress 0..1, elapsed time."""
        self._guard(request)
        return await self.backend.job(job_id)

    @fastapi_app.get(
        "/v1/jobs/{job_id}/result",
        response_model=CallResponse,
        tags=["jobs"],
        responses={404: ERRORS[404], 409: {"model": ErrorResponse, "description": "job not finished"}},
    )
    async def job_result(self, job_id: str, request: Request) -> Any:
        """The finished job's answer, as the call route gives it (JSON or safetensors)."""
        self._guard(request)
        answer = await self.backend.job(job_id, "result")
        job = answer["job"]
        if job["status"] in ("queued", "running"):
            raise ApiError(409, f"job {job_id} is {job['status']} ({job['progress']:.0%})")
        if job["status"] != "succeeded":
            raise ApiError(job["status_code"] or 410, f"job {job_id} {job['status']}: {job['error'] or ''}".strip())
        return _call_answer(job["group"], job["method"], answer["outcome"], request.headers.get("accept"))

    @fastapi_app.delete("/v1/jobs/{job_id}", response_model=JobStatus, tags=["jobs"], responses={404: ERRORS[404]})
    async def cancel_job(self, job_id: str, request: Request) -> dict[str, Any]:
        """Cancel a job: no further pieces start (a piece already on the workers finishes there)."""
        self._guard(request)
        return await self.backend.job(job_id, "cancel")

    # -- Open Inference Protocol v2 ---------------------------------------------------
    @fastapi_app.get("/v2", tags=["inference"], response_model=ServerMetadata)
    async def server_metadata(self, request: Request) -> dict[str, Any]:
        self._guard(request)
        return {"name": oip.SERVER_NAME, "version": oip.SERVER_VERSION, "extensions": oip.EXTENSIONS}

    @fastapi_app.get("/v2/health/live", tags=["inference"])
    async def oip_live(self) -> Response:
        return Response(status_code=200)

    @fastapi_app.get("/v2/health/ready", tags=["inference"], responses={503: ERRORS[503]})
    async def oip_ready(self) -> Response:
        groups = await self.backend.ready()
        return Response(status_code=200 if groups and all(groups.values()) else 503)

    def _model(self, model: str):
        entry = self.settings.oip_models.get(model)
        if entry is None or entry.controller not in self.backend.controllers:
            raise ApiError(404, f"unknown model {model!r}; models: {', '.join(self.settings.oip_models)}")
        return entry

    async def _model_spec(self, model: str, fresh: bool = False) -> tuple[Any, dict[str, Any]]:
        entry = self._model(model)
        spec = await self.backend.io_spec(entry.controller, entry.group, entry.method, fresh=fresh)
        if not spec.get("inputs") or not spec.get("outputs"):
            raise ApiError(404, f"model {model!r}: group {entry.group!r} declares no inference inputs")
        return entry, spec

    @fastapi_app.get(
        "/v2/models/{model}", tags=["inference"], response_model=ModelMetadata, responses={404: ERRORS[404]}
    )
    async def model_metadata(self, model: str, request: Request) -> dict[str, Any]:
        self._guard(request)
        _entry, spec = await self._model_spec(model, fresh=True)
        return oip.model_metadata(model, spec)

    @fastapi_app.get("/v2/models/{model}/ready", tags=["inference"], responses={404: ERRORS[404]})
    async def model_ready(self, model: str, request: Request) -> Response:
        self._guard(request)
        entry = self._model(model)
        groups = await self.backend.ready()
        return Response(status_code=200 if groups.get(entry.group) else 503)

    @fastapi_app.post(
        "/v2/models/{model}/infer",
        tags=["inference"],
        responses={
            200: {"model": InferResponse, "description": "outputs (JSON, or JSON header + binary tensors)"},
            **{c: ERRORS[c] for c in (400, 401, 404, 413, 422, 503, 504)},
        },
        openapi_extra=INFER_BODY_DOC,
    )
    async def infer(self, model: str, request: Request) -> Response:
        self._guard(request)
        entry, spec = await self._model_spec(model)
        body = await self._body(request)
        inference, inputs = oip.parse_request(body, request.headers.get("inference-header-content-length"))
        try:
            x = oip.check_input(inputs, spec)
        except ApiError:  # the kept spec may be stale (a layer re-initialised): ask again
            entry, spec = await self._model_spec(model, fresh=True)
            x = oip.check_input(inputs, spec)
        if entry.dp_list:
            outcome = await self.backend.call(entry.group, entry.method, [[x]], {})
            (y,) = outcome["output"]
        else:
            y = (await self.backend.call(entry.group, entry.method, [x], {}))["output"]
        answer, header_length = oip.response(model, inference, spec, {spec["outputs"][0]["name"]: y})
        if header_length is None:
            return Response(answer, media_type="application/json")
        return Response(
            answer,
            media_type="application/octet-stream",
            headers={"Inference-Header-Content-Length": str(header_length)},
        )

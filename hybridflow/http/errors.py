"""Every error the service answers is JSON ``{"error": "..."}`` with a meaningful status.

The controllers say what went wrong as an ``ErrorKind``; :data:`STATUS_OF` is the one
place that turns it into an HTTP status.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridflow.control.contract import ControllerError, ErrorKind

#: HTTP status of each kind of controller error.
STATUS_OF: dict[ErrorKind, int] = {
    ErrorKind.UNKNOWN_GROUP: 404,
    ErrorKind.UNKNOWN_METHOD: 404,
    ErrorKind.UNKNOWN_MODEL: 404,
    ErrorKind.BAD_ARGUMENTS: 422,
    ErrorKind.BAD_INPUT: 400,
    ErrorKind.METHOD_RAISED: 422,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.TIMEOUT: 504,
    ErrorKind.IDEMPOTENCY_CONFLICT: 422,
    ErrorKind.OVER_LIMIT: 429,
    ErrorKind.NOT_ENCODABLE: 406,
    ErrorKind.COLLECT_FAILED: 500,
}


class ApiError(Exception):
    """Raised by route code; answered as ``{"error": message}`` with ``status``."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}

    @classmethod
    def of(cls, error: ControllerError) -> ApiError:
        headers = {}
        if error.retry_after_s:
            headers["Retry-After"] = str(max(1, round(error.retry_after_s)))
        return cls(STATUS_OF[error.kind], error.message, headers)


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{where or 'body'}: {err.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, _validation_message(exc))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        # Anything else is a fault of the service: JSON like every answer, no traceback (it may
        # show paths, values or other clients' data). Starlette re-raises the exception after
        # this answer, so the server (uvicorn, Serve's replica) logs it.
        return error_response(500, f"internal error ({type(exc).__name__}); the service log has the details")

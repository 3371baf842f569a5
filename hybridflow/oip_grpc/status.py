"""The gRPC status codes the service answers: one table from the controllers' error kinds,
one from the HTTP statuses the ingress's shared backend raises with (a controller that
did not answer in time, a replica restarting), so both protocols refuse the same
requests for the same reasons."""

from __future__ import annotations

import grpc

from hybridflow.control.contract import ControllerError, ErrorKind

#: gRPC status of each kind of controller error (the HTTP side's table is
#: hybridflow.http.errors.STATUS_OF).
CODE_OF_KIND: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.UNKNOWN_GROUP: grpc.StatusCode.NOT_FOUND,
    ErrorKind.UNKNOWN_METHOD: grpc.StatusCode.NOT_FOUND,
    ErrorKind.UNKNOWN_MODEL: grpc.StatusCode.NOT_FOUND,
    ErrorKind.BAD_ARGUMENTS: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.BAD_INPUT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.METHOD_RAISED: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.IDEMPOTENCY_CONFLICT: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.OVER_LIMIT: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.NOT_ENCODABLE: grpc.StatusCode.FAILED_PRECONDITION,
}

#: gRPC status of an HTTP status (as gRPC's own HTTP mapping and Triton use them).
CODE_OF_HTTP: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    406: grpc.StatusCode.FAILED_PRECONDITION,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


class GrpcError(Exception):
    """An RPC's refusal: its status code, the details a client reads, and, for a group
    that is rebuilding, how many seconds to wait (sent as ``retry-after`` trailing
    metadata)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    @classmethod
    def of(cls, error: ControllerError) -> GrpcError:
        return cls(CODE_OF_KIND[error.kind], error.message, error.retry_after_s)

    @classmethod
    def of_http(cls, status: int, message: str, retry_after_s: float | None = None) -> GrpcError:
        return cls(CODE_OF_HTTP.get(status, grpc.StatusCode.INTERNAL), message, retry_after_s)

    def trailing_metadata(self) -> list[tuple[str, str]]:
        if not self.retry_after_s:
            return []
        return [("retry-after", str(max(1, round(self.retry_after_s))))]

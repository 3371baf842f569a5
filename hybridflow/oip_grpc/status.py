"""The gRPC status codes the service answers: one table from the controllers' error kinds
(the HTTP side's is ``hybridflow.http.errors.STATUS_OF``), so both protocols refuse the
same requests for the same reasons."""

from __future__ import annotations

import grpc

from hybridflow.control.contract import ControllerError, ErrorKind

#: gRPC status of each kind of controller error.
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
    # Applied on every rank and journaled, with no output to give: a retry would apply it
    # again, so not a code a client retries on.
    ErrorKind.COLLECT_FAILED: grpc.StatusCode.INTERNAL,
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

    def trailing_metadata(self) -> list[tuple[str, str]]:
        if not self.retry_after_s:
            return []
        return [("retry-after", str(max(1, round(self.retry_after_s))))]

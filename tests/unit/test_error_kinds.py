"""One error vocabulary below the fronts: every kind of controller error has an HTTP
status and a gRPC code, so no error reaches a client as a generic internal one because
its kind was missing from a front's table."""

from __future__ import annotations

import grpc
import pytest

from hybridflow.control.contract import ControllerError, ErrorKind
from hybridflow.http.errors import STATUS_OF, ApiError
from hybridflow.oip_grpc.status import CODE_OF_KIND, GrpcError


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_every_kind_has_an_http_status_and_a_grpc_code(kind):
    assert 400 <= STATUS_OF[kind] < 600
    assert CODE_OF_KIND[kind] not in (grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN)


def test_the_tables_hold_the_kinds_and_nothing_else():
    assert set(STATUS_OF) == set(ErrorKind) == set(CODE_OF_KIND)


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_each_front_carries_the_message_and_the_wait(kind):
    error = ControllerError(kind, f"{kind.value} happened", 7.2 if kind is ErrorKind.UNAVAILABLE else None)
    http, rpc = ApiError.of(error), GrpcError.of(error)
    assert (http.status, http.message, rpc.code, rpc.message) == (
        STATUS_OF[kind], f"{kind.value} happened", CODE_OF_KIND[kind], f"{kind.value} happened")
    wait = kind is ErrorKind.UNAVAILABLE
    assert http.headers == ({"Retry-After": "7"} if wait else {})
    assert rpc.trailing_metadata() == ([("retry-after", "7")] if wait else [])


def test_both_fronts_refuse_a_kind_alike():
    """The classes of failure agree: a client's mistake, a missing thing, a wait."""
    agree = {
        404: grpc.StatusCode.NOT_FOUND, 503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED,
        429: grpc.StatusCode.RESOURCE_EXHAUSTED, 500: grpc.StatusCode.INTERNAL,
    }
    for kind, status in STATUS_OF.items():
        if status in agree:
            assert CODE_OF_KIND[kind] == agree[status], kind

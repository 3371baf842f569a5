"""Fixtures of the client's tests.

``mode``: every test that takes it runs twice, once as a client without torch (numpy in
and out; the codecs hand back no torch tensor even where torch is installed) and once with torch
(skipped where torch is not installed). ``service_url``: the service named by
``HYBRIDFLOW_URL`` (the tests that take it skip when it is unset), with the bearer token
``HYBRIDFLOW_TOKEN`` if set.
"""

from __future__ import annotations

import os

import pytest
from helpers import TORCH

from hybridflow_client.wire import tensors


@pytest.fixture(params=["numpy", "torch"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "torch" and TORCH is None:
        pytest.skip("torch is not installed")
    torch = TORCH if request.param == "torch" else None
    monkeypatch.setattr(tensors, "installed_torch", lambda: torch)
    return request.param


@pytest.fixture
def numpy_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client as it runs without torch."""
    monkeypatch.setattr(tensors, "installed_torch", lambda: None)


@pytest.fixture(scope="session")
def service_url() -> str:
    url = os.environ.get("HYBRIDFLOW_URL")
    if not url:
        pytest.skip("HYBRIDFLOW_URL is not set (the URL of a service running serve_config.yaml)")
    return url.rstrip("/")


@pytest.fixture(scope="session")
def service_token() -> str | None:
    return os.environ.get("HYBRIDFLOW_TOKEN") or None

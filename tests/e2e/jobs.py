"""Waiting for a job of a live service to finish."""

from __future__ import annotations

import time

import httpx


def wait_for_job(http: httpx.Client, job_id: str, timeout: float = 120) -> tuple[dict, list[float]]:
    """Polls ``GET /v1/jobs/{job_id}`` (each answer a 200) until the job is neither queued
    nor running: its last status, and the progress seen on the way."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        status = http.get(f"/v1/jobs/{job_id}")
        assert status.status_code == 200, status.text
        body = status.json()
        seen.append(body["progress"])
        if body["status"] not in ("queued", "running"):
            return body, seen
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} still running after {timeout} s")

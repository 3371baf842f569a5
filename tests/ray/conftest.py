"""Fixtures and helpers the Ray layer's controller tests share."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import ray


@pytest.fixture(scope="module")
def loop():
    """An event loop running in a thread of its own for the module, as a controller
    replica's is (tests submit coroutines to it with run_coroutine_threadsafe)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


def kill_rank(worker, timeout_s: float = 60) -> None:
    """``ray.kill`` a rank, then wait until its process is gone. Ray reports the actor dead
    as soon as the kill is asked for, while the process may run a moment longer: a rank's
    socket channel (``transport: socket``) answers until it exits."""
    pid = ray.get(worker._get_rank_info.remote(), timeout=30)["pid"]
    ray.kill(worker, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while process_running(pid):
        assert time.monotonic() < deadline, f"the killed rank's process {pid} still runs after {timeout_s:g} s"
        time.sleep(0.05)


def process_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False

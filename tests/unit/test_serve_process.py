"""The tests' ``serve run`` starter: a start whose Ray node never came up ends at once
(and is tried again by ``start``), even when ``serve run`` printed the failure and then
hung instead of exiting."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.serve_process import ServeProcess

NODE_TIMEOUT = ("Exception: The current node timed out during startup. This could happen because some of the "
                "raylet failed to startup or the GCS has become overloaded.\n")


def hung_run(printed: str) -> ServeProcess:
    """A ServeProcess whose ``serve run`` is a process that printed ``printed`` and then hangs."""
    run = ServeProcess()
    run.proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
    run.log.write(printed)
    run.log.flush()
    return run


def test_a_node_that_timed_out_ends_the_wait_at_once_and_its_process():
    run = hung_run("INFO scripts.py -- Running config file\n" + NODE_TIMEOUT)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="failed to start"):
        run.wait_ready(timeout_s=60)
    assert time.monotonic() - started < 30  # not the 60 s readiness wait
    assert run.proc.poll() is not None  # killed, not left running


def test_other_output_keeps_waiting_until_the_timeout():
    run = hung_run("INFO scripts.py -- Running config file\n")
    with pytest.raises(TimeoutError):
        run.wait_ready(timeout_s=1.5)
    assert run.proc.poll() is not None

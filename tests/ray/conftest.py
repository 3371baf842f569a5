"""Fixtures the Ray layer's controller tests share."""

from __future__ import annotations

import asyncio
import threading

import pytest


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

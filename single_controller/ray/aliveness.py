"""verl's worker aliveness check: the driver aborts (SIGABRT) when a worker dies.

A busy worker is not a dead one: the check reads each actor's state from Ray's control
store (the GCS), never calls the worker, so a long-running call does not look like a
death. Only a state other than ALIVE (DEAD, RESTARTING) counts, as in verl.

This is the fail-fast of a training driver, which has no way to rebuild a group. A
process that must survive worker deaths (the HTTP service's controllers, which rebuild
the group and replay its journal) does not start it.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

logger = logging.getLogger(__name__)

#: The actor state Ray reports for a worker that is up (busy or idle).
ALIVE = "ALIVE"


def actor_state(actor: Any) -> str:
    """Ray's state of an actor: ALIVE, DEAD, RESTARTING, PENDING_CREATION, ... ("UNKNOWN"
    when the control store has no record of it)."""
    from ray._private.state import actors  # the GCS actor table; needs no dashboard

    info = actors(actor_id=actor._actor_id.hex())
    return info.get("State", "UNKNOWN") if info else "UNKNOWN"


def is_actor_alive(actor: Any) -> bool:
    return actor_state(actor) == ALIVE


def wait_until_alive(actors: Sequence[Any], timeout_s: float, poll_s: float = 0.2) -> None:
    """Block until every actor is ALIVE; ``TimeoutError`` naming the others after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = [actor_state(a) for a in actors]
        if all(state == ALIVE for state in states):
            return
        if time.monotonic() >= deadline:
            waiting = {rank: state for rank, state in enumerate(states) if state != ALIVE}
            raise TimeoutError(f"workers not alive after {timeout_s:g} s (rank: state): {waiting}")
        time.sleep(poll_s)


class AlivenessCheck:
    """A daemon thread that looks at every worker each ``every_n_seconds`` and, at the
    first one not ALIVE, logs it and calls ``on_death`` (by default: raise SIGABRT in this
    process, as verl does). ``stop()`` ends it; it also ends when Ray shuts down."""

    def __init__(
        self,
        workers: Sequence[Any],
        every_n_seconds: float = 1.0,
        is_alive: Callable[[Any], bool] = is_actor_alive,
        on_death: Callable[[int], None] | None = None,
    ) -> None:
        if every_n_seconds <= 0:
            raise ValueError(f"every_n_seconds must be positive, got {every_n_seconds!r}")
        self.workers = list(workers)
        self.every_n_seconds = float(every_n_seconds)
        self.is_alive = is_alive
        self.on_death = on_death or _abort
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-aliveness-check", daemon=True)

    def start(self) -> AlivenessCheck:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.every_n_seconds + 5)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self.every_n_seconds):
            if not ray.is_initialized():
                return
            for rank, worker in enumerate(self.workers):
                try:
                    alive = self.is_alive(worker)
                except Exception:  # the control store went away with the cluster: stop looking
                    if self._stop.is_set() or not ray.is_initialized():
                        return
                    raise
                if not alive and not self._stop.is_set():
                    logger.warning("worker rank %d (%s) is not alive", rank, worker)
                    self.on_death(rank)
                    return


def _abort(rank: int) -> None:
    """verl's reaction to a dead worker: SIGABRT to this process."""
    signal.raise_signal(signal.SIGABRT)

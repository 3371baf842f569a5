"""Where a cold start of ``serve run`` spends its wall time, read from Ray's task timeline
of the running cluster: milestones in seconds after ``serve run`` was launched.

- ``first_rank``: a worker group's first rank starts its ``__init__``. Before it: Ray's
  start, Serve's controller and proxy, the replica that owns the groups, and that rank's
  process coming up with its imports.
- ``ranks_up``: the last rank's ``__init__`` has returned (every group's processes are up).
- ``ranks_set_up``: the last call on a rank that began before ``/readyz`` answered has
  returned: Megatron's setup, ``init_calls`` such as ``init_model``, a first weight sync.

A floor script that starts the same processes pays for ``ranks_up`` less Serve's part of
``first_rank``; what lies after ``ranks_up`` is the service's alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable, Mapping
from typing import Any

#: Serve's own actors (a class name starts with one of these); every other actor a start
#: creates is a rank of a worker group.
SERVE_ACTOR_PREFIXES = ("ServeController", "ProxyActor", "ServeReplica", "HAProxyManager")

_READ_SCRIPT = """
import json, sys, ray
from ray.util.state import list_actors
ray.init(address=sys.argv[1], log_to_driver=False)
actors = {a.actor_id: a.class_name for a in list_actors(limit=10000, raise_on_missing_output=False)}
print(json.dumps({"events": ray.timeline(), "actors": actors}))
"""


def actor_of(task_id: str) -> str:
    """The actor a task belongs to: the last 16 bytes of an actor task's id (hex)."""
    return task_id[-32:]


def milestones(events: Iterable[Mapping[str, Any]], actor_classes: Mapping[str, str], launched_at: float,
               ready_at: float) -> dict[str, float]:
    """``first_rank``, ``ranks_up`` and ``ranks_set_up`` (module docstring), seconds after
    ``launched_at``, from Chrome-trace spans (``ts`` and ``dur`` in microseconds since the
    epoch, ``args.task_id``) and ``{actor id: class name}``; ``launched_at`` and
    ``ready_at`` are epoch seconds. A milestone no span shows is left out."""
    inits: list[tuple[float, float]] = []
    calls: list[tuple[float, float]] = []
    for event in events:
        task_id = (event.get("args") or {}).get("task_id")
        if event.get("ph") != "X" or not task_id:
            continue
        cls = actor_classes.get(actor_of(task_id))
        if cls is None or cls.startswith(SERVE_ACTOR_PREFIXES):
            continue
        start = event["ts"] / 1e6
        span = (start, start + event.get("dur", 0) / 1e6)
        if event.get("name") == "__init__":
            inits.append(span)
        elif event.get("name") != "__ray_ready__" and start <= ready_at:
            calls.append(span)
    found: dict[str, float] = {}
    if inits:
        found["first_rank"] = min(s for s, _ in inits) - launched_at
        found["ranks_up"] = max(e for _, e in inits) - launched_at
    if calls:
        found["ranks_set_up"] = max(e for _, e in calls) - launched_at
    return found


def read_milestones(gcs_address: str, launched_at: float, ready_at: float, timeout_s: float = 120) -> dict[str, float]:
    """:func:`milestones` of the Ray cluster at ``gcs_address`` (a driver of its own reads
    the timeline and the actors' classes). ValueError with the driver's last words if it
    could not."""
    done = subprocess.run([sys.executable, "-c", _READ_SCRIPT, gcs_address], capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode != 0:
        raise ValueError(f"reading Ray's timeline failed: {done.stderr.strip()[-500:]}")
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    return milestones(seen["events"], seen["actors"], launched_at, ready_at)

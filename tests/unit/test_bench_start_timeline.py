"""The cold start's milestones from Ray's timeline: ranks are the actors that are not
Serve's, calls begun after /readyz answered do not count, and the seconds are from the
launch."""

from __future__ import annotations

import pytest

from bench.start_timeline import actor_of, milestones

LAUNCH = 1_000.0  # epoch seconds
ACTORS = {
    "a" * 32: "ServeController",
    "b" * 32: "ServeReplica:hybridflow:ingress",
    "c" * 32: "GPUAccumulator",
    "d" * 32: "MLPLayerWorker",
}


def span(name: str, actor: str, start_s: float, seconds: float, with_task: bool = True) -> dict:
    """A Chrome-trace span as Ray's timeline writes it (microseconds since the epoch)."""
    args = {"task_id": "f" * 16 + actor * 32} if with_task else {}
    return {"ph": "X", "name": name, "ts": (LAUNCH + start_s) * 1e6, "dur": seconds * 1e6, "args": args}


def test_an_actor_tasks_id_ends_with_its_actor_id():
    assert actor_of("ffffffffffffffff" + "fae5ade61dbd70a8dc5846db01000000") == "fae5ade61dbd70a8dc5846db01000000"


def test_milestones_count_the_ranks_and_not_serves_actors():
    events = [
        span("__init__", "a", 2.0, 0.5),  # Serve's controller: not a rank
        span("__init__", "b", 4.0, 3.0),  # the ingress replica: not a rank
        span("__init__", "c", 9.0, 1.5),
        span("__init__", "d", 10.0, 2.5),
        span("__ray_ready__", "d", 12.5, 0.1),  # a readiness probe, not setup
        span("init_megatron", "d", 13.0, 4.0),
        span("init_model", "d", 17.0, 1.0),
        span("_put_weight_slices", "d", 21.0, 0.5),  # began after /readyz (at 20 s)
        span("task:execute", "d", 13.0, 30.0, with_task=False),  # no task id: not attributed
        span("handle_request", "b", 18.0, 5.0),
    ]
    found = milestones(events, ACTORS, LAUNCH, LAUNCH + 20.0)
    assert found == pytest.approx({"first_rank": 9.0, "ranks_up": 12.5, "ranks_set_up": 18.0})


def test_a_timeline_without_rank_spans_has_no_milestones():
    assert milestones([span("__init__", "a", 1.0, 1.0)], ACTORS, LAUNCH, LAUNCH + 5.0) == {}
    unknown_actor = [span("__init__", "e", 1.0, 1.0)]  # gone from the actor table
    assert milestones(unknown_actor, ACTORS, LAUNCH, LAUNCH + 5.0) == {}

"""A worker group's teardown in a process that has left Ray: a group start that fails
after its driver called ``ray.shutdown()`` (a start thread outliving its controller) shuts
its group down, and that must not start a new local Ray cluster (Ray's calls start one
when none is connected)."""

from __future__ import annotations

import ray

from single_controller.ray.worker_group import RayWorkerGroup


def test_shutdown_once_ray_is_shut_down_starts_no_cluster():
    group = RayWorkerGroup.__new__(RayWorkerGroup)  # the state a group holds, without Ray
    group._shared = {"aliveness": None, "compiled": None, "channel": None, "pending": {}}
    group._workers = ["an actor handle of the cluster this process left"]
    assert not ray.is_initialized()
    group.shutdown()
    assert not ray.is_initialized()

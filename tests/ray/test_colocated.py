"""Colocated workers (several worker classes in one process per bundle) and compiled
graph execution of a group's methods, on the session's Ray cluster."""

from __future__ import annotations

import threading

import pytest
import ray
import torch
from tensordict import TensorDict

from single_controller.base import Worker
from single_controller.base.decorator import Dispatch, Execute, register
from single_controller.models.tutorial_workers import GPUAccumulator, GPUAccumulatorDecorator, TestActor
from single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from single_controller.ray.base import create_colocated_worker_cls  # verl's import path


@ray.remote
class Ledger(Worker):
    """Keeps every call it saw, so order across plain and compiled calls is visible."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    @register(Dispatch.ONE_TO_ALL)
    def note(self, item):
        self.seen.append(item)
        return len(self.seen)

    @register(Dispatch.ONE_TO_ALL)
    def log(self):
        return list(self.seen)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def double(self, batch):
        return TensorDict({"y": batch["x"] * 2}, batch_size=batch.batch_size)

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, rank):
        if self.rank == rank:
            raise ValueError(f"rank {rank} refuses")
        return self.rank

    @register(Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def first(self, x):
        return (self.rank, x)


@pytest.fixture(scope="module")
def colocated(ray_cluster):
    pool = RayResourcePool([4], use_gpu=True)
    fused = create_colocated_worker_cls(
        {
            "plain": RayClassWithInitArgs(GPUAccumulator),
            "decorated": RayClassWithInitArgs(GPUAccumulatorDecorator),
            "test": RayClassWithInitArgs(TestActor, x=2),
            "ledger": RayClassWithInitArgs(Ledger),
        }
    )
    group = RayWorkerGroup(pool, fused)
    roles = group.spawn(prefix_set=["plain", "decorated", "test", "ledger"])
    yield group, roles
    group.shutdown()
    pool.remove()


def test_roles_share_one_process_per_bundle_and_keep_the_tutorials_numbers(colocated):
    group, roles = colocated
    assert group.world_size == 4 and set(roles) == {"plain", "decorated", "test", "ledger"}
    pids = {name: [info["pid"] for info in role.rank_info()] for name, role in roles.items()}
    assert len(set(pids["plain"])) == 4  # one process per bundle ...
    assert all(p == pids["plain"] for p in pids.values())  # ... holding every role
    # Each role keeps its own state, exactly as in the tutorial's separate groups.
    assert [float(v) for v in roles["plain"].execute_all_sync("add", x=[1, 1, 1, 1])] == [1, 2, 3, 4]
    assert [float(v) for v in roles["decorated"].add(x=10)] == [10, 11, 12, 13]
    assert [float(v) for v in roles["plain"].execute_all_sync("get_value")] == [1, 2, 3, 4]
    assert roles["test"].execute_all_sync("foo", 1) == [3, 3, 3, 3]
    assert roles["test"].foo_rank_zero(x=1, y=2) == 5
    assert roles["test"].foo_custom([1, 2], [3, 4]) == [6, 8, 6, 8]
    # A role's group has only that role's methods, under their own names.
    assert hasattr(roles["decorated"], "add") and not hasattr(roles["plain"], "add")
    with pytest.raises(AttributeError, match="foo"):
        roles["plain"].execute_all_sync("foo", 1)


def test_spawn_and_create_refuse_what_they_cannot_do(colocated, ray_cluster):
    group, _ = colocated
    with pytest.raises(ValueError, match="unknown roles"):
        group.spawn(prefix_set=["critic"])
    with pytest.raises(ValueError, match="at least one role"):
        create_colocated_worker_cls({})
    with pytest.raises(ValueError, match="not a Worker"):
        create_colocated_worker_cls({"plain": RayClassWithInitArgs(ray.remote(type("NotAWorker", (), {})))})
    with pytest.raises(ValueError, match="identifiers"):
        create_colocated_worker_cls({"a-b": RayClassWithInitArgs(GPUAccumulator)})


def test_compiled_methods_match_plain_calls_and_keep_call_order(colocated):
    _, roles = colocated
    ledger = roles["ledger"]
    compiled = ledger.compile()
    base = len(ledger.log()[0])
    for i in range(30):  # alternate plain and compiled calls on the same processes
        (ledger if i % 2 else compiled).note(i)
    logs = compiled.log()
    assert logs == ledger.log()
    assert all(log[base:] == list(range(30)) for log in logs)
    # Dispatch and collect are the group's own: a DP batch is split, padded and rejoined.
    batch = TensorDict({"x": torch.arange(10.0).reshape(10, 1)}, batch_size=[10])
    assert torch.equal(compiled.double(batch)["y"], ledger.double(batch)["y"])
    assert torch.equal(compiled.double(batch)["y"], batch["x"] * 2)
    assert compiled.first(7) == ledger.first(7) == (0, 7)
    # Other roles on the same processes stay reachable while the graph exists, and a
    # role's compiled view shares the one graph of its processes.
    assert roles["test"].execute_all_sync("foo", 1) == [3, 3, 3, 3]
    assert roles["test"].compile().execute_all_sync("foo", [1, 2, 3, 4]) == [3, 4, 5, 6]


def test_compiled_errors_raise_like_plain_calls_and_the_graph_survives(colocated):
    _, roles = colocated
    ledger = roles["ledger"]
    compiled = ledger.compile()
    with pytest.raises(ray.exceptions.RayTaskError, match="rank 2 refuses"):
        ledger.fail_on(2)
    with pytest.raises(ray.exceptions.RayTaskError, match="rank 2 refuses"):
        compiled.fail_on(2)
    assert compiled.fail_on(9) == [0, 1, 2, 3]
    counts = compiled.note("after-error")
    assert len(set(counts)) == 1
    assert ledger.note("again") == [c + 1 for c in counts]


def test_compiled_and_plain_callers_in_threads_see_one_order_on_every_rank(colocated):
    _, roles = colocated
    ledger = roles["ledger"]
    compiled = ledger.compile()
    start = len(ledger.log()[0])

    def caller(view, tag: str) -> None:
        for i in range(15):
            view.note(f"{tag}{i}")

    threads = [threading.Thread(target=caller, args=(v, t)) for v, t in ((ledger, "p"), (compiled, "c"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    logs = [log[start:] for log in ledger.log()]
    assert len(logs[0]) == 30 and all(log == logs[0] for log in logs)
    # each caller's own calls stay in its order
    for tag in "pc":
        assert [x for x in logs[0] if x.startswith(tag)] == [f"{tag}{i}" for i in range(15)]


def test_colocated_example_runs_as_a_user_would(ray_cluster):
    """examples/colocated.py in its own process, attached to the session's cluster as a
    user's script is to a running cluster (RAY_ADDRESS): its printed numbers."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    done = subprocess.run(
        [sys.executable, str(root / "examples" / "colocated.py")],
        capture_output=True, text=True, timeout=300, env=env, cwd=root,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout.splitlines()

    def printed(label: str) -> str:
        (line,) = [line for line in out if line.startswith(label)]
        return line[len(label):].strip()

    assert printed("acc.add(10)") == "[10.0, 11.0, 12.0, 13.0]"
    assert printed("test.foo_custom") == "[8, 10, 8, 10]"
    assert printed("compiled add(1)") == "[11.0, 12.0, 13.0, 14.0]"
    assert printed("pids (acc)") == printed("pids (test)")

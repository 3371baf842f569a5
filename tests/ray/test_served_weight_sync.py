"""Weight syncs as the controller serves them, on the session's Ray cluster in this process
(no Serve): a tp=1 layer ("trainer") and a tp=2 layer ("rollout", ``weights_from:
trainer``) of one deployment, its state in a SQLite file and the synced shards beside it.

The sync at start, a sync after a train step (the rollout answers what the trainer does,
under a new version in every inference answer), calls racing syncs (each answer the old
weights with the old version or the new with the new), a rebuild that brings back the
synced weights and version, an init_model after a sync replayed in its place, refusals
and failures that leave the previous weights and version, kept files that are deleted
once no restore needs them, and a changed file that fails the restore with the reason."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.control.builder import PoolSet, units
from hybridflow.control.contract import WEIGHTS_LAYOUT, WEIGHTS_SYNC, CallRequest, ErrorKind
from hybridflow.control.controller import GroupController
from hybridflow.control.placement import GpuBudget, plan_deployment

MLP = "single_controller.models.mlp_worker:MLPLayerWorker"
HIDDEN, FFN = 64, 128
X = {"name": "x", "datatype": "FP32", "shape": [-1, -1, HIDDEN]}
Y = {**X, "name": "y"}


def layer(tp: int, seed: int = 0, hidden: int = HIDDEN) -> dict:
    return {"hidden_size": hidden, "intermediate_size": FFN, "hidden_act": "silu", "seed": seed, "tp": tp}


def mlp_group(name: str, tp: int, seed: int, **extra) -> dict:
    return {
        "name": name, "worker": MLP, "pool": {"process_on_nodes": [tp], "name_prefix": name},
        "megatron": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": 1},
        "init_calls": [{"method": "init_model", "kwargs": {"config": layer(tp, seed)}}],
        "read_only": ["get_weights", "run_layer"], **extra,
    }


def args(state_path: Path) -> dict:
    return {
        "state": {"path": str(state_path)},
        "deployments": [{
            "name": "weights",
            "groups": [
                mlp_group("trainer", 1, seed=1),
                mlp_group("rollout", 2, seed=2, weights_from="trainer"),
                {"name": "counter", "worker": "single_controller.models.tutorial_workers:Accumulator",
                 "plain_actor": True, "read_only": ["get_value"]},
            ],
            "models": [
                {"name": name, "group": name, "method": "run_layer", "dp_list": True, "inputs": [X], "outputs": [Y]}
                for name in ("trainer", "rollout")
            ],
        }],
    }


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("served-weights")


@pytest.fixture(scope="module")
def served(ray_cluster, loop, state_dir):
    config = load_config(args(state_dir / "state.db"))
    deployment = config.deployments[0]
    plan = plan_deployment(deployment, config, GpuBudget(0))
    pools = PoolSet(plan)
    controller = GroupController(deployment, plan, units(deployment, plan, pools), request_timeout_s=120,
                                 health_timeout_s=10, state=config.state)
    models = controller.models
    run(loop, controller.start(), timeout=300)
    checks = asyncio.run_coroutine_threadsafe(_check_health(controller), loop)
    yield controller, models
    checks.cancel()
    controller.shutdown()
    pools.remove()


async def _check_health(controller) -> None:
    while True:  # as Serve's health check does
        await asyncio.sleep(1)
        await controller.check_health()


def run(loop, coro, timeout: float = 180):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=timeout)


def call(loop, controller, group, method, **kwargs):
    return run(loop, controller.call(CallRequest(group, method, kwargs=kwargs)))


def sync(loop, controller, dst="rollout", source="trainer"):
    return run(loop, controller.call(CallRequest(dst, WEIGHTS_SYNC, kwargs={"from": source}, operation=True)))


def infer(loop, models, name, x):
    result = run(loop, models.infer(name, {"x": x}))
    assert result.ok, result.error
    return result.outputs["y"], result.weights_version


def version(loop, controller, group="rollout") -> int:
    return run(loop, controller.describe_group(group)).weights_version


def wait(predicate, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout_s:g} s")


def rebuilt(loop, controller, group="rollout") -> None:
    """Kill rank 1 of the group and wait until the health check rebuilt it."""
    import ray

    unit = controller.groups[group].unit
    before = unit.rebuilds
    ray.kill(controller.groups[group].group.workers[1], no_restart=True)
    wait(lambda: unit.rebuilds > before or unit.status == "failed", f"{group} rebuilt")
    if unit.status != "failed":
        wait(lambda: unit.status == "ready", f"{group} ready")


def sync_dirs(state_dir: Path) -> list[str]:
    return sorted(p.name for p in (state_dir / "weights" / "weights" / "rollout").iterdir())


X1 = torch.randn(4, 3, HIDDEN, generator=torch.Generator().manual_seed(3))


def train(loop, controller, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, target = torch.randn(2, 1, HIDDEN, generator=g), torch.randn(2, 1, HIDDEN, generator=g)
    assert call(loop, controller, "trainer", "train_step", x=x, target=target, lr=0.5).ok


def assert_same_layer(a: torch.Tensor, b: torch.Tensor) -> None:
    assert ((a - b).norm() / b.norm()).item() <= 1e-5


def test_the_rollout_takes_the_trainers_weights_at_start(loop, served, state_dir):
    controller, models = served
    wait(lambda: version(loop, controller) == 1, "the sync at start")
    trainer, trainer_version = infer(loop, models, "trainer", X1)
    rollout, rollout_version = infer(loop, models, "rollout", X1)
    assert_same_layer(rollout, trainer)  # seeded 2 at init: only the sync made them the same
    assert (trainer_version, rollout_version) == (0, 1)
    layout = call(loop, controller, "rollout", WEIGHTS_LAYOUT)
    assert layout.error is not None  # an operation only through its own request
    answer = run(loop, controller.call(CallRequest("rollout", WEIGHTS_LAYOUT, operation=True)))
    assert answer.output["weights_version"] == 1
    ranks = answer.output["layout"]["ranks"]
    assert [r["tp_size"] for r in ranks] == [2, 2] and [p["name"] for p in ranks[0]["params"]] == [
        "gate_proj", "up_proj", "down_proj"]
    assert len(sync_dirs(state_dir)) == 1


def test_a_sync_after_a_train_step_and_calls_racing_it(loop, served):
    controller, models = served
    train(loop, controller, seed=5)
    old_rollout, old_version = infer(loop, models, "rollout", X1)
    trained, _ = infer(loop, models, "trainer", X1)
    assert not torch.allclose(old_rollout, trained)

    async def racing():
        stop = asyncio.Event()
        answers = []

        async def reader():
            while not stop.is_set():
                answers.append(await models.infer("rollout", {"x": X1}))

        readers = [asyncio.ensure_future(reader()) for _ in range(3)]
        await asyncio.sleep(0.2)
        result = await controller.call(CallRequest("rollout", WEIGHTS_SYNC, kwargs={"from": "trainer"},
                                                   operation=True))
        await asyncio.sleep(0.2)
        stop.set()
        await asyncio.gather(*readers)
        return result, answers

    result, answers = run(loop, racing())
    assert result.ok, result.error
    report = result.output
    assert report["weights_version"] == old_version + 1 == result.weights_version
    full = 3 * HIDDEN * FFN * 4
    assert report["full_bytes"] == full and report["bytes_per_rank"] == [full // 2, full // 2]
    assert report["seconds"] > 0 and report["from"] == "trainer"
    seen = set()
    for answer in answers:  # never the new weights under the old version, nor half of them
        assert answer.ok, answer.error
        expected = old_rollout if answer.weights_version == old_version else trained
        assert answer.weights_version in (old_version, old_version + 1)
        assert_same_layer(answer.outputs["y"], expected)
        seen.add(answer.weights_version)
    assert seen == {old_version, old_version + 1}, seen
    rollout, rollout_version = infer(loop, models, "rollout", X1)
    assert_same_layer(rollout, trained)
    assert rollout_version == old_version + 1 == version(loop, controller)


def test_a_rebuilt_rollout_comes_back_with_its_synced_weights_and_version(loop, served, state_dir):
    controller, models = served
    before, before_version = infer(loop, models, "rollout", X1)
    train(loop, controller, seed=6)  # the trainer moves on: the rebuild must not take these
    rebuilt(loop, controller)
    after, after_version = infer(loop, models, "rollout", X1)
    assert torch.equal(after, before) and after_version == before_version
    # consecutive syncs: only the latest one's files are kept
    assert len(sync_dirs(state_dir)) == 1


def test_an_init_model_after_a_sync_is_replayed_in_its_place(loop, served, state_dir):
    controller, models = served
    synced = sync(loop, controller)
    assert synced.ok, synced.error
    assert call(loop, controller, "rollout", "init_model", config=layer(2, seed=9)).ok
    fresh, fresh_version = infer(loop, models, "rollout", X1)
    assert fresh_version == 0
    rebuilt(loop, controller)
    after, after_version = infer(loop, models, "rollout", X1)
    assert torch.equal(after, fresh) and after_version == 0
    # a sync after the init gets a version above every earlier one, and both syncs' files
    # stay: the init_model between them is replayed after the first
    again = sync(loop, controller)
    assert again.ok and again.weights_version == synced.weights_version + 1
    assert len(sync_dirs(state_dir)) == 2


def test_refused_and_failed_syncs_leave_the_weights_and_version(loop, served, monkeypatch):
    controller, models = served
    before, before_version = infer(loop, models, "rollout", X1)
    for source, words in (("counter", "declares no weights"), ("rollout", "from itself"),
                          ("nope", "not a group of deployment 'weights'")):
        refused = sync(loop, controller, source=source)
        assert refused.error.kind is ErrorKind.BAD_ARGUMENTS and words in refused.error.message
    refused = sync(loop, controller, dst="counter")
    assert refused.error.kind is ErrorKind.BAD_ARGUMENTS and "declares no weights" in refused.error.message
    # a source of another shape: refused before anything moves
    assert call(loop, controller, "trainer", "init_model", config=layer(1, seed=1, hidden=32)).ok
    mismatch = sync(loop, controller)
    assert mismatch.error.kind is ErrorKind.BAD_ARGUMENTS, mismatch.error
    assert call(loop, controller, "trainer", "init_model", config=layer(1, seed=1)).ok
    # committed, but the shards cannot be kept: the group goes back to what its journal holds
    kept = controller.weights.groups["rollout"]

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kept.files, "write", full_disk)
    failed = sync(loop, controller)
    monkeypatch.undo()
    assert failed.error.kind is ErrorKind.UNAVAILABLE and "could not be kept" in failed.error.message
    wait(lambda: controller.groups["rollout"].unit.status == "ready", "rollout restored")
    after, after_version = infer(loop, models, "rollout", X1)
    assert torch.equal(after, before) and after_version == before_version
    assert "could not be kept" in run(loop, controller.describe_group("rollout")).weights_error


def test_a_changed_file_fails_the_restore_with_the_reason(loop, served, state_dir):
    controller, models = served
    assert sync(loop, controller).ok
    (latest,) = [d for d in sync_dirs(state_dir) if d.startswith(f"v{version(loop, controller)}-")]
    rank0 = state_dir / "weights" / "weights" / "rollout" / latest / "rank0.safetensors"
    data = bytearray(rank0.read_bytes())
    data[-1] ^= 0xFF
    rank0.write_bytes(bytes(data))
    rebuilt(loop, controller)
    unit = controller.groups["rollout"].unit
    assert unit.status == "failed" and unit.halted
    assert "rank0.safetensors is not the file that was written" in unit.last_error
    assert run(loop, models.infer("rollout", {"x": X1})).error.kind is ErrorKind.UNAVAILABLE
    # the operator's way out: the group's stored state discarded, its own init weights
    run(loop, _reset(controller))
    wait(lambda: unit.status == "ready", "rollout reset")
    assert infer(loop, models, "rollout", X1)[1] == 0


async def _reset(controller) -> None:
    controller.reset_group("rollout")

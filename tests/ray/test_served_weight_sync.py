"""Weight syncs as the controller serves them, on the session's Ray cluster in this process
(no Serve): a tp=1 layer ("trainer") and a tp=2 layer ("rollout", ``weights_from:
trainer``) of one deployment, its state in a SQLite file and the synced shards beside it.

The sync at start, a sync after a train step (the rollout answers what the trainer does,
under a new version in every inference answer), calls racing syncs (each answer the old
weights with the old version or the new with the new), a rebuild that brings back the
synced weights and version, an init_model after a sync replayed in its place, refusals
and failures that leave the previous weights and version, kept files that are deleted
once no restore needs them, and a changed file that fails the restore with the reason.
Every error a sync leaves (its answer, weights_error, last_error) is one line without a
traceback, path, process id or address. A sync becomes the restore point of the rollout
(which takes no snapshots): only the latest state.weights_kept syncs' files stay, and a
rebuild loads the synced weights and replays the calls after it. Syncs waiting for one
into a group are bounded (limits.weight_syncs_queued), those from one source run once,
and a sync whose caller went away is recorded whole or never starts."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from pathlib import Path

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.control.builder import PoolSet, units
from hybridflow.control.contract import WEIGHTS_LAYOUT, WEIGHTS_SYNC, CallRequest, ErrorKind
from hybridflow.control.controller import GroupController
from hybridflow.control.placement import GpuBudget, plan_deployment
from hybridflow.state.codec import decode_call

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


def assert_one_clean_line(text: str | None, *secrets: str) -> None:
    """An error as a client or an operator reads it: one line, none of what Ray's error
    text carries (colour codes, traceback, process id, node address, actor id, paths)."""
    assert text and "\n" not in text and "\x1b" not in text, repr(text)
    for marker in ("Traceback", 'File "', "pid=", "ip=", "actor_id", "ray::", "RayTaskError"):
        assert marker not in text, text
    assert not re.search(r"(?<![\w.])/\w", text), f"an absolute path in {text!r}"
    assert not re.search(r"\b\d{1,3}(\.\d{1,3}){3}\b", text), f"an address in {text!r}"
    for secret in secrets:
        assert secret not in text, text


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
    since = controller.events.last_id
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
    synced = [e for e in controller.events._ring if e.id > since and e.kind == "weights_synced"]
    assert [(e.group, e.fields) for e in synced] == [("rollout", {"source": "trainer", "version": rollout_version})]


def test_a_rebuilt_rollout_comes_back_with_its_synced_weights_and_version(loop, served, state_dir):
    controller, models = served
    before, before_version = infer(loop, models, "rollout", X1)
    train(loop, controller, seed=6)  # the trainer moves on: the rebuild must not take these
    rebuilt(loop, controller)
    after, after_version = infer(loop, models, "rollout", X1)
    assert torch.equal(after, before) and after_version == before_version
    # two syncs so far: the latest (the restore point) and the one before it stay (state.weights_kept)
    assert len(sync_dirs(state_dir)) == 2


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
    # a sync after the init gets a version above every earlier one; it is the restore point
    # now, and of the files, the latest state.weights_kept syncs' stay
    again = sync(loop, controller)
    assert again.ok and again.weights_version == synced.weights_version + 1
    assert len(sync_dirs(state_dir)) == 2 and any(d.startswith(f"v{again.weights_version}-")
                                                  for d in sync_dirs(state_dir))


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
    assert f"{latest}/rank0.safetensors is not the file that was written" in unit.last_error
    # the first line of the status: the file by its place in the group's directory, not the server's path
    assert_one_clean_line(unit.last_error.split("; not retried")[0], str(state_dir))
    assert run(loop, models.infer("rollout", {"x": X1})).error.kind is ErrorKind.UNAVAILABLE
    # the operator's way out: the group's stored state discarded, its own init weights
    run(loop, _reset(controller))
    wait(lambda: unit.status == "ready", "rollout reset")
    assert infer(loop, models, "rollout", X1)[1] == 0


async def _reset(controller) -> None:
    controller.reset_group("rollout")


def test_a_failed_commit_answers_one_line_and_logs_the_whole_error(loop, served, monkeypatch, caplog):
    controller, models = served
    import hybridflow.control.weights as weights_module

    real_stage = weights_module.stage_weights

    def stage_then_init(src, dst, *args):
        staged = real_stage(src, dst, *args)
        # init_model between the stage and the commit drops what was staged on every rank
        init = CallRequest("rollout", "init_model", kwargs={"config": layer(2, seed=11)})
        assert asyncio.run_coroutine_threadsafe(controller.call(init), loop).result(timeout=120).ok
        return staged

    monkeypatch.setattr(weights_module, "stage_weights", stage_then_init)
    with caplog.at_level(logging.WARNING, logger="hybridflow.control.weights"):
        failed = sync(loop, controller)
    monkeypatch.undo()
    assert failed.error.kind is ErrorKind.METHOD_RAISED, failed.error
    assert "no weights staged for sync" in failed.error.message
    assert failed.error.message.endswith("rollout keeps its weights, version 0"), failed.error.message
    assert_one_clean_line(failed.error.message)
    status = run(loop, controller.describe_group("rollout"))
    assert "no weights staged for sync" in status.weights_error
    assert_one_clean_line(status.weights_error)
    # the whole error, the workers' traceback with it, goes to the log
    logged = "\n".join(r.getMessage() + "\n" + caplog.handler.formatter.formatException(r.exc_info)
                        for r in caplog.records if r.exc_info)
    assert "Traceback" in logged and "no weights staged for sync" in logged and "_commit_weights" in logged
    # the rollout serves init_model's weights, as acknowledged: version 0
    assert infer(loop, models, "rollout", X1)[1] == 0


def test_syncs_waiting_for_one_are_bounded_and_those_from_one_source_run_once(loop, served):
    controller, _ = served
    before = controller.weights.groups["rollout"].issued  # the highest version given so far

    async def at_once(count: int) -> list:
        request = CallRequest("rollout", WEIGHTS_SYNC, kwargs={"from": "trainer"}, operation=True)
        return await asyncio.gather(*(controller.call(request) for _ in range(count)))

    # one runs, limits.weight_syncs_queued (4) wait and run once together, the rest are refused
    answers = run(loop, at_once(7))
    assert [a.weights_version for a in answers[:5]] == [before + 1] + [before + 2] * 4, answers[:5]
    for refused in answers[5:]:
        assert refused.error.kind is ErrorKind.OVER_LIMIT and refused.error.retry_after_s >= 1
        assert "4 wait for it" in refused.error.message and "limits.weight_syncs_queued" in refused.error.message
    assert version(loop, controller) == before + 2
    assert [a.output for a in answers[1:5]] == [answers[1].output] * 4  # one sync's report


def test_a_sync_whose_caller_went_away_is_recorded_whole_or_never_starts(loop, served):
    controller, models = served
    kept = controller.weights.groups["rollout"]
    before = kept.issued
    train(loop, controller, seed=12)
    trained, _ = infer(loop, models, "trainer", X1)

    async def callers_gone() -> None:
        request = CallRequest("rollout", WEIGHTS_SYNC, kwargs={"from": "trainer"}, operation=True)
        running = asyncio.ensure_future(controller.call(request))
        while not kept.queue.busy:  # it is staging
            await asyncio.sleep(0.001)
        waiting = asyncio.ensure_future(controller.call(request))
        for _ in range(100):  # on the loop: it joins the queue within a few steps
            if kept.queue.waiting:
                break
            await asyncio.sleep(0)
        assert kept.queue.busy and kept.queue.waiting == 1
        running.cancel()  # both clients disconnect
        waiting.cancel()
        await asyncio.sleep(0)
        assert kept.queue.waiting == 0  # the waiting one never starts

    run(loop, callers_gone())
    wait(lambda: not kept.queue.busy, "the running sync ended")
    after, after_version = infer(loop, models, "rollout", X1)
    assert after_version == before + 1 == version(loop, controller)  # the running one, whole; once
    assert_same_layer(after, trained)
    durability = controller.groups["rollout"].durability
    stored = durability.store.load(durability.scope)  # and recorded: the group's restore point
    assert decode_call(stored.snapshot)[2]["version"] == before + 1


def test_a_sync_is_the_restore_point_and_only_the_latest_syncs_files_stay(loop, served, state_dir):
    controller, models = served
    durability = controller.groups["rollout"].durability
    directory = state_dir / "weights" / "weights" / "rollout"
    for seed in (13, 14, 15):  # each sync followed by a call: every one would stay in a journal
        synced = sync(loop, controller)
        assert synced.ok, synced.error
        assert call(loop, controller, "rollout", "train_step", x=X1[:2, :1], target=X1[2:, :1], lr=0.001 * seed).ok
    stored = durability.store.load(durability.scope)
    method, _, record = decode_call(stored.snapshot)
    assert (method, record["version"]) == (WEIGHTS_SYNC, synced.weights_version)
    assert len(stored.entries) == 1 and len(controller.groups["rollout"].journal) == 1  # the train_step after it
    dirs = sync_dirs(state_dir)
    assert len(dirs) == controller.state.weights_kept == 2, dirs
    assert {d.split("-")[0] for d in dirs} == {f"v{synced.weights_version - 1}", f"v{synced.weights_version}"}
    # their disk use, as GET /v1/weights/{group} shows it
    layout = run(loop, controller.call(CallRequest("rollout", WEIGHTS_LAYOUT, operation=True))).output
    on_disk = {d: sum(f.stat().st_size for f in (directory / d).glob("rank*.safetensors")) for d in dirs}
    full = 3 * HIDDEN * FFN * 4
    assert all(full < size < full + 4096 for size in on_disk.values()), on_disk  # both ranks' halves, and headers
    assert layout["kept"] == {
        "bytes": sum(on_disk.values()), "weights_kept": 2,
        "syncs": [{"version": int(d.split("-")[0][1:]), "bytes": on_disk[d],
                   "restore_point": d.startswith(f"v{synced.weights_version}-")}
                  for d in sorted(dirs, key=lambda d: int(d.split("-")[0][1:]))],
    }
    # a rebuild: the synced weights, then the train_step after them; nothing before
    before, before_version = infer(loop, models, "rollout", X1)
    unit = controller.groups["rollout"].unit
    replayed = unit.replayed
    rebuilt(loop, controller)
    after, after_version = infer(loop, models, "rollout", X1)
    assert torch.equal(after, before) and after_version == before_version == synced.weights_version
    assert unit.replayed - replayed == 1

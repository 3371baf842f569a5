"""Weight syncs between MLP layer groups on CPU: tp=4 to tp=2, tp=4 to tp=1 and tp=2 to
tp=4 through the object store, tp=4 to tp=2 over a gloo group (the collective path's code
on CPU); the destination's weights and forward against the source's, the slices each
destination rank received, versions, refusals, a failed stage, restore from read-back
shards, train_step's SGD step, and calls racing syncs."""

from __future__ import annotations

import threading
import time

import pytest
import ray
import torch

from single_controller.base.decorator import Dispatch, register
from single_controller.base.worker_methods import user_class
from single_controller.models.mlp_worker import MLPLayerWorker
from single_controller.ray import MegatronRayWorkerGroup, RayClassWithInitArgs, RayResourcePool
from single_controller.weights import (
    WeightSyncError,
    abort_weights,
    commit_weights,
    load_weights,
    read_rank_weights,
    read_weights,
    stage_weights,
    sync_weights,
    weight_layout,
    weights_version,
)

HIDDEN, FFN = 64, 128
#: One full copy of the layer (gate, up, down; float32).
FULL_BYTES = 3 * HIDDEN * FFN * 4


@ray.remote
class FlakyStageMLP(user_class(MLPLayerWorker)):
    """The MLP worker, whose stage can be told to fail on one rank after it staged."""

    @register(Dispatch.ONE_TO_ALL)
    def fail_next_stage(self, rank: int) -> None:
        self._fail_stage = rank == self.rank

    def _stage_weights(self, *args, **kwargs):
        receipt = super()._stage_weights(*args, **kwargs)
        if getattr(self, "_fail_stage", False):
            self._fail_stage = False
            raise RuntimeError("injected stage failure")
        return receipt


def config(seed: int, hidden: int = HIDDEN) -> dict:
    return {"hidden_size": hidden, "intermediate_size": FFN, "hidden_act": "silu", "seed": seed}


def make_group(tp: int, prefix: str, cls=MLPLayerWorker):
    pool = RayResourcePool([tp], use_gpu=False, name_prefix=prefix)
    group = MegatronRayWorkerGroup(
        resource_pool=pool,
        ray_cls_with_init=RayClassWithInitArgs(cls=cls),
        default_megatron_kwargs={"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": 1},
    )
    return pool, group


@pytest.fixture(scope="module")
def groups(ray_cluster):
    made = {"tp4": make_group(4, "ws4"), "tp2": make_group(2, "ws2", FlakyStageMLP), "tp1": make_group(1, "ws1")}
    yield {name: group for name, (_, group) in made.items()}
    for pool, group in made.values():
        group.shutdown()
        pool.remove()


def full_matrices(group) -> dict[str, torch.Tensor]:
    """gate, up and down assembled from the group's tp shards (dp rank 0)."""
    shards = group.get_weights()[: group.tp_size]
    halves = [s["gate_up_proj.weight"].chunk(2, dim=0) for s in shards]
    return {
        "gate_proj": torch.cat([h[0] for h in halves]),
        "up_proj": torch.cat([h[1] for h in halves]),
        "down_proj": torch.cat([s["down_proj.weight"] for s in shards], dim=1),
    }


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm())


def trained(group, seed: int) -> None:
    """A seeded layer moved away from its seed by two SGD steps."""
    group.init_model(config(seed))
    g = torch.Generator().manual_seed(seed)
    x, target = torch.randn(4, 2, HIDDEN, generator=g), torch.randn(4, 2, HIDDEN, generator=g)
    for _ in range(2):
        group.train_step(x, target, 0.5)


def check_synced(src, dst, report, src_ranks_of: list[set[int]]) -> None:
    """dst holds src's full matrices and computes its forward; each dst rank received its
    shards' bytes, from exactly the source ranks it overlaps."""
    assert all(torch.equal(a, b) for a, b in zip(full_matrices(src).values(), full_matrices(dst).values(), strict=True))
    x = torch.randn(6, 3, HIDDEN)
    assert rel_err(dst.run_layer([x])[0], src.run_layer([x])[0]) <= 1e-5
    share = FULL_BYTES // dst.tp_size
    assert report.bytes_per_rank == [share] * dst.world_size
    assert report.full_bytes == FULL_BYTES
    for rank, received in enumerate(report.received):
        assert {src_rank for _, src_rank, _ in received} == src_ranks_of[rank]
        per_param = {}
        for param, _, nbytes in received:
            per_param[param] = per_param.get(param, 0) + nbytes
        assert per_param == {"gate_proj": share // 3, "up_proj": share // 3, "down_proj": share // 3}


def test_layout_is_declared_by_logical_names(groups):
    groups["tp4"].init_model(config(1))
    layout = weight_layout(groups["tp4"])
    assert [p.to_dict() for p in layout.params.values()] == [
        {"name": "gate_proj", "shape": [FFN, HIDDEN], "dtype": "float32", "split_dim": 0},
        {"name": "up_proj", "shape": [FFN, HIDDEN], "dtype": "float32", "split_dim": 0},
        {"name": "down_proj", "shape": [HIDDEN, FFN], "dtype": "float32", "split_dim": 1},
    ]
    assert [(r.tp_rank, r.dp_rank, r.device) for r in layout.ranks] == [(r, 0, "cpu") for r in range(4)]
    assert layout.full_bytes == FULL_BYTES
    assert weights_version(groups["tp4"]) == 0


def test_train_step_is_one_sgd_step_of_the_full_layer(groups):
    group = groups["tp4"]
    group.init_model(config(2))
    before = {k: v.double() for k, v in full_matrices(group).items()}
    x, target = torch.randn(5, 2, HIDDEN), torch.randn(5, 2, HIDDEN)
    leaves = {k: v.clone().requires_grad_() for k, v in before.items()}
    h = x.double()
    y = (torch.nn.functional.silu(h @ leaves["gate_proj"].T) * (h @ leaves["up_proj"].T)) @ leaves["down_proj"].T
    loss = torch.nn.functional.mse_loss(y, target.double())
    loss.backward()
    loss = loss.detach()
    losses = group.train_step(x, target, 2.0)
    assert len(set(losses)) == 1 and abs(losses[0] - float(loss)) <= 1e-5 * float(loss)
    after = full_matrices(group)
    for name, leaf in leaves.items():
        assert rel_err(after[name], before[name] - 2.0 * leaf.grad) <= 1e-5
    assert group.train_step(x, target, 2.0)[0] < losses[0]
    with pytest.raises(ValueError, match="lr must be a positive finite number"):
        group.train_step(x, target, float("nan"))
    with pytest.raises(ValueError, match=r"target the same shape, got \[5, 2, 64\] and \[5, 64\]"):
        group.train_step(x, target[:, 0], 0.1)


def test_tp4_to_tp2(groups):
    src, dst = groups["tp4"], groups["tp2"]
    trained(src, 3)
    dst.init_model(config(4))
    report = sync_weights(src, dst)
    assert (report.version, report.transport) == (1, "object_store")
    assert weights_version(dst) == 1
    check_synced(src, dst, report, [{0, 1}, {2, 3}])


def test_tp4_to_tp1(groups):
    src, dst = groups["tp4"], groups["tp1"]
    trained(src, 5)
    dst.init_model(config(6))
    report = sync_weights(src, dst)
    check_synced(src, dst, report, [{0, 1, 2, 3}])
    # the only process that holds the full model is the one whose layout asks for it
    assert report.bytes_per_rank == [FULL_BYTES]


def test_tp2_to_tp4(groups):
    src, dst = groups["tp2"], groups["tp4"]
    trained(src, 7)
    dst.init_model(config(8))
    report = sync_weights(src, dst)
    check_synced(src, dst, report, [{0}, {0}, {1}, {1}])
    # the next sync takes the next version
    assert sync_weights(src, dst).version == report.version + 1 == weights_version(dst)


def test_tp4_to_tp2_over_a_collective_group(groups):
    src, dst = groups["tp4"], groups["tp2"]
    trained(src, 9)
    before = weights_version(dst)
    report = sync_weights(src, dst, transport="collective")
    assert (report.transport, report.backend) == ("collective", "gloo")
    assert report.version == before + 1
    check_synced(src, dst, report, [{0, 1}, {2, 3}])


def test_mismatches_are_refused_before_anything_moves(groups):
    src, dst = groups["tp4"], groups["tp1"]
    trained(src, 10)
    dst.init_model(config(11, hidden=HIDDEN // 2))
    x = torch.randn(2, 1, HIDDEN // 2)
    y = dst.run_layer([x])[0]
    with pytest.raises(ValueError, match=r"gate_proj is \[128, 64\] in the source and \[128, 32\] in the destination"):
        sync_weights(src, dst)
    with pytest.raises(ValueError, match="share worker processes"):
        sync_weights(src, src)
    assert torch.equal(dst.run_layer([x])[0], y) and weights_version(dst) == 0
    dst.init_model(config(11))


def test_a_failed_stage_keeps_the_old_weights_and_version(groups):
    src, dst = groups["tp4"], groups["tp2"]
    trained(src, 12)
    dst.init_model(config(13))
    sync_weights(src, dst, version=41)
    with pytest.raises(ValueError, match="version 41 is not above the destination's current weights version 41"):
        sync_weights(src, dst, version=41)
    x = torch.randn(3, 2, HIDDEN)
    y = dst.run_layer([x])[0]
    src.train_step(torch.randn(3, 2, HIDDEN), torch.randn(3, 2, HIDDEN), 1.0)
    dst.fail_next_stage(1)
    with pytest.raises(WeightSyncError, match="injected stage failure"):
        sync_weights(src, dst)
    assert torch.equal(dst.run_layer([x])[0], y) and weights_version(dst) == 41
    # rank 0's staged copy was dropped with rank 1's: nothing is left to abort
    assert dst.execute_all_sync("_abort_weights") == [False, False]
    # a stage that is aborted, or that a rebuild overtook, never goes live
    staged = stage_weights(src, dst)
    abort_weights(dst, staged)
    staged = stage_weights(src, dst)
    dst.init_model(config(13))
    with pytest.raises(WeightSyncError, match="no rank committed"):
        commit_weights(dst, staged)
    assert weights_version(dst) == 0


def test_read_back_shards_restore_the_synced_weights_and_version(groups):
    src, dst = groups["tp4"], groups["tp2"]
    trained(src, 14)
    report = sync_weights(src, dst, version=7)
    version, shards = read_weights(dst)
    assert version == 7 == report.version
    assert [sorted(s) for s in shards] == [["down_proj", "gate_proj", "up_proj"]] * 2
    x = torch.randn(4, 2, HIDDEN)
    y = dst.run_layer([x])[0]
    # a rebuild: fresh weights from a seed, then the kept shards (never a replay of src)
    src.train_step(torch.randn(2, 1, HIDDEN), torch.randn(2, 1, HIDDEN), 1.0)
    dst.init_model(config(15))
    assert weights_version(dst) == 0
    assert load_weights(dst, shards, version) == 7
    assert torch.equal(dst.run_layer([x])[0], y) and weights_version(dst) == 7
    # the same, one rank at a time: read, kept, and given back rank by rank
    kept = [read_rank_weights(dst, rank) for rank in range(2)]
    assert all(v == 7 and all(torch.equal(s[k], shards[r][k]) for k in s) for r, (v, s) in enumerate(kept))
    dst.init_model(config(15))
    assert load_weights(dst, lambda rank: kept[rank][1], 7) == 7
    assert torch.equal(dst.run_layer([x])[0], y) and weights_version(dst) == 7
    # shards of another layout are refused, and change nothing
    groups["tp1"].init_model(config(1))
    tp1_shards = read_weights(groups["tp1"])[1]
    with pytest.raises(ValueError, match=r"gate_proj: shard is \[128, 64\] torch.float32, this rank holds \[64, 64\]"):
        load_weights(dst, tp1_shards * 2, 8)
    with pytest.raises(ValueError, match=r"one shard dict per rank \(2\), got 1"):
        load_weights(dst, tp1_shards, 8)
    assert torch.equal(dst.run_layer([x])[0], y) and weights_version(dst) == 7


def test_calls_during_syncs_see_old_or_new_weights_never_a_mix(groups):
    src, dst = groups["tp4"], groups["tp2"]
    trained(src, 16)
    sync_weights(src, dst)
    x = torch.randn(8, 2, HIDDEN)
    during = 0
    for _ in range(3):
        src.train_step(torch.randn(4, 2, HIDDEN), torch.randn(4, 2, HIDDEN), 1.0)
        old = dst.run_layer([x])[0]
        seen: list[list[tuple[float, torch.Tensor]]] = [[] for _ in range(4)]
        stop = threading.Event()
        window: list[float] = []

        def call(out: list, stop: threading.Event) -> None:
            while not stop.is_set():
                started = time.perf_counter()
                out.append((started, dst.run_layer([x])[0]))

        threads = [threading.Thread(target=call, args=(out, stop)) for out in seen]
        for thread in threads:
            thread.start()
        time.sleep(0.05)
        window.append(time.perf_counter())
        version = sync_weights(src, dst).version
        window.append(time.perf_counter())
        time.sleep(0.1)
        stop.set()
        for thread in threads:
            thread.join()
        new = dst.run_layer([x])[0]
        assert not torch.equal(old, new)
        for calls in seen:
            kinds = []
            for started, y in calls:
                assert torch.equal(y, old) or torch.equal(y, new), f"a call mixed weights during version {version}"
                kinds.append(torch.equal(y, new))
                during += window[0] <= started <= window[1]
            # one caller's calls see the old weights, then the new ones, never back
            assert kinds == sorted(kinds)
    assert during > 0, "no call ran during a sync"

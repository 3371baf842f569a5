"""RayWorkerGroup on a real Ray cluster: rendezvous, GPU sharing, every dispatch mode,
errors, futures, ordering under concurrent callers, and failing fast on pools."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest
import ray
import torch
from tensordict import TensorDict

from hybridflow.control.rank_answers import rank_outcomes
from single_controller import DataProtoFuture
from single_controller.base import Worker
from single_controller.base.decorator import (
    DispatchError,
    register,
    register_dispatch_mode,
)
from single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    ResourceUnavailableError,
)
from tests.ray.mode_workers import ModeWorker
from tests.ray.pool_workers import InitEnvReader, PlainEnvReader


@dataclass
class Info:
    tp_rank: int
    dp_rank: int
    pp_rank: int
    cp_rank: int = 0


class LayoutGroup(RayWorkerGroup):
    """A plain group that reports a Megatron-style layout (no Megatron needed)."""

    def set_layout(self, tp: int, dp: int, pp: int, micro_dp_group_size: int = 1) -> None:
        assert tp * dp * pp == self.world_size
        self.tp_size, self.dp_size, self.pp_size, self.cp_size = tp, dp, pp, 1
        self.micro_dp_group_size = micro_dp_group_size
        self._infos = [Info(r % tp, (r // tp) % dp, r // (tp * dp)) for r in range(self.world_size)]

    def get_megatron_rank_info(self, rank: int) -> Info:
        return self._infos[rank]


@pytest.fixture(scope="module")
def cpu_pool(ray_cluster):
    pool = RayResourcePool([4], use_gpu=False, name_prefix="modes")
    yield pool
    pool.remove()


@pytest.fixture(scope="module")
def group(cpu_pool):
    g = LayoutGroup(cpu_pool, RayClassWithInitArgs(cls=ModeWorker))
    g.set_layout(tp=2, dp=2, pp=1)
    yield g
    g.shutdown()


def test_one_to_all_and_all_to_all(group):
    assert group.one_to_all(x=7) == [(r, 7) for r in range(4)]
    assert group.all_to_all(x=["a", "b", "c", "d"]) == [(0, "a"), (1, "b"), (2, "c"), (3, "d")]


def test_rank_zero_execute(group):
    assert group.rank_zero(x=[1, 2]) == (0, [1, 2])


def test_dp_compute(group):
    assert group.dp_compute([10, 11, 12, 13]) == [(0, 10), (1, 11), (2, 12), (3, 13)]
    with pytest.raises(ValueError, match=r"dp_compute: positional argument 0 .*expected length 4, got 2"):
        group.dp_compute([1, 2])


def test_dp_compute_proto_pads_and_unpads(group):
    batch = TensorDict({"x": torch.arange(6.0)}, batch_size=[6])
    out = group.dp_proto(batch)
    assert out.batch_size[0] == 6
    assert out["x"].tolist() == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    # 6 rows padded to 8: two rows per rank
    assert out["rank"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3][:6]
    assert batch["x"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_megatron_compute_on_a_reported_layout(group):
    group.set_layout(tp=2, dp=2, pp=1)
    assert group.megatron_compute(["dp0", "dp1"]) == [(0, "dp0"), (2, "dp1")]
    with pytest.raises(ValueError, match=r"megatron_compute: .*one item per dp rank: expected length 2, got 4"):
        group.megatron_compute([1, 2, 3, 4])
    batch = TensorDict({"x": torch.arange(4.0)}, batch_size=[4])
    assert group.megatron_proto(batch)["x"].tolist() == [0.0, 2.0, 4.0, 6.0]


def test_megatron_pp_modes(group):
    group.set_layout(tp=2, dp=1, pp=2)
    try:
        assert group.pp_as_dp(["s0", "s1"]) == [(0, "s0"), (2, "s1")]
        assert group.pp_only(x="w") == [(0, "w"), (2, "w")]
        group.set_layout(tp=1, dp=2, pp=2)
        # (dp, pp) positions in dispatch order: (0,0)->r0, (0,1)->r2, (1,0)->r1, (1,1)->r3
        assert group.pp_as_dp(["A", "B", "C", "D"]) == [(0, "A"), (2, "B"), (1, "C"), (3, "D")]
    finally:
        group.set_layout(tp=2, dp=2, pp=1)


def test_all_micro_dp(group):
    group.micro_dp_group_size = 2
    batch = TensorDict({"x": torch.arange(4.0)}, batch_size=[4])
    assert group.micro_dp(batch)["x"].tolist() == [-1.0, 0.0, 1.0, 2.0]


def test_non_blocking_calls_return_futures(group):
    futures = group.one_to_all_async(x=100)
    assert all(isinstance(f, ray.ObjectRef) for f in futures)
    assert ray.get(futures) == [100, 101, 102, 103]
    batch = TensorDict({"x": torch.arange(5.0)}, batch_size=[5])
    future = group.dp_proto_async(batch)  # a batch's future, as verl answers: get() collects
    assert isinstance(future, DataProtoFuture)
    assert future.get(timeout=120)["x"].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    refs = group.execute_all_async("echo", x=1)
    assert ray.get(refs) == [(r, 1) for r in range(4)]


def test_execute_all_rules_and_errors(group):
    assert group.execute_all_sync("echo", x=[1, 2, 3, 4]) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert group.execute_all_sync("echo", x=(1, 2)) == [(r, (1, 2)) for r in range(4)]
    with pytest.raises(ValueError, match=r"echo: .*'x'.*expected 4 .*got 3"):
        group.execute_all_sync("echo", [0, 0, 0, 0], x=[1, 2, 3])
    with pytest.raises(AttributeError, match="ModeWorker has no method 'nope'"):
        group.execute_all_sync("nope")


def test_calls_from_many_threads_keep_one_order_on_every_rank(group):
    threads = [
        threading.Thread(target=lambda t=t: [group.append(item=f"{t}-{i}") for i in range(25)]) for t in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    histories = group.get_history()
    assert len(histories[0]) == 200
    assert all(h == histories[0] for h in histories)


def test_large_inputs_go_to_the_object_store_once(group):
    group.set_layout(tp=2, dp=2, pp=1)
    before = group.object_store_puts
    big = [torch.zeros(64 * 1024), torch.ones(64 * 1024)]
    out = group.megatron_compute(big)
    assert [int(rank) for rank, _ in out] == [0, 2]
    assert group.object_store_puts - before == 2  # one per dp item, not one per rank
    before = group.object_store_puts
    assert group.size_of(t=torch.zeros(32 * 1024)) == [32 * 1024] * 4
    assert group.object_store_puts - before == 1


def test_custom_registered_dispatch_mode_on_a_group(cpu_pool):
    def reversed_dispatch(wg, *args, **kwargs):
        return tuple(list(reversed(a)) for a in args), {k: list(reversed(v)) for k, v in kwargs.items()}

    def sum_collect(wg, outputs):
        return sum(outputs)

    mode = register_dispatch_mode("TEST_REVERSED_SUM", reversed_dispatch, sum_collect)

    @ray.remote
    class Scaler(Worker):
        @register(mode)
        def scale(self, x):
            return x * (self.rank + 1)

    g = RayWorkerGroup(cpu_pool, RayClassWithInitArgs(cls=Scaler))
    try:
        # rank r gets x[3 - r]: 4*1 + 3*2 + 2*3 + 1*4
        assert g.scale(x=[1, 2, 3, 4]) == 20
    finally:
        g.shutdown()


def test_rendezvous_serves_torch_distributed(ray_cluster):
    pool = RayResourcePool([2], use_gpu=False, name_prefix="dist")
    g = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ModeWorker))
    try:
        assert g.execute_all_sync("all_reduce_rank") == [3.0, 3.0]
        addrs = g.execute_all_sync("get_master_addr_port")
        assert addrs[0] == addrs[1] and int(addrs[0][1]) > 0
        info = g.rank_info()
        assert [i["rank"] for i in info] == [0, 1]
        assert info[0]["node_id"] == ray.get_runtime_context().get_node_id()
        assert info[0]["device"] == "cpu"  # a CPU pool, also on a GPU node
        g.check_health(timeout_s=10)
    finally:
        g.shutdown()
        pool.remove()


@pytest.fixture(scope="module")
def gpu_groups(ray_cluster):
    """Two groups of ModeWorker on one pool of 2 GPU bundles."""
    pool = RayResourcePool([2], use_gpu=True, name_prefix="share")
    groups = [RayWorkerGroup(pool, RayClassWithInitArgs(cls=ModeWorker)) for _ in range(2)]
    yield groups
    for g in groups:
        g.shutdown()
    pool.remove()


def test_only_ranks_given_a_gpu_pick_cuda_and_nccl(group, gpu_groups):
    """A CPU pool on a GPU node: its actors see the node's GPUs, but Ray gave them none, so
    they stay on cpu/gloo (cuda would put every rank on device 0, which NCCL refuses)."""
    assert group.execute_all_sync("device_if_node_has_gpu") == [("cpu", "gloo")] * 4
    assert gpu_groups[0].execute_all_sync("device_if_node_has_gpu") == [("cuda", "nccl")] * 2


def test_each_rank_sees_its_variables_in_init_without_a_runtime_env(ray_cluster):
    """The rank's variables reach os.environ before the class's __init__ runs, through the
    constructor rather than a runtime_env (whose setup_worker start costs each rank)."""
    pool = RayResourcePool([2], use_gpu=False, name_prefix="rank_env")
    group = RayWorkerGroup(pool, RayClassWithInitArgs(InitEnvReader, tag="t"))
    plain = RayWorkerGroup(pool, RayClassWithInitArgs(PlainEnvReader))
    try:
        seen = group.execute_all_sync("seen")
        master = (seen[0][0][2]["MASTER_ADDR"], seen[0][0][2]["MASTER_PORT"])
        for rank, ((tag, rank_in_init, env), runtime_env) in enumerate(seen):
            assert tag == "t" and rank_in_init == rank
            assert env == {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                           "MASTER_ADDR": master[0], "MASTER_PORT": master[1], "WG_BACKEND": "ray"}
            assert runtime_env == "{}"
        assert [i["rank"] for i in group.rank_info()] == [0, 1]
        assert plain.execute_all_sync("seen") == [0, 1]
    finally:
        group.shutdown()
        plain.shutdown()
        pool.remove()


def test_groups_on_one_pool_share_its_gpus(gpu_groups):
    devices_a, devices_b = (g.execute_all_sync("get_cuda_visible_devices") for g in gpu_groups)
    assert devices_a == devices_b
    assert all(d != "" for d in devices_a) and devices_a[0] != devices_a[1]


def test_impossible_pool_fails_fast_with_what_was_asked(ray_cluster):
    start = time.monotonic()
    with pytest.raises(ResourceUnavailableError) as info:
        RayResourcePool([16], use_gpu=True, name_prefix="huge").get_placement_groups()
    message = str(info.value)
    assert "process_on_nodes=[16]" in message and "16 GPU" in message and "GPU: 8" in message
    assert time.monotonic() - start < 60


def test_pool_that_cannot_be_placed_now_times_out(ray_cluster):
    from ray.util.placement_group import placement_group, remove_placement_group

    free = ray.available_resources().get("GPU", 0)  # the module's GPU groups hold some
    assert free >= 1
    hog = placement_group([{"GPU": free}], strategy="STRICT_PACK")
    ray.get(hog.ready(), timeout=30)
    try:
        start = time.monotonic()
        with pytest.raises(ResourceUnavailableError, match="could not be placed within 2 s"):
            RayResourcePool([1], use_gpu=True, placement_timeout_s=2).get_placement_groups()
        assert time.monotonic() - start < 60
    finally:
        remove_placement_group(hog)


def test_pool_arguments_are_validated():
    with pytest.raises(ValueError, match="positive integers"):
        RayResourcePool([0])
    with pytest.raises(ValueError, match="positive integers"):
        RayResourcePool([2, "x"])


def test_registered_dispatch_error_is_a_value_error():
    assert issubclass(DispatchError, ValueError)


def test_a_group_asked_for_out_of_band_tensors_returns_them_without_torchs_pickling(group):
    # torch's pickling sends a view with its whole storage; the out-of-band path sends a
    # tensor's own bytes. So a 3-element view of an 8-element tensor arrives with 32 bytes
    # of storage from a default group (the module's), and with 12 from a group whose ranks
    # were asked for out-of-band tensors.
    pool = RayResourcePool([2], use_gpu=False, name_prefix="oob")
    out_of_band_cls = RayClassWithInitArgs(cls=ModeWorker)
    out_of_band_cls.send_tensors_out_of_band()
    out_of_band_group = RayWorkerGroup(pool, out_of_band_cls)
    try:
        out_of_band = out_of_band_group.execute_all_sync("views_of_one_storage")
    finally:
        out_of_band_group.shutdown()
        pool.remove()
    default = group.execute_all_sync("views_of_one_storage")
    assert len(default) == 4 and len(out_of_band) == 2
    for views, own_bytes in ((default, False), (out_of_band, True)):
        for rank, (whole, part, flag) in enumerate(views):
            assert whole.tolist() == [rank + float(i) for i in range(8)] and part.tolist() == whole[2:5].tolist()
            assert part.untyped_storage().nbytes() == (12 if own_bytes else 32)
            assert flag == ("1" if own_bytes else None)
            part.add_(100)  # writable either way
            assert part.tolist() == [rank + 102.0, rank + 103.0, rank + 104.0]


def test_out_of_band_tensors_reach_every_rank_as_a_tensor_of_its_own(group):
    from single_controller.ray.tensor_transport import send_tensors_out_of_band

    x = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: it goes through the object store
    send_tensors_out_of_band()
    try:
        outputs = group.scale_in_place(x)  # every rank writes to what it got
    finally:
        ray.util.deregister_serializer(torch.Tensor)
    assert [out[:3].tolist() for out in outputs] == [[0.0, rank + 1.0, 2 * (rank + 1.0)] for rank in range(4)]
    assert x[:3].tolist() == [0.0, 1.0, 2.0]


def test_rank_outcomes_of_a_groups_refs_are_what_rays_own_futures_give(group):
    """The controller awaits a call's refs through one tally (hybridflow.control.rank_answers):
    each rank's value, or the exception Ray's own future raises, in rank order."""

    async def both(method: str, **kwargs):
        ours = await rank_outcomes(group.execute_all_async(method, **kwargs), 60)
        theirs = await asyncio.gather(*(asyncio.wrap_future(ref.future()) for ref in group.execute_all_async(
            method, **kwargs)), return_exceptions=True)
        return ours, theirs

    ours, theirs = asyncio.run(both("echo", x=[10, 11, 12, 13]))
    assert [o.value for o in ours] == theirs == [(0, 10), (1, 11), (2, 12), (3, 13)]
    assert all(o.error is None for o in ours)
    ours, theirs = asyncio.run(both("size_of", t=None))  # every rank raises AttributeError
    for outcome, raised in zip(ours, theirs, strict=True):
        # Ray makes the class (a RayTaskError and the cause's class) anew for each error
        assert type(outcome.error).__name__ == type(raised).__name__ == "RayTaskError(AttributeError)"
        assert isinstance(outcome.error, AttributeError) and isinstance(outcome.error, ray.exceptions.RayTaskError)
        assert "numel" in str(outcome.error) and outcome.value is None

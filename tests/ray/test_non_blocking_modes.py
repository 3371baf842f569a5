"""Every dispatch mode called with ``blocking=False`` on a real group answers what the
blocking call answers once its futures are collected (the Megatron PROTO modes
failed when collected, their layout snapshot lacking the tp/dp/pp coordinates): on a
group that reports a 3D layout (tp=2, dp=1, pp=2 over 4 ranks, tp fastest, then dp, then
pp). On a MegatronRayWorkerGroup: tests/ray/test_megatron_group.py. DataProto batches:
tests/ray/test_verl_api.py."""

from __future__ import annotations

import pytest
import ray
import torch
from tensordict import TensorDict

from single_controller import DataProtoFuture
from single_controller.base.decorator import Dispatch, register
from single_controller.ray import RayClassWithInitArgs, RayResourcePool
from tests.ray.mode_workers import ModeWorker
from tests.ray.test_worker_group import LayoutGroup


def shifted(batch: TensorDict, rank: int) -> TensorDict:
    """The batch's rows moved by ``100 * rank``."""
    return TensorDict({"x": batch["x"] + 100 * rank}, batch_size=batch.batch_size)


@ray.remote
class EveryMode(ModeWorker.__ray_actor_class__):
    """test_worker_group's ModeWorker, with the modes it lacks."""

    @register(Dispatch.RANK_ZERO)
    def rank_zero_mode(self, x):
        return (self.rank, x)

    @register(Dispatch.MEGATRON_PP_AS_DP_PROTO)
    def pp_as_dp_rows(self, batch):
        return shifted(batch, self.rank)


def tensordict(n: int) -> TensorDict:
    return TensorDict({"x": torch.arange(float(n))}, batch_size=[n])


def resolve(answer):
    """A non-blocking answer's value: a batch future's or an ObjectRef's, or each of a list's."""
    if isinstance(answer, DataProtoFuture):
        return answer.get(timeout=120)
    if isinstance(answer, ray.ObjectRef):
        return ray.get(answer, timeout=120)
    if isinstance(answer, list):
        return [resolve(item) for item in answer]
    return answer


def same(a, b) -> bool:
    if isinstance(a, TensorDict):
        return isinstance(b, TensorDict) and torch.equal(a["x"], b["x"])
    return a == b


#: (method, arguments) for every mode; batches of 6 rows pad where the mode splits by 4 or 2.
CALLS = [
    ("one_to_all", lambda: (7,)),
    ("all_to_all", lambda: (["a", "b", "c", "d"],)),
    ("rank_zero", lambda: ("z",)),
    ("rank_zero_mode", lambda: (["p", "q", "r", "s"],)),
    ("dp_compute", lambda: ([10, 11, 12, 13],)),
    ("dp_proto", lambda: (tensordict(6),)),
    ("megatron_compute", lambda: (["dp0"],)),
    ("megatron_proto", lambda: (tensordict(3),)),
    ("pp_as_dp", lambda: (["stage0", "stage1"],)),
    ("pp_as_dp_rows", lambda: (tensordict(5),)),
    ("pp_only", lambda: ("w",)),
    ("micro_dp", lambda: (tensordict(3),)),
]


@pytest.fixture(scope="module")
def layout_group(ray_cluster):
    pool = RayResourcePool([4], use_gpu=False, name_prefix="nonblocking")
    group = LayoutGroup(pool, RayClassWithInitArgs(cls=EveryMode))
    group.set_layout(tp=2, dp=1, pp=2, micro_dp_group_size=2)
    yield group
    group.shutdown()
    pool.remove()


@pytest.mark.parametrize("method, make_args", CALLS, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CALLS)])
def test_non_blocking_answers_what_blocking_answers(layout_group, method, make_args):
    expected = layout_group.call_method(method, *make_args())
    answer = layout_group.call_method(method, *make_args(), blocking=False)
    assert same(resolve(answer), expected)


def test_the_layout_snapshot_carries_the_coordinates(layout_group):
    layout = layout_group.layout()
    assert (layout.tp_size, layout.dp_size, layout.pp_size, layout.micro_dp_group_size) == (2, 1, 2, 2)
    assert [(c.tp_rank, c.dp_rank, c.pp_rank) for c in layout.rank_infos] == [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1)]

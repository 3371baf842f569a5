"""test_worker_group's ModeWorker, in a module of its own: a rank imports the module that
defines its class, and a test module's imports (pytest, tensordict) would cost each rank
about a second of CPU at its start."""

from __future__ import annotations

import os

import ray
import torch

from single_controller.base import Worker
from single_controller.base.decorator import Dispatch, Execute, register


@ray.remote
class ModeWorker(Worker):
    """Answers every dispatch mode with what its rank saw. Batches are answered in their own
    class (a TensorDict), never named here: a rank that gets no batch never loads tensordict."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list = []

    def echo(self, x=None):
        return (self.rank, x)

    @register(Dispatch.ONE_TO_ALL)
    def one_to_all(self, x):
        return (self.rank, x)

    @register(Dispatch.ALL_TO_ALL)
    def all_to_all(self, x):
        return (self.rank, x)

    @register(Dispatch.ONE_TO_ALL)
    def scale_in_place(self, x):
        return x.mul_(self.rank + 1)

    def views_of_one_storage(self):
        whole = torch.arange(8.0) + self.rank
        return whole, whole[2:5], os.environ.get("HYBRIDFLOW_TENSORS_OUT_OF_BAND")

    @register(Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def rank_zero(self, x):
        return (self.rank, x)

    @register(Dispatch.DP_COMPUTE)
    def dp_compute(self, x):
        return (self.rank, x)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def dp_proto(self, batch):
        return type(batch)({"x": batch["x"] * 10, "rank": torch.full((batch.batch_size[0],), self.rank)},
                          batch_size=batch.batch_size)

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def dp_proto_async(self, batch):
        return type(batch)({"x": batch["x"] + 1}, batch_size=batch.batch_size)

    @register(Dispatch.MEGATRON_COMPUTE)
    def megatron_compute(self, x):
        return (self.rank, x)

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def megatron_proto(self, batch):
        return type(batch)({"x": batch["x"] * 2}, batch_size=batch.batch_size)

    @register(Dispatch.MEGATRON_PP_AS_DP)
    def pp_as_dp(self, x):
        return (self.rank, x)

    @register(Dispatch.MEGATRON_PP_ONLY)
    def pp_only(self, x):
        return (self.rank, x)

    @register(Dispatch.ALL_MICRO_DP)
    def micro_dp(self, batch):
        return type(batch)({"x": batch["x"] - 1}, batch_size=batch.batch_size)

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def one_to_all_async(self, x):
        return self.rank + x

    @register(Dispatch.ONE_TO_ALL)
    def append(self, item):
        self.history.append(item)
        return len(self.history)

    @register(Dispatch.ONE_TO_ALL)
    def get_history(self):
        return list(self.history)

    @register(Dispatch.ONE_TO_ALL)
    def size_of(self, t):
        return int(t.numel())

    def device_if_node_has_gpu(self):
        """get_device_name() and get_dist_backend() as they would answer on a GPU node (this
        CPU machine's torch made to report a visible GPU, for the call only)."""
        from unittest import mock

        from single_controller.device import get_device_name, get_dist_backend

        with mock.patch.object(torch.cuda, "is_available", return_value=True):
            return get_device_name(), get_dist_backend()

    def all_reduce_rank(self):
        import torch.distributed as dist

        from single_controller.device import get_dist_backend

        if not dist.is_initialized():
            dist.init_process_group(backend=get_dist_backend(), init_method="env://")
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return t.item()

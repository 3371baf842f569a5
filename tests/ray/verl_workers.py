"""test_verl_api's worker classes, in a module of their own: a rank imports the module
that defines its class, and the test module's imports (pytest, tensordict through
DataProto) would cost each rank about a second of CPU at its start; a rank that is sent
a DataProto loads tensordict then."""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

import numpy as np
import ray

from single_controller.base import Worker
from single_controller.base.decorator import Dispatch, register
from single_controller.base.megatron.worker import MegatronWorker

if TYPE_CHECKING:
    from single_controller import DataProto


@ray.remote
class ProtoWorker(Worker):
    @register(Dispatch.DP_COMPUTE_PROTO)
    def add_rank(self, data: DataProto) -> DataProto:
        data.batch["x"] += self.rank
        data.non_tensor_batch["who"] = np.array([f"rank{self.rank}"] * len(data), dtype=object)
        data.meta_info["seen_by"] = "workers"
        return data

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    async def square_later(self, data: DataProto) -> DataProto:
        await asyncio.sleep(0.05)
        data.batch["x"] = data.batch["x"] ** 2
        return data

    @register(Dispatch.DP_COMPUTE_METRIC)
    def row_sum(self, data: DataProto) -> float:
        return float(data.batch["x"].sum())

    @register(Dispatch.ONE_TO_ALL)
    def env(self, key: str) -> str | None:
        return os.environ.get(key)


@ray.remote
class SelfStartingMegatron(MegatronWorker):
    """Starts Megatron in its own __init__ (what NVMegatronRayWorkerGroup expects)."""

    def __init__(self) -> None:
        super().__init__()
        self.init_megatron({"tensor_model_parallel_size": 1})

    @register(Dispatch.MEGATRON_COMPUTE_PROTO, blocking=False)
    def tag(self, data: DataProto) -> DataProto:
        data.non_tensor_batch["dp"] = np.array([self.get_megatron_rank_info().dp_rank] * len(data), dtype=object)
        return data

    @register(Dispatch.MEGATRON_PP_AS_DP_PROTO, blocking=False)
    def tag_pp(self, data: DataProto) -> DataProto:
        return self.tag(data)

"""A worker that declares a mesh, for the controller's tests of mesh-dispatched methods."""

from __future__ import annotations

import ray
import torch

from single_controller import DataProto
from single_controller.base import Worker
from single_controller.base.decorator import make_nd_compute_dataproto_dispatch_fn, register


@ray.remote
class MeshDoubler(Worker):
    """Four ranks: mesh "actor" is dp=2 x tp=2, tp rank 0 answers for its dp rank."""

    def __init__(self) -> None:
        super().__init__()
        self._register_dispatch_collect_info("actor", dp_rank=self.rank // 2, is_collect=self.rank % 2 == 0)
        self.rows = 0

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("actor"))
    def double(self, data: DataProto) -> DataProto:
        data.batch["x"] = data.batch["x"] * 2
        data.batch["who"] = torch.full((len(data),), self.rank)
        return data

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("undeclared"))
    def elsewhere(self, data: DataProto) -> DataProto:
        self.rows += len(data)
        return data

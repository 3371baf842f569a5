"""Megatron worker groups: RayWorkerGroups whose workers run megatron-core and report the
tp/dp/pp layout the MEGATRON dispatch modes read.

``MegatronRayWorkerGroup`` initialises Megatron on its workers (``init_megatron`` with
``default_megatron_kwargs``) and then reads the layout; ``NVMegatronRayWorkerGroup``
(verl v0.4's name) is for workers that initialise Megatron themselves in ``__init__``,
and only reads it. Attached to running workers (``from_detached``) neither initialises.
"""

from __future__ import annotations

from typing import Any

from single_controller.megatron.parallel_info import MegatronGlobalInfo, MegatronRankInfo
from single_controller.ray.resource_pool import RayResourcePool
from single_controller.ray.worker_group import RayClassWithInitArgs, RayWorkerGroup


class MegatronRayWorkerGroup(RayWorkerGroup):
    """A group of ``MegatronWorker`` subclasses: it initialises Megatron on them
    (``default_megatron_kwargs``) and reads every rank's tp/dp/pp/cp coordinates."""

    #: Whether the group calls ``init_megatron`` on workers it starts.
    _initialises_megatron = True
    #: Set after the workers' methods are bound, so no worker method may take them.
    _reserved = RayWorkerGroup._reserved | {"default_megatron_kwargs", "micro_dp_group_size"}

    def __init__(
        self,
        resource_pool: RayResourcePool | None,
        ray_cls_with_init: RayClassWithInitArgs,
        default_megatron_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(resource_pool=resource_pool, ray_cls_with_init=ray_cls_with_init, **kwargs)
        self.default_megatron_kwargs = dict(default_megatron_kwargs or {})
        try:
            if self._initialises_megatron and not self._is_init_with_detached_workers:
                self.execute_all_sync("init_megatron", default_megatron_kwargs=self.default_megatron_kwargs)
            self._rank_infos: list[MegatronRankInfo] = self.execute_all_sync("get_megatron_rank_info")
            self._global_info: MegatronGlobalInfo = self.execute_rank_zero_sync("get_megatron_global_info")
        except Exception:
            if not self._is_init_with_detached_workers:
                self.shutdown()
            raise
        #: ALL_MICRO_DP groups: by default one per tensor-parallel group.
        self.micro_dp_group_size = self._global_info.tp_size

    @property
    def tp_size(self) -> int:
        return self._global_info.tp_size

    @property
    def pp_size(self) -> int:
        return self._global_info.pp_size

    @property
    def dp_size(self) -> int:
        return self._global_info.dp_size

    @property
    def cp_size(self) -> int:
        return self._global_info.cp_size

    def get_megatron_rank_info(self, rank: int) -> MegatronRankInfo:
        return self._rank_infos[rank]

    def get_megatron_global_info(self) -> MegatronGlobalInfo:
        return self._global_info


class NVMegatronRayWorkerGroup(MegatronRayWorkerGroup):
    """verl v0.4's group for workers that initialise Megatron in their own ``__init__``:
    it reads their layout and never calls ``init_megatron``."""

    _initialises_megatron = False

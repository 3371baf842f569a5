"""MegatronRayWorkerGroup: a RayWorkerGroup whose workers run megatron-core, reporting the
tp/dp/pp layout the MEGATRON dispatch modes read."""

from __future__ import annotations

from typing import Any

from single_controller.megatron.parallel_info import MegatronGlobalInfo, MegatronRankInfo
from single_controller.ray.resource_pool import RayResourcePool
from single_controller.ray.worker_group import RayClassWithInitArgs, RayWorkerGroup


class MegatronRayWorkerGroup(RayWorkerGroup):
    def __init__(
        self,
        resource_pool: RayResourcePool,
        ray_cls_with_init: RayClassWithInitArgs,
        default_megatron_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(resource_pool=resource_pool, ray_cls_with_init=ray_cls_with_init, **kwargs)
        self.default_megatron_kwargs = dict(default_megatron_kwargs or {})
        try:
            self.execute_all_sync("init_megatron", default_megatron_kwargs=self.default_megatron_kwargs)
            self._rank_infos: list[MegatronRankInfo] = self.execute_all_sync("get_megatron_rank_info")
            self._global_info: MegatronGlobalInfo = self.execute_rank_zero_sync("get_megatron_global_info")
        except Exception:
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

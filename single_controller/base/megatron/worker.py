"""verl v0.4's import path: ``from single_controller.base.megatron.worker import MegatronWorker``
(the same class as :mod:`single_controller.megatron.worker`'s)."""

from single_controller.megatron.parallel_info import MegatronGlobalInfo, MegatronRankInfo
from single_controller.megatron.worker import MegatronWorker

#: verl's names for the layout records.
DistRankInfo = MegatronRankInfo
DistGlobalInfo = MegatronGlobalInfo

__all__ = ["DistGlobalInfo", "DistRankInfo", "MegatronWorker"]

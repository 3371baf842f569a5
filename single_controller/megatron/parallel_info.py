"""Where a rank sits in Megatron's 3D (+cp) layout; plain data, no torch.distributed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MegatronRankInfo:
    tp_rank: int
    dp_rank: int
    pp_rank: int
    cp_rank: int = 0


@dataclass(frozen=True)
class MegatronGlobalInfo:
    tp_size: int
    dp_size: int
    pp_size: int
    cp_size: int = 1

"""A tensor-parallel Llama MLP built from megatron-core's own parallel layers.

``gate_up_proj`` is one ColumnParallelLinear of ``2 * intermediate_size`` outputs with
``stride=2``: megatron then carves each rank's shard as this rank's gate rows followed
by its up rows (``[2*ffn/tp, hidden]``), so a rank needs no communication before the
activation. Why the stride: the master weight is ``[gate; up]`` (``[2*ffn, hidden]``).
With stride 1 rank ``r`` would take the contiguous rows ``[r*2*ffn/tp, (r+1)*2*ffn/tp)``,
i.e. for tp=2 rank 0 all of gate and rank 1 all of up, and ``chunk(2)`` would then pair
the wrong rows. With CPU initialisation megatron splits the master into ``tp*stride``
chunks of ``ffn/tp`` rows and gives rank ``r`` chunks ``r, r+tp, ...``: gate shard ``r``
then up shard ``r``. Every rank draws the same master from the seeded torch RNG, so
the shards are consistent across ranks and identical after a rebuild with that seed.

``down_proj`` is a RowParallelLinear (``[hidden, ffn/tp]``) whose forward all-reduces
the partial sums.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

#: Activations by Hugging Face's ``hidden_act`` names.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}

INIT_STD = 0.02


def _as_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    try:
        from omegaconf import OmegaConf

        return dict(OmegaConf.to_container(config, resolve=True))
    except Exception:
        return dict(vars(config))


class ParallelLlamaMLP(torch.nn.Module):
    """``ParallelLlamaMLP(config=config, megatron_config=OmegaConf.create({'sequence_parallel_enabled': False}))``.

    ``config`` (dict or OmegaConf): hidden_size, intermediate_size, hidden_act,
    pretraining_tp, and optionally tp (checked against megatron's tp size). Call it
    after ``initialize_model_parallel``; seed torch first for reproducible weights.
    """

    def __init__(self, config: Any, megatron_config: Any = None) -> None:
        super().__init__()
        from megatron.core import ModelParallelConfig, parallel_state
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        cfg = _as_dict(config)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        try:
            hidden = int(cfg["hidden_size"])
            ffn = int(cfg["intermediate_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"config needs integer hidden_size and intermediate_size: {exc}") from None
        act = cfg.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"unknown hidden_act {act!r}; known: {', '.join(ACTIVATIONS)}")
        if hidden <= 0 or ffn <= 0:
            raise ValueError(f"hidden_size and intermediate_size must be positive, got {hidden}, {ffn}")
        if cfg.get("tp") is not None and int(cfg["tp"]) != tp:
            raise ValueError(f"config tp={cfg['tp']} but megatron's tensor-parallel size is {tp}")
        if ffn % tp:
            raise ValueError(f"intermediate_size {ffn} is not divisible by tp {tp}")
        if int(cfg.get("pretraining_tp", 1) or 1) != 1:
            raise ValueError("pretraining_tp > 1 is not supported")
        mcfg = _as_dict(megatron_config) if megatron_config is not None else {}
        parallel_config = ModelParallelConfig(
            tensor_model_parallel_size=tp,
            sequence_parallel=bool(mcfg.get("sequence_parallel_enabled", False)),
            use_cpu_initialization=True,
            perform_initialization=True,
            params_dtype=torch.float32,
        )
        init = functools.partial(torch.nn.init.normal_, mean=0.0, std=INIT_STD)
        self.hidden_size, self.intermediate_size, self.tp = hidden, ffn, tp
        self.act_fn = ACTIVATIONS[act]
        self.gate_up_proj = ColumnParallelLinear(
            hidden, 2 * ffn, config=parallel_config, init_method=init, bias=False,
            gather_output=False, stride=2, skip_bias_add=True,
        )
        self.down_proj = RowParallelLinear(
            ffn, hidden, config=parallel_config, init_method=init, bias=False,
            input_is_parallel=True, skip_bias_add=True,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"input must be [seq, batch, {self.hidden_size}], got {list(x.shape)}")
        if x.dtype != self.gate_up_proj.weight.dtype:
            raise ValueError(f"input must be {self.gate_up_proj.weight.dtype}, got {x.dtype}")
        gate_up, _ = self.gate_up_proj(x)
        gate, up = gate_up.chunk(2, dim=-1)
        out, _ = self.down_proj(self.act_fn(gate) * up)
        return out

"""The tutorial's MLPLayerWorker: builds a ParallelLlamaMLP on every rank and runs it
under MEGATRON_COMPUTE (one input per dp rank in, one output per dp rank out); trains it
by SGD steps; and takes part in weight syncs (``single_controller.weights``) with the
layer declared by Hugging Face's logical names ``gate_proj``, ``up_proj``, ``down_proj``
whatever the fused storage."""

from __future__ import annotations

import math
import os
from typing import Any

import ray
import torch
import torch.nn.functional as F

from single_controller.base.decorator import Dispatch, register
from single_controller.device import get_torch_device
from single_controller.megatron.worker import MegatronWorker
from single_controller.models.llama import DEFAULT_MAX_PARAMETERS
from single_controller.weights.layout import ParamSpec, RankWeights
from single_controller.weights.worker import WeightSyncWorker

#: The fused storage of the layer's two parameters.
GATE_UP, DOWN = "gate_up_proj.weight", "down_proj.weight"


@ray.remote
class MLPLayerWorker(WeightSyncWorker, MegatronWorker):
    def __init__(self, max_parameters: int = DEFAULT_MAX_PARAMETERS, checkpoint_dirs: list[str] | None = None) -> None:
        """``max_parameters``: the largest layer ``init_model`` builds (``3 * hidden *
        intermediate``, all ranks together); a bigger one is refused before allocating.
        ``checkpoint_dirs``: the directories ``init_model`` may read a checkpoint from,
        every file of it resolved (symlinks followed) inside one of them; None or empty:
        none, so a checkpoint is read only from directories listed here."""
        super().__init__()
        if isinstance(max_parameters, bool) or not isinstance(max_parameters, int) or max_parameters < 1:
            raise ValueError(f"max_parameters must be a positive integer, got {max_parameters!r}")
        self._max_parameters = max_parameters
        self._checkpoint_dirs = [os.path.realpath(d) for d in checkpoint_dirs or []]

    def _check_checkpoint_path(self, config: Any) -> None:
        path = config.get("checkpoint") if hasattr(config, "get") else None
        if path is None:
            return
        real = os.path.realpath(str(path))
        if not any(os.path.commonpath([real, allowed]) == allowed for allowed in self._checkpoint_dirs):
            allowed = ", ".join(self._checkpoint_dirs) or "none"
            raise ValueError(
                f"checkpoint {path!r} is outside the directories this layer may read ({allowed}); "
                f"add its directory to the worker's checkpoint_dirs"
            )

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self, config: Any) -> None:
        """Build the layer from ``config`` (a dict): ``hidden_size``, ``intermediate_size``,
        ``hidden_act``, ``seed`` for a seeded random layer; or ``checkpoint`` (a safetensors
        file or directory, Hugging Face Llama layout) and ``layer_index`` to load that layer,
        each rank reading only its slices. A bad config raises ValueError and keeps the
        current layer."""
        from omegaconf import OmegaConf

        from single_controller.models.llama import ParallelLlamaMLP

        self._check_checkpoint_path(config)
        megatron_config = OmegaConf.create({"sequence_parallel_enabled": False})
        layer = ParallelLlamaMLP(
            config=config,
            megatron_config=megatron_config,
            max_parameters=self._max_parameters,
            checkpoint_dirs=self._checkpoint_dirs,
        )
        self.parallel_layer = layer.to(get_torch_device())
        # new weights that no sync gave: version 0, and a staged sync no longer fits them
        self._weights_reset()

    @register(Dispatch.ONE_TO_ALL)
    def get_weights(self) -> dict[str, torch.Tensor]:
        return {key: val.detach().cpu() for key, val in self.parallel_layer.named_parameters()}

    def _layer(self, method: str) -> Any:
        if not hasattr(self, "parallel_layer"):
            raise ValueError(f"call init_model before {method}")
        return self.parallel_layer

    @register(Dispatch.MEGATRON_COMPUTE)
    def run_layer(self, x: torch.Tensor) -> torch.Tensor:
        self._layer("run_layer")
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"run_layer takes a tensor, got {type(x).__name__}")
        with torch.no_grad():
            y = self.parallel_layer(x.to(get_torch_device()))
        return y.cpu()

    @register(Dispatch.ONE_TO_ALL)
    def train_step(self, x: torch.Tensor, target: torch.Tensor, lr: float) -> float:
        """One SGD step, all ranks together, on the mean squared error of the layer's
        output for ``x`` (``[seq, batch, hidden]``) against ``target`` (the same shape);
        answers that error, before the step. Every rank gets the same batch (dp copies
        take the same step and stay copies); megatron's parallel layers give each tp rank
        the gradient of its own shard."""
        layer = self._layer("train_step")
        for name, value in (("x", x), ("target", target)):
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"train_step: {name} must be a tensor, got {type(value).__name__}")
        if x.dim() != 3 or target.shape != x.shape[:-1] + (layer.hidden_size,):
            raise ValueError(
                f"train_step: x must be [seq, batch, {layer.hidden_size}] and target the same shape, "
                f"got {list(x.shape)} and {list(target.shape)}"
            )
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
            raise ValueError(f"train_step: lr must be a positive finite number, got {lr!r}")
        device = get_torch_device()
        params = list(layer.parameters())
        for param in params:
            param.grad = None
        with torch.enable_grad():
            loss = F.mse_loss(layer(x.to(device)), target.to(device, dtype=x.dtype))
            loss.backward()
        with torch.no_grad():
            for param in params:
                param.add_(param.grad, alpha=-float(lr))
                param.grad = None
        return float(loss.detach())

    # -- weight sync: the layer's declaration (single_controller.weights) ------------------
    def _declare_weights(self) -> RankWeights:
        from megatron.core import parallel_state as ps

        layer = self._layer("a weight sync")
        hidden, ffn = layer.hidden_size, layer.intermediate_size
        dtype = str(layer.gate_up_proj.weight.dtype).removeprefix("torch.")
        return RankWeights(
            rank=self.rank,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            dp_rank=ps.get_data_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            params=(
                ParamSpec("gate_proj", (ffn, hidden), dtype, split_dim=0),
                ParamSpec("up_proj", (ffn, hidden), dtype, split_dim=0),
                ParamSpec("down_proj", (hidden, ffn), dtype, split_dim=1),
            ),
        )

    def _weight_storage(self) -> dict[str, torch.Tensor]:
        layer = self._layer("a weight sync")
        return {GATE_UP: layer.gate_up_proj.weight, DOWN: layer.down_proj.weight}

    def _logical_views(self, storage: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # a rank's fused shard is its gate rows followed by the same rows of up (stride 2)
        gate, up = storage[GATE_UP].chunk(2, dim=0)
        return {"gate_proj": gate, "up_proj": up, "down_proj": storage[DOWN]}

    def _io_spec(self) -> dict[str, Any]:
        """The layer's input and output as an inference model sees them: FP32
        ``[seq, batch, hidden]`` for the hidden size it was initialised with."""
        hidden = self.parallel_layer.hidden_size if hasattr(self, "parallel_layer") else -1
        tensor = {"datatype": "FP32", "shape": [-1, -1, hidden]}
        return {"inputs": [{"name": "x", **tensor}], "outputs": [{"name": "y", **tensor}]}

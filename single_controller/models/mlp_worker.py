"""The tutorial's MLPLayerWorker: builds a ParallelLlamaMLP on every rank and runs it
under MEGATRON_COMPUTE (one input per dp rank in, one output per dp rank out)."""

from __future__ import annotations

from typing import Any

import ray
import torch

from single_controller.base.decorator import Dispatch, register
from single_controller.device import get_torch_device
from single_controller.megatron.worker import MegatronWorker


@ray.remote
class MLPLayerWorker(MegatronWorker):
    @register(Dispatch.ONE_TO_ALL)
    def init_model(self, config: Any) -> None:
        from omegaconf import OmegaConf

        from single_controller.models.llama import ParallelLlamaMLP

        seed = int(dict(config).get("seed", 0)) if hasattr(config, "keys") else 0
        torch.manual_seed(seed)  # identical master weights on every rank, and after a rebuild
        megatron_config = OmegaConf.create({"sequence_parallel_enabled": False})
        layer = ParallelLlamaMLP(config=config, megatron_config=megatron_config)
        self.parallel_layer = layer.to(get_torch_device())

    @register(Dispatch.ONE_TO_ALL)
    def get_weights(self) -> dict[str, torch.Tensor]:
        return {key: val.detach().cpu() for key, val in self.parallel_layer.named_parameters()}

    @register(Dispatch.MEGATRON_COMPUTE)
    def run_layer(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "parallel_layer"):
            raise ValueError("call init_model before run_layer")
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"run_layer takes a tensor, got {type(x).__name__}")
        with torch.no_grad():
            y = self.parallel_layer(x.to(get_torch_device()))
        return y.cpu()

    def _io_spec(self) -> dict[str, Any]:
        """The layer's input and output as an inference model sees them: FP32
        ``[seq, batch, hidden]`` for the hidden size it was initialised with."""
        hidden = self.parallel_layer.hidden_size if hasattr(self, "parallel_layer") else -1
        tensor = {"datatype": "FP32", "shape": [-1, -1, hidden]}
        return {"inputs": [{"name": "x", **tensor}], "outputs": [{"name": "y", **tensor}]}

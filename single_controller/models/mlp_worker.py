"""The tutorial's MLPLayerWorker: builds a ParallelLlamaMLP on every rank and runs it
under MEGATRON_COMPUTE (one input per dp rank in, one output per dp rank out)."""

from __future__ import annotations

import os
from typing import Any

import ray
import torch

from single_controller.base.decorator import Dispatch, register
from single_controller.device import get_torch_device
from single_controller.megatron.worker import MegatronWorker
from single_controller.models.llama import DEFAULT_MAX_PARAMETERS


@ray.remote
class MLPLayerWorker(MegatronWorker):
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

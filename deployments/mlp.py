"""The tp=4 Llama MLP layer: a MegatronRayWorkerGroup of MLPLayerWorker, initialised at
start from the deployment's config, served as ``mlp`` (and as the OIP model ``mlp``)."""

from __future__ import annotations

from typing import Any

from ray import serve

from deployments.group_controller import GroupSpec
from deployments.served_controller import ServedController, replica_pool
from single_controller.models.mlp_worker import MLPLayerWorker
from single_controller.ray import MegatronRayWorkerGroup, RayClassWithInitArgs

#: The tutorial's layer.
DEFAULT_LAYER = {"hidden_size": 4096, "intermediate_size": 11008, "hidden_act": "silu", "pretraining_tp": 1}


@serve.deployment(name="mlp", max_ongoing_requests=64)
class MLPDeployment(ServedController):
    def __init__(
        self,
        use_gpu: bool = False,
        request_timeout_s: float = 120.0,
        tp: int = 4,
        layer: dict[str, Any] | None = None,
    ) -> None:
        pool = replica_pool(first_bundle=1, process_count=tp, use_gpu=use_gpu)
        self.start_config = {**DEFAULT_LAYER, **(layer or {}), "tp": tp}
        megatron_kwargs = {
            "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": 1,
            "num_layers_per_virtual_pipeline_stage": None,
        }

        def build() -> MegatronRayWorkerGroup:
            group = MegatronRayWorkerGroup(
                resource_pool=pool,
                ray_cls_with_init=RayClassWithInitArgs(cls=MLPLayerWorker),
                default_megatron_kwargs=megatron_kwargs,
            )
            group.init_model(self.start_config)
            return group

        def layout(group: MegatronRayWorkerGroup) -> dict[str, Any]:
            return {"tp_size": group.tp_size, "dp_size": group.dp_size, "pp_size": group.pp_size}

        spec = GroupSpec(
            "mlp",
            build,
            MLPLayerWorker,
            f"pool [{tp}] (STRICT_PACK)",
            read_only=frozenset({"get_weights", "run_layer"}),
            extra_info=layout,
        )
        super().__init__([spec], request_timeout_s=request_timeout_s)

    def layer_config(self) -> dict[str, Any]:
        """The layer's current shape: the start config, or the last init_model's."""
        state = self._groups["mlp"]
        for method, args, kwargs in reversed(state.journal):
            if method == "init_model":
                config = kwargs.get("config", args[0] if args else None)
                if isinstance(config, dict):
                    return {**self.start_config, **config}
        return dict(self.start_config)

    async def handle_io_spec(self, group: str, method: str) -> dict[str, Any]:
        """``run_layer``'s ``x`` and ``y``: FP32 ``[seq, batch, hidden]``, any seq and batch."""
        if method != "run_layer":
            return {}
        hidden = int(self.layer_config()["hidden_size"])
        tensor = {"datatype": "FP32", "shape": [-1, -1, hidden]}
        return {"inputs": [{"name": "x", **tensor}], "outputs": [{"name": "y", **tensor}]}

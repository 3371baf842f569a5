"""MegatronWorker: a Worker that joins torch.distributed (gloo on CPU, nccl on GPU) through
the group's rendezvous and initialises megatron-core's model-parallel groups."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from single_controller.base import Worker
from single_controller.device import get_dist_backend, get_torch_device, is_cuda_available
from single_controller.gloo_device import share_gloo_device
from single_controller.megatron.core_import import import_megatron_core
from single_controller.megatron.parallel_info import MegatronGlobalInfo, MegatronRankInfo

#: Keys ``init_megatron`` understands (the tutorial passes the first three).
MEGATRON_KWARGS = {
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "num_layers",
    "seed",
}


def _virtual_pp_size(kwargs: dict[str, Any], pp: int) -> int | None:
    if kwargs.get("virtual_pipeline_model_parallel_size") is not None:
        return int(kwargs["virtual_pipeline_model_parallel_size"])
    per_stage = kwargs.get("num_layers_per_virtual_pipeline_stage")
    if per_stage is None:
        return None
    num_layers = kwargs.get("num_layers")
    if num_layers is None:
        raise ValueError("num_layers_per_virtual_pipeline_stage needs num_layers to derive the virtual pp size")
    return int(num_layers) // pp // int(per_stage)


class MegatronWorker(Worker):
    """Subclass it (``@ray.remote``) for workers of a ``MegatronRayWorkerGroup``.

    Once Megatron's parallel state is up (``init_megatron``), each rank declares its place
    in the mesh named :attr:`megatron_mesh_name`, as verl's Megatron workers do: its dp
    rank, collecting on tp rank 0 of the last pp stage (cp rank 0). So a method registered
    with ``make_nd_compute_dataproto_dispatch_fn(<that name>)`` splits a batch by dp, as
    ``MEGATRON_COMPUTE_PROTO`` does. A subclass names its mesh by setting the attribute.
    """

    #: The mesh this worker's Megatron layout is declared under.
    megatron_mesh_name: str = "megatron"

    def init_megatron(self, default_megatron_kwargs: dict[str, Any] | None = None) -> None:
        import_megatron_core()
        from megatron.core import parallel_state

        kwargs = dict(default_megatron_kwargs or {})
        unknown = set(kwargs) - MEGATRON_KWARGS
        if unknown:
            raise ValueError(f"unknown megatron kwargs {sorted(unknown)}; known: {sorted(MEGATRON_KWARGS)}")
        tp = int(kwargs.get("tensor_model_parallel_size") or 1)
        pp = int(kwargs.get("pipeline_model_parallel_size") or 1)
        cp = int(kwargs.get("context_parallel_size") or 1)
        if self.world_size % (tp * pp * cp):
            raise ValueError(f"world size {self.world_size} is not divisible by tp*pp*cp = {tp * pp * cp}")
        # megatron-core's many gloo groups then cost one idle loop thread, not one each.
        share_gloo_device()
        if not dist.is_initialized():
            backend = get_dist_backend()
            if backend == "nccl":
                torch.cuda.set_device(get_torch_device())
            dist.init_process_group(
                backend=backend,
                init_method="env://",
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(minutes=10),
            )
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=_virtual_pp_size(kwargs, pp),
                context_parallel_size=cp,
            )
        # The same seed on every rank: layers built with CPU initialisation then carve
        # their shards out of identical master weights.
        seed = int(kwargs.get("seed", 0))
        torch.manual_seed(seed)
        if is_cuda_available():
            # Megatron's per-tp-rank CUDA RNG streams (dropout and GPU-side init inside
            # tensor-parallel regions); it resets its tracker, so calling twice is safe.
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(seed)
        self._register_megatron_mesh()

    def _register_megatron_mesh(self) -> None:
        """Declare this rank's place in :attr:`megatron_mesh_name`, once Megatron's
        parallel state is up (and only once)."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized() or self.megatron_mesh_name in self._mesh_places.names():
            return
        last_stage = ps.get_pipeline_model_parallel_world_size() - 1
        collects = (
            ps.get_tensor_model_parallel_rank() == 0
            and ps.get_pipeline_model_parallel_rank() == last_stage
            and ps.get_context_parallel_rank() == 0
        )
        self._register_dispatch_collect_info(self.megatron_mesh_name, ps.get_data_parallel_rank(), collects)

    def get_megatron_rank_info(self) -> MegatronRankInfo:
        from megatron.core import parallel_state as ps

        # A worker that set up Megatron without init_megatron declares its mesh here: the
        # group reads this first, before any call dispatches by the mesh.
        self._register_megatron_mesh()
        return MegatronRankInfo(
            tp_rank=ps.get_tensor_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            cp_rank=ps.get_context_parallel_rank(),
        )

    def get_megatron_global_info(self) -> MegatronGlobalInfo:
        from megatron.core import parallel_state as ps

        return MegatronGlobalInfo(
            tp_size=ps.get_tensor_model_parallel_world_size(),
            dp_size=ps.get_data_parallel_world_size(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            cp_size=ps.get_context_parallel_world_size(),
        )

"""The Serve application: the three controller deployments and the ingress, wired from
the serve config's ``args`` (``import_path: deployments.application:build``)."""

from __future__ import annotations

from typing import Any

import ray
from ray.serve import Application

from app.ingress import Ingress
from app.settings import ServiceSettings
from deployments import accumulators, test_actor
from deployments.accumulators import AccumulatorsDeployment
from deployments.jobs import JobsDeployment
from deployments.mlp import MLPDeployment
from deployments.test_actor import TestActorDeployment

#: The ingress sends tensors it decoded from request bodies to the controllers with Ray's
#: zero-copy tensor serialisation (the controller reads them straight from the object
#: store instead of unpickling a copy). Only the ingress: it never writes to a tensor it
#: sent, and the controllers send on to the workers by the default path, so a worker
#: always gets a tensor of its own to modify.
INGRESS_RUNTIME_ENV = {"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}}


def _cluster_gpus() -> float:
    if not ray.is_initialized():
        ray.init(address="auto")
    return float(ray.cluster_resources().get("GPU", 0.0))


class GpuBudget:
    """``use_gpu: auto`` gives a deployment GPU bundles while the cluster has enough left
    for all of its workers, in config order; the rest run on CPU bundles."""

    def __init__(self, setting: str | bool) -> None:
        self.setting = setting
        self.left = _cluster_gpus() if setting == "auto" else 0.0

    def take(self, workers: int) -> bool:
        if self.setting != "auto":
            return bool(self.setting)
        if self.left >= workers:
            self.left -= workers
            return True
        return False


def _placement(settings: ServiceSettings, workers: int, use_gpu: bool) -> dict[str, Any]:
    """The replica's own bundle first, then one per worker: Serve reserves them with the
    replica (so the scheduler and autoscaler see them) and frees them when it stops."""
    worker_bundle: dict[str, float] = {"CPU": settings.worker_cpus}
    if use_gpu:
        worker_bundle["GPU"] = 1.0
    return {
        "ray_actor_options": {"num_cpus": settings.replica_cpus},
        "placement_group_bundles": [{"CPU": settings.replica_cpus}] + [dict(worker_bundle) for _ in range(workers)],
        "placement_group_strategy": "STRICT_PACK",
    }


def build(args: dict[str, Any] | None = None) -> Application:
    settings = ServiceSettings.from_args(args)
    gpus = GpuBudget(settings.use_gpu)
    timeout = settings.request_timeout_s
    wanted = set(settings.deployments)
    controllers: dict[str, Application] = {}

    if "mlp" in wanted:
        use_gpu = gpus.take(settings.mlp.tp)
        controllers["mlp"] = MLPDeployment.options(**_placement(settings, settings.mlp.tp, use_gpu)).bind(
            use_gpu=use_gpu,
            request_timeout_s=timeout,
            tp=settings.mlp.tp,
            layer={
                "hidden_size": settings.mlp.hidden_size,
                "intermediate_size": settings.mlp.intermediate_size,
                "hidden_act": settings.mlp.hidden_act,
            },
        )
    if "accumulators" in wanted:
        use_gpu = gpus.take(accumulators.WORKER_BUNDLES)
        controllers["accumulators"] = AccumulatorsDeployment.options(
            **_placement(settings, accumulators.WORKER_BUNDLES, use_gpu)
        ).bind(use_gpu=use_gpu, request_timeout_s=timeout)
    if "test_actor" in wanted:
        use_gpu = gpus.take(test_actor.WORKER_BUNDLES)
        controllers["test_actor"] = TestActorDeployment.options(
            **_placement(settings, test_actor.WORKER_BUNDLES, use_gpu)
        ).bind(use_gpu=use_gpu, request_timeout_s=timeout)
    jobs = JobsDeployment.bind(controllers=controllers)
    return Ingress.options(
        num_replicas=settings.ingress_replicas,
        ray_actor_options={"num_cpus": settings.ingress_cpus, "runtime_env": INGRESS_RUNTIME_ENV},
    ).bind(controllers=controllers, settings=settings.model_dump(mode="json"), jobs=jobs)

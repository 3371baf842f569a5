"""The Serve application, built from the serve config's ``args``
(``import_path: hybridflow.serve.application:build``): one controller deployment per declared
deployment, the jobs deployment, and the HTTP ingress with its static route table."""

from __future__ import annotations

import dataclasses
from typing import Any

import ray
from ray.serve import Application

from hybridflow.config import ServiceConfig, load_config
from hybridflow.control.placement import GpuBudget, hosted_bundles, plan_deployment
from hybridflow.http.errors import STATUS_OF
from hybridflow.http.settings import IngressSettings, ModelRoute
from hybridflow.serve.controller import ControllerDeployment
from hybridflow.serve.ingress import Ingress
from hybridflow.serve.jobs import JobsDeployment

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


def ingress_settings(config: ServiceConfig) -> IngressSettings:
    """What the ingress needs: its HTTP settings and where each group and model lives."""
    limits = config.limits
    return IngressSettings(
        auth_token=config.auth_token,
        trusted_proxies=config.trusted_proxies,
        login_failures_per_minute=limits.login_failures_per_minute,
        login_failures_per_minute_total=limits.login_failures_per_minute_total,
        max_body_bytes=config.max_body_bytes,
        request_timeout_s=config.request_timeout_s,
        max_split=limits.max_split,
        limits=dataclasses.asdict(limits.wire()),
        groups=config.deployment_of_group(),
        models={
            model.name: ModelRoute(deployment=d.name, group=model.group, outputs=[t.name for t in model.outputs])
            for d, model in config.models()
        },
    )


def build(args: dict[str, Any] | None = None) -> Application:
    config = load_config(args)
    # Where serve run starts: the replicas get an absolute state path (theirs may be elsewhere).
    config.state = config.state.resolved()
    budget = GpuBudget(_cluster_gpus())
    service = config.model_dump(mode="json", exclude={"deployments"})
    # The controllers count calls by the HTTP status the ingress answers (hybridflow.control.metrics).
    status_codes = {kind.value: status for kind, status in STATUS_OF.items()}
    read_only = {group.name: list(group.read_only) for _, group in config.groups()}
    if config.controllers_embedded:
        return _controlling_ingress(config, budget, service, read_only, status_codes)
    controllers: dict[str, Application] = {}
    for deployment in config.deployments:
        plan = plan_deployment(deployment, config, budget)
        controllers[deployment.name] = ControllerDeployment.options(
            name=deployment.name, max_ongoing_requests=deployment.max_ongoing_requests, **plan.serve_options(),
            **config.health_check_options(),
        ).bind(deployment.model_dump(mode="json"), plan, service, status_codes)
    jobs = JobsDeployment.bind(controllers, read_only, config.limits.model_dump())
    return Ingress.options(
        num_replicas=config.ingress_replicas,
        ray_actor_options={"num_cpus": config.ingress_cpus, "runtime_env": INGRESS_RUNTIME_ENV},
    ).bind(controllers, ingress_settings(config).model_dump(), jobs)


def _controlling_ingress(
    config: ServiceConfig,
    budget: GpuBudget,
    service: dict[str, Any],
    read_only: dict[str, list[str]],
    status_codes: dict[str, int],
) -> Application:
    """``controllers_in_ingress``: one ingress replica hosting every controller, its
    placement group holding every pool's bundles (no zero-copy runtime env: the tensors it
    decodes go to the workers, which may write to theirs)."""
    from hybridflow.serve.ingress_controllers import ControllingIngress

    plans = [plan_deployment(deployment, config, budget) for deployment in config.deployments]
    bundles, shifts = hosted_bundles(plans, config.ingress_cpus)
    jobs = JobsDeployment.bind(None, read_only, config.limits.model_dump())
    return ControllingIngress.options(
        num_replicas=1,
        ray_actor_options={"num_cpus": config.ingress_cpus},
        placement_group_bundles=bundles,
        placement_group_strategy="STRICT_PACK",
        **config.health_check_options(),
    ).bind(
        [d.model_dump(mode="json") for d in config.deployments], plans, shifts, service, status_codes,
        ingress_settings(config).model_dump(), jobs,
    )

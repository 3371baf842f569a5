"""The application's ``args`` as a whole: the service's settings, its limits and its
deployments."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from ipaddress import ip_network
from typing import Literal

from pydantic import Field, IPvAnyNetwork, field_validator, model_validator

from hybridflow.config.groups import DeploymentConfig, GroupConfig, ModelConfig, _Strict
from hybridflow.config.state import StateConfig
from hybridflow_client.wire.limits import DEFAULT_LIMITS as WIRE_DEFAULTS
from hybridflow_client.wire.limits import MAX_DEPTH as WIRE_MAX_DEPTH
from hybridflow_client.wire.limits import WireLimits

#: Trusted proxies by default: only this host's own (a proxy beside the service).
LOOPBACK = ("127.0.0.1/32", "::1/128")


class LimitsConfig(_Strict):
    """Bounds that keep a request's cost in proportion to its bytes, and the service's
    memory bounded (every one has a default; docs/configuration.md lists them)."""

    max_tensors: int = Field(WIRE_DEFAULTS.max_tensors, ge=1, description="tensors in one body")
    max_json_values: int = Field(WIRE_DEFAULTS.max_json_values, ge=1, description="JSON values in one body")
    max_json_output_values: int = Field(
        WIRE_DEFAULTS.max_json_output_values, ge=1,
        description="values in a JSON answer; larger answers need Accept: application/x-safetensors",
    )
    max_tensor_elements: int = Field(WIRE_DEFAULTS.max_tensor_elements, ge=1, description="elements of one tensor")
    max_ndim: int = Field(WIRE_DEFAULTS.max_ndim, ge=1, description="dimensions of one tensor")
    max_depth: int = Field(
        WIRE_DEFAULTS.max_depth, ge=1, le=WIRE_MAX_DEPTH,
        description="nesting of lists and objects (at most 100: what the state store keeps)",
    )
    max_split: int = Field(4096, ge=1, description="pieces of a job (?split=N)")
    max_split_views: int = Field(WIRE_DEFAULTS.max_split_views, ge=1, description="pieces x tensors of a split job")
    idempotency_keys: int = Field(10_000, ge=0, description="answers kept per controller for Idempotency-Key repeats")
    idempotency_bytes: int = Field(256 << 20, ge=0, description="bytes of those answers")
    jobs_running: int = Field(4, ge=1, description="jobs running at once; more wait in the queue")
    jobs_queued: int = Field(64, ge=0, description="jobs waiting; more answer 429")
    jobs_kept: int = Field(100, ge=0, description="finished jobs kept for their status")
    jobs_result_bytes: int = Field(1 << 30, ge=0, description="bytes of finished jobs' results kept")
    login_failures_per_minute: int = Field(
        10, ge=1, description="wrong tokens a client address may send to POST /login in a minute; more answer 429"
    )
    login_failures_per_minute_total: int = Field(
        100, ge=1, description="wrong tokens all clients together may send to POST /login in a minute (per ingress "
        "replica), whatever address they come from; more answer 429 for every client"
    )
    weight_syncs_queued: int = Field(
        4, ge=0, description="weight syncs that may wait per destination group while one runs; more answer 429"
    )
    events_kept: int = Field(
        10_000, ge=1, description="events GET /v1/events keeps for a client that resumes (Last-Event-ID); a resume "
        "from before them starts with an events_lost event"
    )

    def wire(self) -> WireLimits:
        """The bounds the decoders (wire) take."""
        return WireLimits(**{f.name: getattr(self, f.name) for f in dataclasses.fields(WireLimits)})


class ServiceConfig(_Strict):
    """The application's ``args`` in serve_config.yaml."""

    use_gpu: Literal["auto"] | bool = Field(
        "auto", description="default for pools; auto: GPU bundles for a deployment when the cluster has GPUs enough left"
    )
    replica_cpus: float = Field(0.05, ge=0, description="CPUs each controller replica reserves")
    worker_cpus: float = Field(0.05, ge=0, description="CPUs each worker bundle reserves")
    ingress_cpus: float = Field(0.05, ge=0)
    ingress_replicas: int = Field(1, ge=1)
    controllers_in_ingress: Literal["auto"] | bool = Field(
        "auto",
        description="true: every deployment's controller runs in the ingress replica (one Serve hop fewer per "
        "call; the ingress holds every pool's bundles, and there is one ingress replica); false: each "
        "deployment's controller is a replica of its own; auto: true while ingress_replicas is 1",
    )
    request_timeout_s: float = Field(120.0, gt=0, description="a call that runs longer answers 504")
    health_timeout_s: float = Field(10.0, gt=0, description="an idle worker that does not answer a ping this long is lost")
    health_check_period_s: float = Field(
        10.0, gt=0, description="seconds between Serve's health checks of each replica that hosts controllers: how "
        "soon a lost or hung worker is noticed (each check pings every group's workers)",
    )
    health_check_timeout_s: float = Field(
        30.0, gt=0, description="a health check of such a replica that takes longer fails, and Serve restarts the "
        "replica (the checks never wait behind calls)",
    )
    max_body_bytes: int = Field(1 << 30, gt=0, description="larger request bodies answer 413")
    auth_token: str | None = Field(
        None, description="when set (or HYBRIDFLOW_TOKEN is), every route but health checks needs 'Bearer <token>'"
    )
    trusted_proxies: list[IPvAnyNetwork] = Field(
        default_factory=lambda: [ip_network(n) for n in LOOPBACK],
        description="IP addresses or networks of reverse proxies whose X-Forwarded-For (the client's address, "
        "for the login limit) and X-Forwarded-Proto (https: the login cookie is Secure) are believed; "
        "default loopback only; [] believes no proxy",
    )
    state: StateConfig = StateConfig()
    limits: LimitsConfig = LimitsConfig()
    deployments: list[DeploymentConfig] = Field(..., min_length=1)

    @field_validator("auth_token")
    @classmethod
    def _blank_is_none(cls, value: str | None) -> str | None:
        return value or None

    @model_validator(mode="after")
    def _one_controlling_ingress(self) -> ServiceConfig:
        if self.controllers_in_ingress is True and self.ingress_replicas != 1:
            raise ValueError(
                f"controllers_in_ingress needs ingress_replicas 1 (each controller exists once), "
                f"got {self.ingress_replicas}"
            )
        return self

    def health_check_options(self) -> dict[str, float]:
        """Serve's options for the replicas that host controllers."""
        return {"health_check_period_s": self.health_check_period_s,
                "health_check_timeout_s": self.health_check_timeout_s}

    @property
    def controllers_embedded(self) -> bool:
        """Whether the controllers run in the ingress replica. A group needs one sequencer,
        so an ingress scaled out to several replicas keeps them in replicas of their own."""
        if self.controllers_in_ingress == "auto":
            return self.ingress_replicas == 1
        return bool(self.controllers_in_ingress)

    # -- lookups ------------------------------------------------------------------
    def groups(self) -> Iterator[tuple[DeploymentConfig, GroupConfig]]:
        for deployment in self.deployments:
            for group in deployment.groups:
                yield deployment, group

    def deployment_of_group(self) -> dict[str, str]:
        return {group.name: deployment.name for deployment, group in self.groups()}

    def models(self) -> Iterator[tuple[DeploymentConfig, ModelConfig]]:
        for deployment in self.deployments:
            for model in deployment.models:
                yield deployment, model

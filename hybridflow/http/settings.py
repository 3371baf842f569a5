"""What the ingress knows: its HTTP settings and a static table of where each group and
model is served, built once from the serve config when the application is built."""

from __future__ import annotations

from ipaddress import ip_network
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, IPvAnyNetwork

from hybridflow.config.service import LOOPBACK
from hybridflow_client.wire.limits import WireLimits


class ModelRoute(BaseModel):
    """Where an inference model runs and what it answers (the controller owns the rest)."""

    model_config = ConfigDict(extra="forbid")

    deployment: str
    group: str
    outputs: list[str] = Field(..., description="output names, in order")


class IngressSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    auth_token: str | None = None
    #: Proxies whose X-Forwarded-For and X-Forwarded-Proto are believed (hybridflow.http.proxies).
    trusted_proxies: list[IPvAnyNetwork] = Field(default_factory=lambda: [ip_network(n) for n in LOOPBACK])
    #: Wrong tokens a client may send to POST /login in a minute (hybridflow.http.login_limit).
    login_failures_per_minute: int = Field(10, gt=0)
    #: Wrong tokens all clients together may send to POST /login in a minute.
    login_failures_per_minute_total: int = Field(100, gt=0)
    max_body_bytes: int = Field(1 << 30, gt=0)
    request_timeout_s: float = Field(120.0, gt=0)
    max_split: int = 4096
    #: Bounds on what a body may make the decoders build (hybridflow_client.wire.limits.WireLimits fields).
    limits: dict[str, Any] = Field(default_factory=dict)
    #: group -> the deployment (controller) that owns it.
    groups: dict[str, str] = Field(default_factory=dict)
    #: model -> where it runs.
    models: dict[str, ModelRoute] = Field(default_factory=dict)

    def wire_limits(self) -> WireLimits:
        return WireLimits.from_mapping(self.limits)

    def deployment_of(self, group: str) -> str | None:
        return self.groups.get(group)

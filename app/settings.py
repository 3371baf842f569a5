"""Service settings, from the serve config's application ``args`` (and the environment)."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class OIPModel(BaseModel):
    """How an Open Inference Protocol model maps onto a group method: its one input
    tensor is ``method``'s argument, and what the method returns is the output."""

    model_config = ConfigDict(extra="forbid")

    controller: str
    group: str
    method: str
    dp_list: bool = Field(
        False,
        description="the method takes a list of inputs, one per data-parallel rank, and returns one "
        "output per input (MEGATRON_COMPUTE): the tensor goes in as a one-item list",
    )
    input: str = "x"
    output: str = "y"


class MLPSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tp: int = Field(4, ge=1, description="tensor-parallel size (and workers)")
    hidden_size: int = Field(4096, ge=1)
    intermediate_size: int = Field(11008, ge=1)
    hidden_act: str = "silu"


class ServiceSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    use_gpu: Literal["auto"] | bool = Field(
        "auto", description="auto: GPU bundles for a deployment when the cluster has GPUs enough left for it"
    )
    replica_cpus: float = Field(0.05, ge=0, description="CPUs each controller replica reserves")
    worker_cpus: float = Field(0.05, ge=0, description="CPUs each worker bundle reserves")
    ingress_cpus: float = Field(0.05, ge=0)
    ingress_replicas: int = Field(1, ge=1)
    request_timeout_s: float = Field(120.0, gt=0, description="a call that runs longer answers 504")
    max_body_bytes: int = Field(1 << 30, gt=0, description="larger request bodies answer 413")
    auth_token: str | None = Field(
        None, description="when set (or SC_AUTH_TOKEN is), every route but health checks needs 'Bearer <token>'"
    )
    deployments: list[Literal["accumulators", "test_actor", "mlp"]] = Field(
        default_factory=lambda: ["accumulators", "test_actor", "mlp"],
        description="controller deployments to run",
    )
    mlp: MLPSettings = MLPSettings()
    oip_models: dict[str, OIPModel] = Field(
        default_factory=lambda: {
            "mlp": OIPModel(controller="mlp", group="mlp", method="run_layer", dp_list=True),
            # transport checks: a tensor back whole, and a tensor in with 8 bytes out
            "echo": OIPModel(controller="test_actor", group="test_actor", method="echo"),
            "checksum": OIPModel(controller="test_actor", group="test_actor", method="checksum"),
        }
    )

    @field_validator("auth_token")
    @classmethod
    def _blank_is_none(cls, value: str | None) -> str | None:
        return value or None

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> ServiceSettings:
        settings = cls.model_validate(args or {})
        token = os.environ.get("SC_AUTH_TOKEN")
        if token:
            settings.auth_token = token
        return settings

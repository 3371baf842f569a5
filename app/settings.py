"""What the ingress knows: its HTTP settings and a static table of where each group and
model is served, built once from the serve config when the application is built."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ModelRoute(BaseModel):
    """Where an inference model runs and what it answers (the controller owns the rest)."""

    model_config = ConfigDict(extra="forbid")

    deployment: str
    group: str
    outputs: list[str] = Field(..., description="output names, in order")


class IngressSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    auth_token: str | None = None
    max_body_bytes: int = Field(1 << 30, gt=0)
    request_timeout_s: float = Field(120.0, gt=0)
    max_json_tensors: int = 10_000
    max_json_values: int = 10_000_000
    max_json_answer_values: int = 10_000_000
    max_split: int = 4096
    #: group -> the deployment (controller) that owns it.
    groups: dict[str, str] = Field(default_factory=dict)
    #: model -> where it runs.
    models: dict[str, ModelRoute] = Field(default_factory=dict)

    def deployment_of(self, group: str) -> str | None:
        return self.groups.get(group)

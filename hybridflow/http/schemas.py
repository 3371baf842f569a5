"""Request and response bodies of the /v1 API (they also make up the OpenAPI schema)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class CallBody(BaseModel):
    """The JSON body of a call (the controller's message is ``control.contract.CallRequest``):
    positional and keyword arguments of a worker-group method call. A value may be a
    JSON value, a tensor object (``{"datatype", "shape", "data"}``), or lists of them."""

    model_config = ConfigDict(extra="forbid")

    args: list[Any] = Field(default_factory=list, examples=[[]])
    kwargs: dict[str, Any] = Field(default_factory=dict, examples=[{"x": [1, 1, 1, 1]}])


class CallResponse(BaseModel):
    group: str
    method: str
    dispatch_mode: str = Field(..., description="registered dispatch mode, or EXECUTE_ALL for unregistered methods")
    execute_mode: str
    world_size: int
    output: Any = Field(
        ...,
        description="collected result: a list by rank (ALL collects), one value (RANK_ZERO), one item per dp rank "
        "(MEGATRON_COMPUTE); tensors as tensor objects",
    )


class MethodDescription(BaseModel):
    name: str
    dispatch_mode: str
    execute_mode: str
    registered: bool
    read_only: bool = Field(..., description="changes no state: not journaled")


class GroupBody(BaseModel):
    """A group as the API answers it (the controller's message is ``control.contract.GroupSummary``)."""

    model_config = ConfigDict(extra="allow")

    name: str
    deployment: str = Field(..., description="the controller deployment that owns the group")
    world_size: int | None
    resource_pool: str
    worker_class: str
    status: str = Field(..., description="starting, ready, rebuilding, restoring (in place), replacing (ranks) "
                                         "or failed")
    last_error: str | None = Field(None, description="why the group last rebuilt or failed")
    rebuilds: int = 0
    replayed_calls: int = Field(0, description="journaled calls replayed by rebuilds so far")
    journal_length: int = Field(0, description="acknowledged mutating calls a rebuild would replay")
    colocated_with: list[str] = Field(default_factory=list, description="groups sharing these processes")
    transport: str = Field("tasks", description="how calls reach the ranks: tasks (a Ray task per rank) or compiled "
                                                "(one Ray Compiled Graph over the group's processes)")
    snapshot_error: str | None = Field(
        None, description="why the latest snapshot failed (retried; the journal keeps every call meanwhile)"
    )
    weights_version: int | None = Field(
        None, description="a group whose worker declares weights: their version (0 until a weight sync)"
    )
    weights_error: str | None = Field(None, description="why the latest weight sync into the group failed")
    methods: list[MethodDescription]
    restarts: int = Field(0, description="restarts after a lost rank or a failed start (supervision)")
    replaced_ranks: int = Field(0, description="ranks replaced alone (on_rank_lost: replace_rank)")
    on_rank_lost: str = Field("rebuild_group", description="what a lost rank does: rebuild_group, replace_rank or halt")


class RankDetail(BaseModel):
    model_config = ConfigDict(extra="allow")

    rank: int
    local_rank: int
    node_id: str | None = None
    tp_rank: int | None = None
    dp_rank: int | None = None
    pp_rank: int | None = None


class MeshDescription(BaseModel):
    dp_size: int = Field(..., description="the mesh's data-parallel size: a batch is split in this many parts")
    collect_ranks: list[int] = Field(..., description="the rank whose output is collected, for each dp rank in order")


class GroupDetail(GroupBody):
    ranks: list[RankDetail] = Field(default_factory=list)
    meshes: dict[str, MeshDescription] | None = Field(
        None, description="the named meshes the group's workers declared (null when they declared none)"
    )


class GroupList(BaseModel):
    groups: list[GroupBody]


class ErrorResponse(BaseModel):
    """Any failure: a status code of 4xx or 5xx and this body."""

    error: str = Field(..., description="What went wrong.", examples=["unknown model 'nope'"])


class Health(BaseModel):
    status: str
    #: Each group's readiness (only to a client with the token, when one is configured).
    groups: dict[str, bool] | None = None


class JobStatus(BaseModel):
    id: str
    group: str
    method: str
    status: str = Field(..., description="queued, running, succeeded, failed or cancelled")
    progress: float = Field(..., ge=0, le=1)
    split: int
    error: str | None = None
    error_kind: str | None = Field(None, description="why a failed job failed (the ErrorKind's value, e.g. timeout)")
    status_code: int | None = Field(None, description="the status a call would have answered (200 when succeeded)")
    submitted_at: float
    elapsed_s: float


CALL_BODY_DOC = {
    "requestBody": {
        "required": False,
        "content": {
            "application/json": {"schema": CallBody.model_json_schema()},
            "application/x-safetensors": {
                "schema": {"type": "string", "format": "binary"},
                "description": "keyword tensors by name; list items as name.0, name.1, ...",
            },
        },
    }
}

INFER_BODY_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"type": "object", "description": "OIP v2 inference request"}},
            "application/octet-stream": {
                "schema": {"type": "string", "format": "binary"},
                "description": "binary tensor data extension: JSON header (Inference-Header-Content-Length "
                "bytes) followed by the tensors' raw bytes",
            },
        },
    }
}

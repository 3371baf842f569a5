"""A deployment's declaration: its groups (worker class, pool, Megatron layout, init calls)
and the OIP models served on them."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: Names that appear in URLs (groups, models) and in Serve (deployments).
NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_-]{0,62}$"
#: Serve deployment names the application itself uses.
RESERVED_DEPLOYMENTS = frozenset({"ingress", "jobs"})
WORKER_PATTERN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
Datatype = Literal["BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "FP16", "BF16", "FP32", "FP64"]
#: How a group's calls reach its ranks (hybridflow.control.transport).
Transport = Literal["socket", "compiled", "tasks", "auto"]


class ConfigError(ValueError):
    """The serve config does not describe a service; the message lists each problem."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PoolConfig(_Strict):
    """Where a group's ranks run: a new pool, another group's pool, or a merge of pools."""

    process_on_nodes: list[int] | None = Field(
        None, description="processes per node: [4] is 4 on one node, [2, 2] two on each of two nodes"
    )
    use_gpu: Literal["auto"] | bool | None = Field(
        None, description="a GPU per process; auto: while the cluster has GPUs enough left (default: the service's)"
    )
    name_prefix: str | None = None
    max_colocate_count: int = Field(10, ge=1, description="groups that may share one bundle")
    num_cpus_per_bundle: float | None = Field(None, ge=0, description="default: the service's worker_cpus")
    same_as: str | None = Field(None, description="share this group's pool (its bundles; processes of its own)")
    merge: list[str] | None = Field(None, description="merge_resource_pool of these groups' pools, in order")

    @field_validator("process_on_nodes")
    @classmethod
    def _positive(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or any(isinstance(n, bool) or n <= 0 for n in value)):
            raise ValueError(f"must be a non-empty list of positive integers, got {value}")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> PoolConfig:
        given = [key for key in ("process_on_nodes", "same_as", "merge") if getattr(self, key) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of process_on_nodes, same_as, merge (got {given or 'none'})")
        if self.merge is not None and len(self.merge) < 2:
            raise ValueError("merge needs at least two groups")
        if given != ["process_on_nodes"]:
            defaults = {"use_gpu": None, "name_prefix": None, "max_colocate_count": 10, "num_cpus_per_bundle": None}
            changed = [k for k, v in defaults.items() if getattr(self, k) != v]
            if changed:
                raise ValueError(f"{', '.join(changed)} apply only to a pool of its own (process_on_nodes)")
        return self


class InitCall(_Strict):
    """A call made on the group after it starts (and again after every rebuild)."""

    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)


class MegatronConfig(_Strict):
    """Megatron's parallel layout: the group becomes a MegatronRayWorkerGroup."""

    tensor_model_parallel_size: int = Field(1, ge=1)
    pipeline_model_parallel_size: int = Field(1, ge=1)
    context_parallel_size: int = Field(1, ge=1)
    virtual_pipeline_model_parallel_size: int | None = Field(None, ge=1)
    num_layers_per_virtual_pipeline_stage: int | None = Field(None, ge=1)
    num_layers: int | None = Field(None, ge=1)
    seed: int = 0

    def kwargs(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


#: What a lost rank does to its group (``supervision.on_rank_lost``).
REBUILD_GROUP, REPLACE_RANK, HALT = "rebuild_group", "replace_rank", "halt"
OnRankLost = Literal["rebuild_group", "replace_rank", "halt"]


class BackoffConfig(_Strict):
    """Seconds between a failed start and the next try: ``initial``, doubled after each
    further failure, at most ``max``."""

    initial: float = Field(1.0, gt=0, description="seconds before the first try after a failed start")
    max: float = Field(60.0, gt=0, description="the longest wait between tries")

    @model_validator(mode="after")
    def _ordered(self) -> BackoffConfig:
        if self.max < self.initial:
            raise ValueError(f"max ({self.max:g}) is below initial ({self.initial:g})")
        return self


class SupervisionConfig(_Strict):
    """What the service does when one of a group's ranks is lost, and how often it may
    restart the group before it halts it (hybridflow.control.supervisor carries it out)."""

    on_rank_lost: OnRankLost = Field(
        REBUILD_GROUP,
        description="rebuild_group: the whole group on fresh workers, its state restored; replace_rank: a new "
        "worker for the lost rank alone, in its bundle, its state restored, while the other ranks keep their "
        "processes; halt: the group is failed until POST /v1/admin/groups/{group}/restart or /reset",
    )
    max_restarts: int = Field(
        10, ge=0, description="restarts (after a lost rank, or a failed start) allowed within restart_window_s; "
        "the next one halts the group instead"
    )
    restart_window_s: float = Field(600.0, gt=0, description="the sliding window max_restarts counts in")
    backoff_s: BackoffConfig = BackoffConfig()


class GroupConfig(_Strict):
    name: str = Field(..., pattern=NAME_PATTERN)
    worker: str = Field(..., description="module:Class, a Worker subclass (@ray.remote or plain)")
    init_args: list[Any] = Field(default_factory=list)
    init_kwargs: dict[str, Any] = Field(default_factory=dict)
    pool: PoolConfig | None = None
    plain_actor: bool = Field(
        False, description="a plain Ray actor (any class, not a Worker) served as a group of one, with no pool"
    )
    read_only: list[str] = Field(default_factory=list, description="methods that change no state: not journaled")
    colocate_with: list[str] = Field(
        default_factory=list, description="groups on the same pool whose roles share this group's processes"
    )
    megatron: MegatronConfig | None = None
    init_calls: list[InitCall] = Field(default_factory=list)
    actor_options: dict[str, Any] = Field(
        default_factory=dict, description="extra Ray actor options for every worker (runtime_env, ...)"
    )
    weights_from: str | None = Field(
        None,
        description="a group of this deployment whose weights this group takes once both are ready at start "
        "(a weight sync: docs/weight-sync.md); both groups' workers declare weights",
    )
    transport: Transport = Field(
        "auto",
        description="how calls reach the ranks: socket (one TCP connection per rank, a pickled frame per rank and "
        "call from the controller's event loop; nothing polls while idle), compiled (one Ray Compiled Graph over the "
        "group's processes: no Ray task per rank and call, but its ranks poll while idle), tasks (a Ray task per "
        "rank and call), auto (socket where the group can take every call over a channel, else tasks)",
    )

    supervision: SupervisionConfig = Field(
        SupervisionConfig(), description="what a lost rank does to the group, and the bounds on its restarts"
    )

    @field_validator("worker")
    @classmethod
    def _worker_path(cls, value: str) -> str:
        if not WORKER_PATTERN.match(value):
            raise ValueError(f"must be 'module:Class', got {value!r}")
        return value

    @model_validator(mode="after")
    def _pool_or_actor(self) -> GroupConfig:
        if self.plain_actor:
            extras = [k for k in ("pool", "megatron") if getattr(self, k) is not None] + (
                ["colocate_with"] if self.colocate_with else []
            )
            if extras:
                raise ValueError(f"a plain_actor group has no {', '.join(extras)}")
        elif self.pool is None:
            raise ValueError("needs a pool (or plain_actor: true for a plain Ray actor)")
        if self.megatron is not None and self.colocate_with:
            raise ValueError("megatron groups cannot be colocated (colocate_with)")
        if self.weights_from is not None and (self.plain_actor or self.colocate_with):
            raise ValueError("weights_from needs a group of its own processes (not a plain actor, not colocated)")
        return self


class TensorSpec(_Strict):
    name: str = Field(..., min_length=1)
    datatype: Datatype
    shape: list[int] = Field(..., description="sizes, -1 for any size")

    @field_validator("shape")
    @classmethod
    def _dims(cls, value: list[int]) -> list[int]:
        if any(d < -1 for d in value):
            raise ValueError(f"dimensions are sizes, or -1 for any size: {value}")
        return value


class BatchingConfig(_Strict):
    """Dynamic batching of concurrent inference requests (Triton's dynamic batcher)."""

    max_batch_size: int = Field(1, ge=1, description="requests in one group call; 1: no batching")
    max_queue_delay_microseconds: int = Field(0, ge=0, description="longest a request waits for others")
    wait_when_idle: bool = Field(
        True,
        description="whether a request that finds no batch of its model running waits for others (Triton's "
        "behaviour); false: it leaves at once, and batches form from the requests that arrive while one runs",
    )
    batch_dim: int = Field(
        0, ge=0, description="the dimension requests are concatenated along (1 for [seq, batch, hidden])"
    )


class ModelConfig(_Strict):
    """An Open Inference Protocol model: one group method, tensors in and out."""

    name: str = Field(..., pattern=NAME_PATTERN)
    group: str
    method: str
    inputs: list[TensorSpec] = Field(..., min_length=1, max_length=1)
    outputs: list[TensorSpec] = Field(..., min_length=1, max_length=1)
    dp_list: bool = Field(
        False,
        description="the method takes one input per data-parallel rank (MEGATRON_COMPUTE): the tensor goes in as "
        "a one-item list, and the output is the list's one item",
    )
    io_method: str | None = Field(
        None,
        description="a method (public or not) whose rank-0 answer {'inputs': [...], 'outputs': [...]} replaces the "
        "declared tensors while the group runs: for a model whose shapes follow its state",
    )
    batching: BatchingConfig = BatchingConfig()
    platform: str = "hybridflow_worker_group"

    @model_validator(mode="after")
    def _batchable(self) -> ModelConfig:
        dim = self.batching.batch_dim
        if self.batching.max_batch_size > 1:
            for spec in (*self.inputs, *self.outputs):
                if dim >= len(spec.shape) or spec.shape[dim] != -1:
                    raise ValueError(
                        f"batching.batch_dim {dim}: {spec.name!r} of shape {spec.shape} needs -1 (any size) "
                        "there to take concatenated requests"
                    )
        return self


class DeploymentConfig(_Strict):
    name: str = Field(..., pattern=NAME_PATTERN)
    groups: list[GroupConfig] = Field(..., min_length=1)
    models: list[ModelConfig] = Field(default_factory=list)
    max_ongoing_requests: int = Field(256, ge=1)

"""The serve config's ``args``: deployments of worker groups, declared, validated here.

One deployment is one single controller (a Serve deployment) that owns the groups
declared under it::

    deployments:
      - name: counters
        groups:
          - name: counter
            worker: my_pkg.workers:Counter        # module:Class
            init_kwargs: {start: 5}
            pool: {process_on_nodes: [2], use_gpu: auto, name_prefix: c}
            read_only: [get]
          - name: counter_view
            worker: my_pkg.workers:Viewer
            pool: {same_as: counter}               # the same bundles, processes of its own
        models:
          - {name: my_model, group: counter, method: get, inputs: [...], outputs: [...]}

Validation needs no Ray: :func:`load_config` checks the shape with pydantic, then what
the shape cannot say (names that refer to other names, worker classes that import and
are Workers, models whose method exists), and raises :class:`ConfigError` whose message
names every problem by its path in the config (``deployments[counters].groups[counter].
pool.same_as: ...``).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hybridflow.state.backends import open_store
from hybridflow.state.store import (
    DEFAULT_MAX_ANSWER_BYTES,
    DEFAULT_MAX_ANSWERS,
    DEFAULT_STATE_PATH,
    REDIS_SCHEMES,
    StateStore,
)
from hybridflow.wire.limits import DEFAULT_LIMITS as WIRE_DEFAULTS
from hybridflow.wire.limits import WireLimits

#: Names that appear in URLs (groups, models) and in Serve (deployments).
NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_-]{0,62}$"
#: Serve deployment names the application itself uses.
RESERVED_DEPLOYMENTS = frozenset({"ingress", "jobs"})
WORKER_PATTERN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
Datatype = Literal["BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "FP16", "BF16", "FP32", "FP64"]


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


#: Environment variables read where ``serve run`` starts (``build(args)``): a state path
#: that overrides ``state.path`` (``null`` or ``:memory:`` for in-memory state), and a
#: fresh start (``1``) as ``state.fresh: true`` would (``make serve-fresh`` sets it).
STATE_PATH_ENV = "SC_STATE_PATH"
STATE_FRESH_ENV = "SC_STATE_FRESH"


class StateConfig(_Strict):
    """Where acknowledged calls, snapshots and idempotency answers are kept
    (``hybridflow.state.store``), and how groups restore from them."""

    path: str | None = Field(
        DEFAULT_STATE_PATH,
        description="SQLite file (relative to the directory serve run starts from), a redis:// URL, "
        "or null: in memory only (state dies with the controller replica)",
    )
    redis_url: str | None = Field(
        None, description="redis://host:port/db: a store every node reaches, used instead of path when set"
    )
    snapshot_every: int = Field(
        1000, ge=0, description="snapshot a group that has state_dict()/load_state_dict() every N acknowledged "
        "mutating calls and truncate its journal (0: never)"
    )
    fresh: bool = Field(
        False, description="discard the stored state once per Ray session (a replica Serve restarts keeps its state)"
    )
    on_mismatch: Literal["error", "reset"] = Field(
        "error", description="stored state that no longer fits a group (world size, worker class, init arguments): "
        "refuse to start, or discard that group's state"
    )
    synchronous: Literal["NORMAL", "FULL"] = Field(
        "NORMAL", description="SQLite: NORMAL survives process crashes, FULL also power loss (an fsync per call)"
    )
    busy_timeout_s: float = Field(10.0, gt=0, description="SQLite: how long a write waits for another process's")
    max_answers: int = Field(DEFAULT_MAX_ANSWERS, ge=1, description="idempotency answers kept in the store per group")
    max_answer_bytes: int = Field(DEFAULT_MAX_ANSWER_BYTES, ge=1, description="their bytes per group")
    namespace: str = Field("hybridflow", min_length=1, description="Redis key prefix (one per application)")

    @field_validator("path", "redis_url")
    @classmethod
    def _not_empty(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty (null means in memory)")
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(REDIS_SCHEMES):
            raise ValueError(f"must start with one of {', '.join(REDIS_SCHEMES)}, got {value!r}")
        return value

    @property
    def location(self) -> str | None:
        """What the store opens: the Redis URL when set, else the path (None: in memory)."""
        return self.redis_url or self.path

    def resolved(self, env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None) -> StateConfig:
        """This config as a replica must get it: ``SC_STATE_PATH`` and ``SC_STATE_FRESH``
        applied, and a file path made absolute against ``cwd`` (default: this process's
        working directory). Called where ``serve run`` starts (``build(args)``), never in a
        replica, whose working directory may be another."""
        env = os.environ if env is None else env
        update: dict[str, Any] = {}
        override = env.get(STATE_PATH_ENV)
        if override:
            path = None if override in (":memory:", "null") else override
            update = {"path": path, "redis_url": None}
        else:
            path = self.location
        if path is not None and not path.startswith(REDIS_SCHEMES):
            base = os.fspath(cwd) if cwd is not None else os.getcwd()
            update.update(path=os.path.abspath(os.path.join(base, os.path.expanduser(path))), redis_url=None)
        if env.get(STATE_FRESH_ENV, "").strip().lower() in ("1", "true", "yes"):
            update["fresh"] = True
        return self.model_copy(update=update)

    def open(self) -> StateStore:
        """The :class:`~hybridflow.state.store.StateStore` this (resolved) config names."""
        return open_store(
            self.location, namespace=self.namespace, synchronous=self.synchronous,
            busy_timeout_s=self.busy_timeout_s, max_answers=self.max_answers, max_answer_bytes=self.max_answer_bytes,
        )


class LimitsConfig(_Strict):
    """Bounds that keep a request's cost in proportion to its bytes, and the service's
    memory bounded (every one has a default; the README lists them)."""

    max_tensors: int = Field(WIRE_DEFAULTS.max_tensors, ge=1, description="tensors in one body")
    max_json_values: int = Field(WIRE_DEFAULTS.max_json_values, ge=1, description="JSON values in one body")
    max_json_output_values: int = Field(
        WIRE_DEFAULTS.max_json_output_values, ge=1,
        description="values in a JSON answer; larger answers need Accept: application/x-safetensors",
    )
    max_tensor_elements: int = Field(WIRE_DEFAULTS.max_tensor_elements, ge=1, description="elements of one tensor")
    max_ndim: int = Field(WIRE_DEFAULTS.max_ndim, ge=1, description="dimensions of one tensor")
    max_depth: int = Field(WIRE_DEFAULTS.max_depth, ge=1, description="nesting of lists and objects")
    max_split: int = Field(4096, ge=1, description="pieces of a job (?split=N)")
    max_split_views: int = Field(WIRE_DEFAULTS.max_split_views, ge=1, description="pieces x tensors of a split job")
    idempotency_keys: int = Field(10_000, ge=0, description="answers kept per controller for Idempotency-Key repeats")
    idempotency_bytes: int = Field(256 << 20, ge=0, description="bytes of those answers")
    jobs_running: int = Field(4, ge=1, description="jobs running at once; more wait in the queue")
    jobs_queued: int = Field(64, ge=0, description="jobs waiting; more answer 429")
    jobs_kept: int = Field(100, ge=0, description="finished jobs kept for their status")
    jobs_result_bytes: int = Field(1 << 30, ge=0, description="bytes of finished jobs' results kept")

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
    controllers_in_ingress: bool = Field(
        False,
        description="run every deployment's controller in the ingress replica (one Serve hop fewer per call; "
        "the ingress then holds every pool's bundles, and there is one ingress replica)",
    )
    request_timeout_s: float = Field(120.0, gt=0, description="a call that runs longer answers 504")
    health_timeout_s: float = Field(10.0, gt=0, description="an idle worker that does not answer a ping this long is lost")
    max_body_bytes: int = Field(1 << 30, gt=0, description="larger request bodies answer 413")
    auth_token: str | None = Field(
        None, description="when set (or SC_AUTH_TOKEN is), every route but health checks needs 'Bearer <token>'"
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
        if self.controllers_in_ingress and self.ingress_replicas != 1:
            raise ValueError(
                f"controllers_in_ingress needs ingress_replicas 1 (each controller exists once), "
                f"got {self.ingress_replicas}"
            )
        return self

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


# -- loading and the checks pydantic's shape cannot make -----------------------------------


def import_worker(path: str) -> Any:
    """The object ``module:Qualified.Name`` names; ImportError/AttributeError as they come."""
    module_name, _, qualname = path.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _where(loc: tuple, document: Any) -> str:
    """A pydantic location as a config path, list items named by their ``name``."""
    parts: list[str] = []
    node = document
    for key in loc:
        if isinstance(key, int) and isinstance(node, list):
            item = node[key] if key < len(node) else None
            name = item.get("name") if isinstance(item, dict) else None
            parts[-1] += f"[{name}]" if isinstance(name, str) else f"[{key}]"
            node = item
        else:
            parts.append(str(key))
            node = node.get(key) if isinstance(node, dict) else None
    return ".".join(parts) or "args"


def load_config(args: dict[str, Any] | None, check_workers: bool = True) -> ServiceConfig:
    """Validate the serve config's ``args``; :class:`ConfigError` names every problem.

    ``check_workers`` imports each worker class to check that it is a Worker (or any
    class for a plain actor) and that read-only methods, init calls and models name
    methods it has.
    """
    document = dict(args or {})
    try:
        config = ServiceConfig.model_validate(document)
    except ValidationError as exc:
        problems = [f"{_where(err['loc'], document)}: {err['msg']}" for err in exc.errors()]
        raise ConfigError("invalid serve config:\n  " + "\n  ".join(problems)) from None
    token = os.environ.get("SC_AUTH_TOKEN")
    if token:
        config.auth_token = token
    problems = _references(config)
    if check_workers and not problems:
        problems = _workers(config)
    if problems:
        raise ConfigError("invalid serve config:\n  " + "\n  ".join(problems))
    return config


def _group_path(deployment: DeploymentConfig, group: GroupConfig) -> str:
    return f"deployments[{deployment.name}].groups[{group.name}]"


def _duplicates(names: list[str]) -> list[str]:
    seen: set[str] = set()
    return sorted({n for n in names if n in seen or seen.add(n)})


def _references(config: ServiceConfig) -> list[str]:
    problems: list[str] = []
    deployment_names = [d.name for d in config.deployments]
    for name in _duplicates(deployment_names):
        problems.append(f"deployments[{name}].name: duplicate deployment name {name!r}")
    for name in sorted(RESERVED_DEPLOYMENTS & set(deployment_names)):
        problems.append(f"deployments[{name}].name: {name!r} is the application's own deployment; pick another")
    # Group and model names are routes (/v1/groups/{g}, /v2/models/{m}): unique service-wide.
    for name in _duplicates([g.name for _, g in config.groups()]):
        problems.append(f"groups[{name}].name: duplicate group name {name!r} (group names are unique service-wide)")
    for name in _duplicates([m.name for _, m in config.models()]):
        problems.append(f"models[{name}].name: duplicate model name {name!r}")
    for deployment in config.deployments:
        groups = {g.name: g for g in deployment.groups}
        for group in deployment.groups:
            path = _group_path(deployment, group)
            problems += _pool_references(path, group, groups)
            for other in group.colocate_with:
                if other == group.name:
                    problems.append(f"{path}.colocate_with: a group cannot colocate with itself")
                elif other not in groups:
                    problems.append(f"{path}.colocate_with: unknown group {other!r} in deployment {deployment.name!r}")
        if not problems:
            problems += _colocation_pools(deployment)
        for model in deployment.models:
            if model.group not in groups:
                problems.append(
                    f"deployments[{deployment.name}].models[{model.name}].group: unknown group {model.group!r}; "
                    f"groups of this deployment: {', '.join(groups)}"
                )
    return problems


def _pool_references(path: str, group: GroupConfig, groups: dict[str, GroupConfig]) -> list[str]:
    if group.pool is None:
        return []
    problems = []
    refs = [("same_as", group.pool.same_as)] if group.pool.same_as else []
    refs += [("merge", name) for name in group.pool.merge or []]
    for field_name, ref in refs:
        target = groups.get(ref)
        if target is None:
            problems.append(f"{path}.pool.{field_name}: unknown group {ref!r} in this deployment")
        elif ref == group.name:
            problems.append(f"{path}.pool.{field_name}: a group cannot refer to its own pool")
        elif target.pool is None:
            problems.append(f"{path}.pool.{field_name}: group {ref!r} is a plain actor and has no pool")
    if not problems:
        try:
            pool_root(group.name, groups)
        except ValueError as exc:
            problems.append(f"{path}.pool: {exc}")
    return problems


def pool_root(name: str, groups: dict[str, GroupConfig]) -> tuple[str, ...]:
    """The pools a group's pool is made of: ``(own,)`` for a pool of its own or one
    shared through ``same_as``, the merged pools' roots in order for a merge. ValueError
    for a cycle of references."""
    seen: list[str] = []

    def walk(current: str) -> tuple[str, ...]:
        if current in seen:
            raise ValueError(f"pool references form a cycle: {' -> '.join([*seen, current])}")
        seen.append(current)
        pool = groups[current].pool
        if pool.same_as is not None:
            result = walk(pool.same_as)
        elif pool.merge is not None:
            result = tuple(root for part in pool.merge for root in walk(part))
        else:
            result = (current,)
        seen.pop()
        return result

    return walk(name)


def colocations(deployment: DeploymentConfig) -> list[list[str]]:
    """Sets of groups that share processes (``colocate_with`` both ways, transitively),
    each in declaration order; groups not colocated are left out."""
    links: dict[str, set[str]] = {g.name: set() for g in deployment.groups}
    for group in deployment.groups:
        for other in group.colocate_with:
            links[group.name].add(other)
            links[other].add(group.name)
    order = [g.name for g in deployment.groups]
    found, done = [], set()
    for name in order:
        if name in done or not links[name]:
            continue
        component, stack = set(), [name]
        while stack:
            current = stack.pop()
            if current not in component:
                component.add(current)
                stack.extend(links[current])
        done |= component
        found.append([n for n in order if n in component])
    return found


def _colocation_pools(deployment: DeploymentConfig) -> list[str]:
    groups = {g.name: g for g in deployment.groups}
    problems = []
    for members in colocations(deployment):
        roots = {name: pool_root(name, groups) for name in members}
        if len(set(roots.values())) > 1:
            described = ", ".join(f"{name} on {'+'.join(root)}" for name, root in roots.items())
            problems.append(
                f"deployments[{deployment.name}].groups[{members[0]}].colocate_with: colocated groups must share "
                f"one pool (same_as, or the same merge), got {described}"
            )
    return problems


def _workers(config: ServiceConfig) -> list[str]:
    from single_controller.base.worker import Worker
    from single_controller.base.worker_methods import user_class
    from single_controller.megatron.worker import MegatronWorker

    problems = []
    for deployment in config.deployments:
        classes: dict[str, type] = {}
        for group in deployment.groups:
            path = _group_path(deployment, group)
            try:
                target = import_worker(group.worker)
            except Exception as exc:  # any error importing user code is a config problem
                problems.append(f"{path}.worker: cannot import {group.worker!r}: {type(exc).__name__}: {exc}")
                continue
            plain = user_class(target)
            if not isinstance(plain, type):
                problems.append(f"{path}.worker: {group.worker!r} is a {type(target).__name__}, not a class")
                continue
            if not group.plain_actor and not issubclass(plain, Worker):
                problems.append(
                    f"{path}.worker: {plain.__name__} is not a Worker subclass "
                    "(subclass single_controller.base.Worker, or declare plain_actor: true)"
                )
                continue
            if group.megatron is not None and not issubclass(plain, MegatronWorker):
                problems.append(f"{path}.worker: a megatron group needs a MegatronWorker subclass, got {plain.__name__}")
                continue
            classes[group.name] = plain
            for name in group.read_only:
                if not callable(getattr(plain, name, None)):
                    problems.append(f"{path}.read_only: {plain.__name__} has no method {name!r}")
            for call in group.init_calls:
                if not callable(getattr(plain, call.method, None)):
                    problems.append(f"{path}.init_calls: {plain.__name__} has no method {call.method!r}")
        for model in deployment.models:
            plain = classes.get(model.group)
            where = f"deployments[{deployment.name}].models[{model.name}]"
            if plain is None:
                continue
            for field_name in ("method", "io_method"):
                name = getattr(model, field_name)
                if name is not None and not callable(getattr(plain, name, None)):
                    problems.append(f"{where}.{field_name}: {plain.__name__} has no method {name!r}")
    return problems

"""RayWorkerGroup: a worker group whose ranks are Ray actors in a resource pool."""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from single_controller.base.worker_group import (
    ClassWithInitArgs,
    SubmitError,
    WorkerGroup,
    unpad_output,
    user_class,
)
from single_controller.batch import is_batch
from single_controller.ray.resource_pool import RayResourcePool
from single_controller.rendezvous import pick_rendezvous

#: Objects at least this large that a call sends to several ranks go to the object
#: store once and travel by reference, instead of being serialised once per rank.
SHARE_BYTES_THRESHOLD = 64 * 1024


class RayClassWithInitArgs(ClassWithInitArgs):
    """A worker class (plain or ``@ray.remote``) and its constructor arguments."""

    def __init__(self, cls: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(cls, *args, **kwargs)
        self._options: dict[str, Any] = {}
        self._additional_resource: dict[str, float] = {}

    def update_options(self, options: dict[str, Any]) -> None:
        """Extra ``.options()`` for every actor (runtime_env, max_concurrency, ...)."""
        self._options.update(options)

    def set_additional_resource(self, additional_resource: dict[str, float]) -> None:
        self._additional_resource = dict(additional_resource)

    def __call__(
        self,
        placement_group: Any,
        placement_group_bundle_idx: int,
        use_gpu: bool = True,
        num_gpus: float = 1,
        num_cpus: float | None = None,
        env_vars: dict[str, str] | None = None,
        name: str | None = None,
        detached: bool = False,
    ) -> Any:
        options: dict[str, Any] = {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=placement_group,
                placement_group_bundle_index=placement_group_bundle_idx,
            ),
        }
        options.update(self._options)
        runtime_env = dict(options.get("runtime_env") or {})
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **(env_vars or {})}
        options["runtime_env"] = runtime_env
        options["num_gpus"] = num_gpus if use_gpu else 0
        if num_cpus is not None:
            options["num_cpus"] = num_cpus
        if self._additional_resource:
            options["resources"] = dict(self._additional_resource)
        if name:
            options["name"] = name
        if detached:
            options["lifetime"] = "detached"
        actor_cls = self.cls if hasattr(self.cls, "options") else ray.remote(self.cls)
        return actor_cls.options(**options).remote(*self.args, **self.kwargs)


#: Picks the rendezvous on rank 0's node when that is another node. The function is
#: pickled by reference, so its process imports single_controller.rendezvous only.
_rendezvous_task = ray.remote(num_cpus=0)(pick_rendezvous)


def _rendezvous_for(pg: Any, bundle: int, timeout_s: float) -> tuple[str, int]:
    """``(MASTER_ADDR, MASTER_PORT)`` on the node of ``pg``'s ``bundle``: picked here when
    that node is this process's (no task, no process to start), else by a task there."""
    if ray.is_initialized():
        nodes = ray.util.placement_group_table(pg).get("bundles_to_node_id", {})
        if nodes.get(bundle) == ray.get_runtime_context().get_node_id():
            return pick_rendezvous()
    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)
    return ray.get(_rendezvous_task.options(scheduling_strategy=strategy).remote(), timeout=timeout_s)


@ray.remote(num_cpus=0)
def _collect_task(collect_fn: Callable, layout: GroupLayout, padding: int, *outputs: Any) -> Any:
    return unpad_output(collect_fn(layout, list(outputs)), padding)


class RankCoords(NamedTuple):
    """A rank's position in a 3D layout, as dispatch functions read it."""

    tp_rank: int
    dp_rank: int
    pp_rank: int
    cp_rank: int = 0

    @classmethod
    def of(cls, info: Any) -> RankCoords:
        return cls(info.tp_rank, info.dp_rank, info.pp_rank, getattr(info, "cp_rank", 0))


@dataclass
class GroupLayout:
    """A picklable snapshot of what dispatch and collect functions read from a group
    (rank coordinates are plain tuples, so any process can unpickle it)."""

    world_size: int
    rank_infos: list[RankCoords] = field(default_factory=list)
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    micro_dp_group_size: int = 1

    def get_megatron_rank_info(self, rank: int) -> Any:
        return self.rank_infos[rank]


def _random_prefix() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=6))


def _is_bulky(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size() >= SHARE_BYTES_THRESHOLD
    if isinstance(value, np.ndarray):
        return value.nbytes >= SHARE_BYTES_THRESHOLD
    if isinstance(value, (bytes, bytearray)):
        return len(value) >= SHARE_BYTES_THRESHOLD
    return is_batch(value)


class RayWorkerGroup(WorkerGroup):
    """``RayWorkerGroup(resource_pool, RayClassWithInitArgs(cls=MyWorker))``.

    Starts one actor per rank of the pool (all at once), binds the worker class's
    ``@register`` methods on the group, and keeps every rank's calls in one order.
    """

    def __init__(
        self,
        resource_pool: RayResourcePool | None = None,
        ray_cls_with_init: RayClassWithInitArgs | None = None,
        bin_pack: bool = True,
        name_prefix: str | None = None,
        detached: bool = False,
        worker_names: list[str] | None = None,
        startup_timeout_s: float = 300.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(resource_pool=resource_pool, **kwargs)
        if ray_cls_with_init is None:
            raise ValueError("RayWorkerGroup needs ray_cls_with_init (a RayClassWithInitArgs)")
        self.ray_cls_with_init = ray_cls_with_init
        self.resource_pool = resource_pool
        self.name_prefix = name_prefix if name_prefix is not None else _random_prefix()
        #: Seconds a blocking call waits for its outputs (None: no limit).
        self.get_timeout_s: float | None = None
        #: Objects put in the object store once to be shared by several ranks.
        self.object_store_puts = 0
        self._rank_info_cache: list[dict[str, Any]] | None = None
        #: Set on a role's group spawned from colocated workers: its methods' prefix.
        self._method_prefix = ""
        #: What every role's group on these processes shares: the compiled graph, and
        #: each rank's latest plain call while one exists (compiled calls wait for it).
        self._shared: dict[str, Any] = {"compiled": None, "pending": {}}
        if worker_names is not None:
            self._attach_detached_workers(worker_names)
        elif resource_pool is None:
            raise ValueError("RayWorkerGroup needs a resource_pool (or worker_names of running workers)")
        else:
            self._start_workers(resource_pool, ray_cls_with_init, bin_pack, detached, startup_timeout_s)
        self._bind_worker_method(ray_cls_with_init.cls)

    # -- start-up -------------------------------------------------------------------
    def _start_workers(
        self,
        pool: RayResourcePool,
        cls_with_init: RayClassWithInitArgs,
        bin_pack: bool,
        detached: bool,
        startup_timeout_s: float,
    ) -> None:
        pgs = pool.get_placement_groups(strategy="STRICT_PACK" if bin_pack else "PACK")
        world_size = pool.world_size
        # Rank 0's node picks the rendezvous before any worker exists, so all ranks
        # can start at once and a worker may init torch.distributed in __init__.
        master_addr, master_port = _rendezvous_for(pgs[0], pool.bundle_offsets[0], startup_timeout_s)
        cls_name = user_class(cls_with_init.cls).__name__
        rank = 0
        offsets = pool.bundle_offsets
        for pg_index, (pg, local_world_size) in enumerate(zip(pgs, pool.store, strict=True)):
            for local_rank in range(local_world_size):
                env = {
                    "WORLD_SIZE": str(world_size),
                    "RANK": str(rank),
                    "LOCAL_RANK": str(local_rank),
                    "LOCAL_WORLD_SIZE": str(local_world_size),
                    "MASTER_ADDR": master_addr,
                    "MASTER_PORT": str(master_port),
                    "WG_PREFIX": self.name_prefix,
                    "WG_BACKEND": "ray",
                }
                name = f"{self.name_prefix}{cls_name}_{pg_index}:{local_rank}"
                actor = cls_with_init(
                    placement_group=pg,
                    placement_group_bundle_idx=offsets[pg_index] + local_rank,
                    use_gpu=pool.use_gpu,
                    num_gpus=pool.actor_num_gpus(),
                    num_cpus=pool.actor_num_cpus(),
                    env_vars=env,
                    name=name,
                    detached=detached,
                )
                self._workers.append(actor)
                self._worker_names.append(name)
                rank += 1
        try:
            ray.get([w.__ray_ready__.remote() for w in self._workers], timeout=startup_timeout_s)
        except Exception:
            self.shutdown()
            raise

    def _attach_detached_workers(self, worker_names: list[str]) -> None:
        self._workers = [ray.get_actor(name) for name in worker_names]
        self._worker_names = list(worker_names)

    # -- colocated roles -------------------------------------------------------------
    def spawn(self, prefix_set: Any) -> dict[str, RayWorkerGroup]:
        """One group per role of a group started from ``create_colocated_worker_cls``.

        Each role's group has that role's methods under their own names and sends them
        to the shared processes, in one order with every other role's calls."""
        roles = getattr(self.ray_cls_with_init, "roles", None)
        if roles is None:
            raise ValueError("spawn needs a group started from create_colocated_worker_cls(...)")
        wanted = list(prefix_set)
        unknown = [role for role in wanted if role not in roles]
        if unknown:
            raise ValueError(f"unknown roles {unknown}; this group holds {sorted(roles)}")
        prefix = self.ray_cls_with_init.method_prefix
        return {role: self._role_group(prefix(role), roles[role]) for role in wanted}

    def _role_group(self, method_prefix: str, cls_with_init: RayClassWithInitArgs) -> RayWorkerGroup:
        view = RayWorkerGroup.__new__(RayWorkerGroup)
        WorkerGroup.__init__(view, resource_pool=self.resource_pool)
        view._workers = self._workers
        view._worker_names = self._worker_names
        view._submit_lock = self._submit_lock  # one order per process, across roles
        view.ray_cls_with_init = cls_with_init
        view.resource_pool = self.resource_pool
        view.name_prefix = self.name_prefix
        view.get_timeout_s = self.get_timeout_s
        view.object_store_puts = 0
        view._rank_info_cache = None
        view._method_prefix = method_prefix
        view._shared = self._shared
        view._bind_worker_method(cls_with_init.cls)
        return view

    # -- transport ------------------------------------------------------------------
    def _submit(self, rank: int, method: str, args: tuple, kwargs: dict) -> Any:
        worker = self._workers[rank]
        try:
            remote_method = getattr(worker, self._method_prefix + method)
        except AttributeError:
            cls_name = user_class(self.ray_cls_with_init.cls).__name__
            raise AttributeError(f"worker class {cls_name} has no method {method!r}") from None
        future = remote_method.remote(*args, **kwargs)
        if self._shared["compiled"] is not None:
            self._shared["pending"][rank] = future
        return future

    def _submit_many(self, method: str, calls: list[tuple[tuple, dict]]) -> list[Any]:
        try:
            shared = self._share_bulky(calls)
        except Exception as exc:  # the object store refused a put: no rank has the call
            raise SubmitError(method, 0, len(calls), exc) from exc
        return super()._submit_many(method, shared)

    def _share_bulky(self, calls: list[tuple[tuple, dict]]) -> list[tuple[tuple, dict]]:
        """Put each large object that goes to several ranks in the object store once."""
        seen: dict[int, int] = {}
        for args, kwargs in calls:
            for value in (*args, *kwargs.values()):
                seen[id(value)] = seen.get(id(value), 0) + 1
        refs: dict[int, Any] = {}

        def shared(value: Any) -> Any:
            key = id(value)
            if seen.get(key, 0) < 2 or not _is_bulky(value):
                return value
            if key not in refs:
                refs[key] = ray.put(value)
                self.object_store_puts += 1
            return refs[key]

        return [
            (tuple(shared(v) for v in args), {k: shared(v) for k, v in kwargs.items()})
            for args, kwargs in calls
        ]

    def _wait(self, futures: Any) -> Any:
        return ray.get(futures, timeout=self.get_timeout_s)

    def _collect_later(self, collect_fn: Callable, futures: Any, padding: int) -> Any:
        outputs = futures if isinstance(futures, list) else [futures]
        return _collect_task.remote(collect_fn, self.layout(), padding, *outputs)

    # -- introspection and health -----------------------------------------------------
    def layout(self) -> GroupLayout:
        """What dispatch functions read from this group, as a picklable snapshot."""
        return GroupLayout(
            world_size=self.world_size, micro_dp_group_size=getattr(self, "micro_dp_group_size", 1)
        )

    def rank_info(self, refresh: bool = False) -> list[dict[str, Any]]:
        """Per rank: rank, local rank, node, pid, CUDA_VISIBLE_DEVICES, device, actor name and id."""
        if self._rank_info_cache is None or refresh:
            infos = ray.get([w._get_rank_info.remote() for w in self._workers], timeout=self.get_timeout_s)
            for info, worker, name in zip(infos, self._workers, self._worker_names, strict=True):
                info["actor_name"] = name
                info["actor_id"] = worker._actor_id.hex()
            self._rank_info_cache = infos
        return self._rank_info_cache

    def check_health(self, timeout_s: float = 10.0) -> None:
        """Ping every rank; raise (GetTimeoutError, RayActorError) unless all answer in time."""
        ray.get([w._ping.remote() for w in self._workers], timeout=timeout_s)

    # -- compiled graph ---------------------------------------------------------------
    def compile(self) -> Any:
        """This group's methods run through a Ray Compiled Graph (see
        :class:`single_controller.ray.compiled.CompiledWorkerGroup`), one graph per set
        of processes, built on the first call."""
        from single_controller.ray.compiled import CompiledWorkerGroup

        return CompiledWorkerGroup(self)

    def _teardown_compiled(self) -> None:
        """Release the processes' compiled graph, if any (the workers stay)."""
        compiled, self._shared["compiled"] = self._shared["compiled"], None
        self._shared["pending"] = {}
        if compiled is not None:
            compiled.teardown()

    def shutdown(self) -> None:
        """Kill this group's actors (the pool's placement groups stay for other groups)."""
        try:
            self._teardown_compiled()
        except Exception:  # the graph's actors may be gone already
            pass
        for worker in self._workers:
            try:
                ray.kill(worker)
            except Exception:  # already dead
                pass

"""RayWorkerGroup: a worker group whose ranks are Ray actors in a resource pool.

Besides starting workers in a pool it attaches to running ones (``from_detached``), gives
one group per role of colocated and fused workers (``spawn``, ``spawn_fused``, ``fuse``;
the role logic is in :mod:`single_controller.ray.colocated` and
:mod:`single_controller.ray.fused`), and can abort the driver when a worker dies
(``start_worker_aliveness_check``, :mod:`single_controller.ray.aliveness`).
"""

from __future__ import annotations

import copy
import random
import string
import sys
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from single_controller.base.dispatch import DispatchError
from single_controller.base.mesh import MeshLayout
from single_controller.base.worker_group import (
    ClassWithInitArgs,
    Collector,
    WorkerGroup,
    user_class,
)
from single_controller.batch import is_batch
from single_controller.protocol_future import DataProtoFuture
from single_controller.ray.class_with_init import RayClassWithInitArgs
from single_controller.ray.rank_env import check_worker_env
from single_controller.ray.rank_replacement import RankPlace
from single_controller.ray.resource_pool import RayResourcePool
from single_controller.rendezvous import pick_rendezvous

#: Objects at least this large that a call sends to several ranks go to the object
#: store once and travel by reference, instead of being serialised once per rank.
SHARE_BYTES_THRESHOLD = 64 * 1024


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
def _collect_task(collector: Collector, *outputs: Any) -> Any:
    return collector(list(outputs))


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
    #: The named meshes the group knew when the snapshot was taken.
    meshes: dict[str, MeshLayout] = field(default_factory=dict)

    def get_megatron_rank_info(self, rank: int) -> Any:
        return self.rank_infos[rank]

    def mesh_layout(self, mesh_name: str) -> MeshLayout:
        try:
            return self.meshes[mesh_name]
        except KeyError:
            known = sorted(self.meshes)
            raise DispatchError(f"mesh {mesh_name!r} is not known to this group layout; known: {known}") from None


def _random_prefix() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=6))


def _is_bulky(value: Any) -> bool:
    # No torch import here: this module also loads in every colocated worker process,
    # and a tensor can only exist where torch is already imported.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
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
    ``worker_env`` adds variables to every rank's environment; one the group sets itself
    (``WORLD_SIZE``, ``RANK``, ...: ``rank_env.GROUP_ENV_NAMES``) is a ``ValueError``,
    raised before anything starts.
    """

    def __init__(
        self,
        resource_pool: RayResourcePool | None = None,
        ray_cls_with_init: RayClassWithInitArgs | None = None,
        bin_pack: bool = True,
        name_prefix: str | None = None,
        detached: bool = False,
        worker_names: list[str] | None = None,
        worker_handles: list[Any] | None = None,
        startup_timeout_s: float = 300.0,
        worker_env: dict[str, str] | None = None,
        device_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        attach = worker_names is not None or worker_handles is not None
        #: Variables set on every rank besides the group's own (verl's ``worker_env``).
        self.worker_env = check_worker_env(worker_env)
        if attach and self.worker_env:
            raise ValueError("worker_env applies to workers a group starts; attached workers keep their environment")
        if device_name not in (None, "cuda", "cpu"):
            raise ValueError(f"device_name is 'cuda', 'cpu' or None, got {device_name!r}")
        #: verl's device argument, kept for its callers: ranks take GPUs when the pool has
        #: them, and each rank picks its device itself (single_controller.device).
        self.device_name = device_name
        super().__init__(resource_pool=resource_pool, **kwargs)
        if ray_cls_with_init is None and not attach:
            raise ValueError("RayWorkerGroup needs ray_cls_with_init (a RayClassWithInitArgs)")
        self.ray_cls_with_init = ray_cls_with_init
        self.resource_pool = resource_pool
        self.name_prefix = name_prefix if name_prefix is not None else _random_prefix()
        self.startup_timeout_s = float(startup_timeout_s)
        #: Seconds a blocking call waits for its outputs (None: no limit).
        self.get_timeout_s: float | None = None
        #: Objects put in the object store once to be shared by several ranks.
        self.object_store_puts = 0
        self._rank_info_cache: list[dict[str, Any]] | None = None
        #: Where each rank's actor was started, to start it again (rank_replacement).
        self._places: list[RankPlace] = []
        #: Set on a role's group spawned from colocated or fused workers: its methods' prefix.
        self._method_prefix = ""
        #: What every role's group on these processes shares: the compiled graph, each
        #: rank's latest plain call while one exists (compiled calls wait for it), and the
        #: aliveness check.
        self._shared: dict[str, Any] = {"compiled": None, "pending": {}, "aliveness": None, "channel": None}
        #: verl's fused-worker state: whether the class is a fused worker, and the role
        #: groups ``fuse`` made (also reachable as ``group.<role>``).
        self.fused_worker_used = bool(getattr(ray_cls_with_init, "fused_worker_used", False))
        self.wg_dict: dict[str, RayWorkerGroup] | None = None
        #: On a fused role's group: the role it addresses (verl's name).
        self.sub_cls_name = ""
        if attach:
            self._attach_detached_workers(worker_names, worker_handles)
        elif resource_pool is None:
            raise ValueError("RayWorkerGroup needs a resource_pool (or worker_names of running workers)")
        else:
            self._start_workers(resource_pool, ray_cls_with_init, bin_pack, detached, startup_timeout_s)
        if ray_cls_with_init is not None:
            self._bind_worker_method(ray_cls_with_init.cls)

    @classmethod
    def from_detached(
        cls,
        name_prefix: str | None = None,
        worker_names: list[str] | None = None,
        worker_handles: list[Any] | None = None,
        ray_cls_with_init: RayClassWithInitArgs | None = None,
        **kwargs: Any,
    ) -> RayWorkerGroup:
        """A group over workers that are already running, found by their actor names
        (``group.worker_names`` of the group that started them, from any process of the
        cluster) or given as handles. With ``ray_cls_with_init`` its registered methods
        are bound as on the original group. The workers stay when this group is dropped."""
        return cls(
            resource_pool=None,
            ray_cls_with_init=ray_cls_with_init,
            name_prefix=name_prefix,
            worker_names=worker_names,
            worker_handles=worker_handles,
            **kwargs,
        )

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
                    "RAY_LOCAL_RANK": str(local_rank),
                    "RAY_LOCAL_WORLD_SIZE": str(local_world_size),
                    "MASTER_ADDR": master_addr,
                    "MASTER_PORT": str(master_port),
                    "WG_PREFIX": self.name_prefix,
                    "WG_BACKEND": "ray",
                    **self.worker_env,
                }
                name = f"{self.name_prefix}{cls_name}_{pg_index}:{local_rank}"
                place = RankPlace(pg, offsets[pg_index] + local_rank, env, name, pool.use_gpu,
                                  pool.actor_num_gpus(), pool.actor_num_cpus(), detached)
                self._places.append(place)
                actor = place.start(cls_with_init)
                self._workers.append(actor)
                self._worker_names.append(name)
                rank += 1
        try:
            ray.get([w.__ray_ready__.remote() for w in self._workers], timeout=startup_timeout_s)
        except Exception:
            self.shutdown()
            raise

    def _attach_detached_workers(self, worker_names: list[str] | None, worker_handles: list[Any] | None) -> None:
        if worker_handles is not None:
            # Handles keep the actors referenced; names alone (ray.get_actor) do not.
            if worker_names is not None and len(worker_names) != len(worker_handles):
                raise ValueError(
                    f"from_detached: {len(worker_names)} worker_names for {len(worker_handles)} worker_handles"
                )
            self._workers = list(worker_handles)
            self._worker_names = list(worker_names) if worker_names is not None else [""] * len(worker_handles)
            return
        self._workers = [ray.get_actor(name) for name in worker_names]
        self._worker_names = list(worker_names)

    # -- colocated and fused roles ---------------------------------------------------
    def spawn(self, prefix_set: Any) -> dict[str, RayWorkerGroup]:
        """One group per role of a group started from ``create_colocated_worker_cls`` (or,
        for a fused worker class, :meth:`spawn_fused`). Each role's group has that role's
        methods under their own names and sends them to the shared processes, in one
        order with every other role's calls."""
        if self.fused_worker_used:
            return self.spawn_fused(prefix_set)
        from single_controller.ray.colocated import spawn_colocated_roles

        return spawn_colocated_roles(self, prefix_set)

    def spawn_fused(self, prefix_set: Any) -> dict[str, RayWorkerGroup]:
        """One group per role of a fused worker class (``create_colocated_worker_cls_fused``)."""
        from single_controller.ray.fused import spawn_fused_roles

        return spawn_fused_roles(self, prefix_set)

    def fuse(self, prefix_set: Any) -> None:
        """verl's fused-worker access: afterwards ``group.<role>`` is the role's group
        (``group.actor.add(x)``), and the fused class's own methods stay on ``group``."""
        from single_controller.ray.fused import fuse_roles

        fuse_roles(self, prefix_set)

    def role_view(self, method_prefix: str, cls_with_init: ClassWithInitArgs) -> RayWorkerGroup:
        """A group of the same class on the same processes that calls ``cls_with_init``'s
        methods under ``method_prefix`` (a colocated or fused role). It shares this group's
        workers, call order, compiled graph and aliveness check; not its bound methods."""
        view = copy.copy(self)
        for name in [*self._method_specs, *(self.wg_dict or {})]:
            view.__dict__.pop(name, None)
        view._method_specs = {}
        view.ray_cls_with_init = cls_with_init
        view._method_prefix = method_prefix
        view.fused_worker_used = False
        view.wg_dict = None
        view._rank_info_cache = None
        view._dispatch_info, view._collect_info = {}, {}  # the role's own mesh places
        view.object_store_puts = 0
        view._bind_worker_method(cls_with_init.cls)
        return view

    def replace_worker(self, rank: int, timeout_s: float | None = None) -> Any:
        """Start ``rank``'s actor again, alone, in its bundle and with its environment
        (killing the old one if it runs): see :mod:`single_controller.ray.rank_replacement`.
        Returns the new actor once it is up; its state is what its constructor makes."""
        from single_controller.ray.rank_replacement import replace_worker

        return replace_worker(self, rank, self.startup_timeout_s if timeout_s is None else timeout_s)

    # -- aliveness --------------------------------------------------------------------
    def start_worker_aliveness_check(self, every_n_seconds: float = 1) -> None:
        """verl's fail-fast: wait until every worker is alive, then check every
        ``every_n_seconds`` (from Ray's actor states, so a busy worker is not taken for a
        dead one) and raise SIGABRT in this process when one is not. For drivers that
        cannot go on without a worker; :meth:`shutdown` stops it first."""
        from single_controller.ray.aliveness import AlivenessCheck, wait_until_alive

        self.stop_worker_aliveness_check()
        wait_until_alive(self._workers, timeout_s=self.startup_timeout_s)
        self._shared["aliveness"] = AlivenessCheck(self._workers, every_n_seconds).start()

    def stop_worker_aliveness_check(self) -> None:
        """Stop the aliveness check of these processes, if one runs."""
        check, self._shared["aliveness"] = self._shared.get("aliveness"), None
        if check is not None:
            check.stop()

    def _is_worker_alive(self, worker: Any) -> bool:
        from single_controller.ray.aliveness import is_actor_alive

        return is_actor_alive(worker)

    # -- transport ------------------------------------------------------------------
    def _submit(self, rank: int, method: str, args: tuple, kwargs: dict) -> Any:
        worker = self._workers[rank]
        try:
            remote_method = getattr(worker, self._method_prefix + method)
        except AttributeError:
            cls = self.ray_cls_with_init.cls if self.ray_cls_with_init is not None else type(worker)
            cls_name = user_class(cls).__name__
            raise AttributeError(f"worker class {cls_name} has no method {method!r}") from None
        future = remote_method.remote(*args, **kwargs)
        if self._shared["compiled"] is not None:
            self._shared["pending"][rank] = future
        return future

    def _submit_many(self, method: str, calls: list[tuple[tuple, dict]]) -> list[Any]:
        return super()._submit_many(method, self._share_bulky(calls))

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

    def _collect_later(self, collector: Collector, futures: list[Any], given_batch: bool) -> Any:
        """A DataProtoFuture (collected where ``get()`` runs) for a call given a batch (a
        DataProto or a TensorDict); else an ObjectRef of a Ray task that collects where
        the values are."""
        if given_batch:
            return DataProtoFuture(collect_fn=collector, futures=futures)
        return _collect_task.remote(collector, *futures)

    # -- introspection and health -----------------------------------------------------
    def layout(self) -> GroupLayout:
        """What dispatch and collect functions read from this group, as a picklable
        snapshot: world size, micro-dp size, the named meshes it has asked its ranks
        about, and for a group that reports a Megatron layout (``get_megatron_rank_info``)
        every rank's tp/dp/pp/cp coordinates and sizes."""
        layout = GroupLayout(
            world_size=self.world_size,
            micro_dp_group_size=getattr(self, "micro_dp_group_size", 1),
            meshes=self.meshes(cached=True),
        )
        rank_info = getattr(self, "get_megatron_rank_info", None)
        if rank_info is not None:
            layout.rank_infos = [RankCoords.of(rank_info(rank)) for rank in range(self.world_size)]
            for size in ("tp_size", "dp_size", "pp_size", "cp_size"):
                setattr(layout, size, int(getattr(self, size, 1) or 1))
        return layout

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
    def graph_channel(self, max_inflight: int = 16, read_timeout_s: float | None = None) -> Any:
        """This group's calls over one compiled graph, for a caller on an asyncio loop
        (:class:`single_controller.ray.graph_channel.GraphChannel`), compiled now
        (blocking). The group's shutdown tears it down."""
        from single_controller.ray.graph_channel import GraphChannel

        channel = GraphChannel(self, max_inflight, read_timeout_s).compile()
        self._shared["channel"] = channel
        return channel

    def socket_channel(self, connect_timeout_s: float = 60.0) -> Any:
        """This group's calls over one connection per rank, for a caller on an asyncio
        loop (:class:`single_controller.ray.socket_channel.SocketChannel`), connected now
        (blocking). The group's shutdown closes it."""
        from single_controller.ray.socket_channel import SocketChannel

        channel = SocketChannel(self, connect_timeout_s).open()
        self._shared["channel"] = channel
        return channel

    def compile(self) -> Any:
        """This group's methods run through a Ray Compiled Graph (see
        :class:`single_controller.ray.compiled.CompiledWorkerGroup`), one graph per set
        of processes, built on the first call."""
        from single_controller.ray.compiled import CompiledWorkerGroup

        return CompiledWorkerGroup(self)

    def _teardown_compiled(self) -> None:
        """Release the processes' compiled graphs, if any (the workers stay)."""
        compiled, self._shared["compiled"] = self._shared["compiled"], None
        channel, self._shared["channel"] = self._shared.get("channel"), None
        self._shared["pending"] = {}
        if compiled is not None:
            compiled.teardown()
        if channel is not None:
            channel.teardown()

    def shutdown(self) -> None:
        """Kill this group's actors (the pool's placement groups stay for other groups),
        after stopping the aliveness check, which would otherwise take that for a death.
        Once this process has left Ray (``ray.shutdown()``, as a start still running when
        its driver ends finds) it does nothing: a Ray call would start a new local cluster."""
        self.stop_worker_aliveness_check()
        if not ray.is_initialized():
            return
        try:
            self._teardown_compiled()
        except Exception:  # the graph's actors may be gone already
            pass
        for worker in self._workers:
            try:
                ray.kill(worker)
            except Exception:  # already dead
                pass

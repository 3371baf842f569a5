"""The base class of every worker process in a group.

A worker learns its place in the group from environment variables the group sets
when it starts the process (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, and verl's
``RAY_LOCAL_RANK``/``RAY_LOCAL_WORLD_SIZE``), so ``torch.distributed``'s ``env://``
rendezvous works as it does under torchrun.

Every worker also answers verl's two driver-function methods: a group sends a function
to its ranks with ``execute_with_func_generator`` (the function runs on each rank with
that rank's part of a batch) or ``execute_func_rank_zero`` (it runs on rank 0).

A worker declares its place in named meshes (verl v0.5's
``_register_dispatch_collect_info``): its dp rank there and whether it answers for that
dp rank. Methods registered with ``make_nd_compute_dataproto_dispatch_fn(mesh)`` are
dispatched by it; the group reads the places through the registered ``_query_*``
methods, which the group calls and a service never lists (their names start with ``_``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from single_controller.base.decorator import Dispatch, Execute, register
from single_controller.base.mesh import MeshPlaces
from single_controller.base.step_socket import serve_steps
from single_controller.rendezvous import node_ip_address, pick_rendezvous


class Worker:
    """A rank of a worker group. Subclass it and decorate the subclass with ``@ray.remote``.

    The rank attributes are set in ``__new__`` so they are there even before a
    subclass's ``__init__`` runs (the tutorial's workers read ``self.rank`` in it).
    """

    #: Attribute under which a fused worker's roles see each other (verl's name).
    fused_worker_attr_name = "fused_worker_dict"

    def __new__(cls, *args: Any, **kwargs: Any):
        instance = super().__new__(cls)
        instance._configure_from_env()
        return instance

    def __init__(self, cuda_visible_devices: str | None = None) -> None:
        if cuda_visible_devices is not None:
            self._cuda_visible_devices = cuda_visible_devices

    def _configure_from_env(self) -> None:
        env = os.environ
        self._rank = int(env.get("RANK", "0"))
        self._world_size = int(env.get("WORLD_SIZE", "1"))
        self._local_rank = int(env.get("LOCAL_RANK", "0"))
        self._local_world_size = int(env.get("LOCAL_WORLD_SIZE", "1"))
        # verl's workers read the RAY_ spellings; give both wherever one is missing.
        for plain, ray_name in (("LOCAL_RANK", "RAY_LOCAL_RANK"), ("LOCAL_WORLD_SIZE", "RAY_LOCAL_WORLD_SIZE")):
            if plain in env:
                env.setdefault(ray_name, env[plain])
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            # A lone worker (or rank 0 started by hand) hosts its own rendezvous.
            addr, port = pick_rendezvous()
            env.setdefault("MASTER_ADDR", addr)
            env.setdefault("MASTER_PORT", str(port))
        self._master_addr = env["MASTER_ADDR"]
        self._master_port = env["MASTER_PORT"]
        self._cuda_visible_devices = env.get("CUDA_VISIBLE_DEVICES", "")

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def local_world_size(self) -> int:
        return self._local_world_size

    def get_master_addr_port(self) -> tuple[str, str]:
        """The group's torch.distributed rendezvous address and port."""
        return self._master_addr, self._master_port

    def get_cuda_visible_devices(self) -> str:
        """CUDA_VISIBLE_DEVICES as this process sees it ("" when no GPU is assigned)."""
        return os.environ.get("CUDA_VISIBLE_DEVICES", self._cuda_visible_devices)

    def get_fused_worker_by_name(self, worker_name: str) -> Any:
        """In a fused worker, the role instance ``worker_name`` (None when there is none)."""
        return getattr(self, self.fused_worker_attr_name, {}).get(worker_name)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def execute_with_func_generator(self, func: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run ``func(self, *args, **kwargs)`` here: through the group, each rank gets its
        part of every batch argument and the answers are concatenated back."""
        return func(self, *args, **kwargs)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def execute_func_rank_zero(self, func: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run ``func(*args, **kwargs)`` here: through the group, on rank 0 only."""
        return func(*args, **kwargs)

    # -- places in named meshes (verl v0.5) -------------------------------------------
    @property
    def _mesh_places(self) -> MeshPlaces:
        """This rank's mesh declarations (made on first use, whatever made the instance)."""
        places = self.__dict__.get("_mesh_place_record")
        if places is None:
            places = self.__dict__["_mesh_place_record"] = MeshPlaces()
        return places

    def _register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Declare this rank's place in ``mesh_name``: its dp rank, and whether its output
        is the one collected for that dp rank. Once per mesh; ``MeshError`` (a
        ValueError) for a second declaration or a bad value."""
        self._mesh_places.register(mesh_name, dp_rank, is_collect)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_dispatch_info(self, mesh_name: str) -> int:
        """This rank's dp rank in ``mesh_name`` (through the group: one per rank)."""
        return self._mesh_places.dp_rank(mesh_name)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_collect_info(self, mesh_name: str) -> bool:
        """Whether this rank collects in ``mesh_name`` (through the group: one per rank)."""
        return self._mesh_places.is_collect(mesh_name)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_meshes(self) -> dict[str, tuple[int, bool]]:
        """Every mesh this rank declared: ``name -> (dp rank, collects?)``."""
        return self._mesh_places.places()

    def query_collect_info(self, mesh_name: str) -> bool:
        """Whether this rank collects in ``mesh_name``; ``MeshError`` when it is not declared."""
        return self._mesh_places.is_collect(mesh_name)

    def get_dispatch_collect(self) -> dict[str, dict[str, Any]]:
        """``{"dispatch_dp_rank": {mesh: dp rank}, "collect_dp_rank": {mesh: collects?}}``."""
        return self._mesh_places.snapshot()

    def set_dispatch_collect(
        self, mesh_name: str, dispatch_dp_rank: dict[str, int], collect_dp_rank: dict[str, bool]
    ) -> None:
        """Take another worker's place (its ``get_dispatch_collect()``) as this one's in
        ``mesh_name``: a fused worker answering for a role it holds. The source's entry
        named ``mesh_name`` when it has one, else its only entry. ``MeshError`` (a
        ValueError and an AssertionError) when ``mesh_name`` is declared already."""
        self._mesh_places.adopt(mesh_name, dispatch_dp_rank, collect_dp_rank)

    def get_node_id(self) -> str | None:
        """The Ray node this worker runs on (None outside Ray)."""
        try:
            import ray

            return ray.get_runtime_context().get_node_id()
        except Exception:
            return None

    # Underscored methods are the group's plumbing, never exposed as user methods.
    def _get_rank_info(self) -> dict[str, Any]:
        from single_controller.device import get_device_name

        return {
            "rank": self._rank,
            "world_size": self._world_size,
            "local_rank": self._local_rank,
            "local_world_size": self._local_world_size,
            "node_id": self.get_node_id(),
            "node_ip": node_ip_address(),
            "pid": os.getpid(),
            "cuda_visible_devices": self.get_cuda_visible_devices(),
            "device": get_device_name(),
        }

    def _ping(self) -> int:
        return self._rank

    def _execute_compiled(self, call: tuple[str, tuple, dict] | None) -> Any:
        """A compiled graph's or a socket channel's step on this rank: ``(method, args,
        kwargs)``, or None for a rank the call does not run on (a RANK_ZERO method on the
        other ranks)."""
        if call is None:
            return None
        method, args, kwargs = call
        return getattr(self, method)(*args, **kwargs)

    def _open_step_socket(self, token: bytes) -> tuple[str, int]:
        """This rank's end of a socket channel (``single_controller.base.step_socket``):
        the address its owner connects to, sending ``token`` first."""
        host = node_ip_address()
        return host, serve_steps(host, token, self._execute_compiled, _same_cuda_device())


def _same_cuda_device() -> Callable[[], None] | None:
    """What makes another thread use the CUDA device this thread uses (a new thread starts
    on device 0); None where CUDA is not in use here."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    device = torch.cuda.current_device()
    return lambda: torch.cuda.set_device(device)

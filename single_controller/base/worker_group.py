"""Backend-neutral resource pools, class descriptions and worker groups.

:class:`WorkerGroup` owns the call flow of a registered method (dispatch, execute,
collect) and leaves the transport to a subclass: ``RayWorkerGroup`` submits to Ray
actors. Keeping the flow here is what lets dispatch be tested without Ray.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from single_controller.base.decorator import PADDING_KEY, DispatchError, MethodSpec
from single_controller.base.mesh import MeshError, MeshLayout
from single_controller.base.modes import Execute
from single_controller.base.worker_methods import registered_methods, user_class
from single_controller.batch import is_batch, unpad_batch
from single_controller.protocol_future import DataProtoFuture, materialize_futures

__all__ = [
    "ClassWithInitArgs",
    "Collector",
    "PendingCall",
    "ResourcePool",
    "SubmitError",
    "WorkerGroup",
    "dispatch_arguments",
    "registered_methods",
    "split_per_rank",
    "unpad_output",
    "user_class",
]


class ResourcePool:
    """Processes per node: ``ResourcePool([4, 4])`` is 4 processes on each of 2 nodes."""

    def __init__(
        self,
        process_on_nodes: Sequence[int] | None = None,
        max_colocate_count: int = 10,
        n_gpus_per_node: int = 8,
    ) -> None:
        store = list(process_on_nodes or [])
        for count in store:
            if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
                raise ValueError(f"process_on_nodes must be positive integers, got {store!r}")
        if not isinstance(max_colocate_count, int) or max_colocate_count <= 0:
            raise ValueError(f"max_colocate_count must be a positive integer, got {max_colocate_count!r}")
        self._store = store
        self.max_colocate_count = max_colocate_count
        self.n_gpus_per_node = n_gpus_per_node

    def add_node(self, process_count: int) -> None:
        if not isinstance(process_count, int) or process_count <= 0:
            raise ValueError(f"process_count must be a positive integer, got {process_count!r}")
        self._store.append(process_count)

    @property
    def world_size(self) -> int:
        return sum(self._store)

    def __call__(self) -> list[int]:
        return self._store

    @property
    def store(self) -> list[int]:
        return self._store

    def local_world_size_list(self) -> list[int]:
        """For each rank, the number of ranks on its node."""
        return [count for count in self._store for _ in range(count)]

    def local_rank_list(self) -> list[int]:
        """For each rank, its index among the ranks of its node."""
        return [local for count in self._store for local in range(count)]


class ClassWithInitArgs:
    """A class and the arguments to construct it with, constructed later, elsewhere."""

    def __init__(self, cls: type, *args: Any, **kwargs: Any) -> None:
        self.cls = cls
        self.args = args
        self.kwargs = kwargs
        #: Set (by ``create_colocated_worker_cls_fused``, or by hand on a subclass of
        #: ``create_colocated_worker_raw_cls``) when ``cls`` is a fused worker class.
        self.fused_worker_used = False

    def __call__(self) -> Any:
        return self.cls(*self.args, **self.kwargs)


class SubmitError(RuntimeError):
    """A call reached some of its ranks and then could not be handed to the next (its
    arguments would not serialise, the object store is full, a worker is gone).
    ``submitted`` ranks (the first ones, in rank order) got it: their state may now
    differ from the others'. When no rank got the call, the error is raised as it came."""

    def __init__(self, method: str, submitted: int, ranks: int, cause: BaseException) -> None:
        super().__init__(
            f"{method}: submitted to {submitted} of {ranks} ranks, then {type(cause).__name__}: {cause}"
        )
        self.method = method
        self.submitted = submitted
        self.ranks = ranks
        self.cause = cause


@dataclass(frozen=True)
class Collector:
    """What the values of a call's futures become: the mode's ``collect_fn`` over the
    group's layout, then the dispatch padding dropped. ``single`` marks a RANK_ZERO call
    (one value, not a list by rank). Picklable when ``layout`` is (a Ray task or a
    DataProtoFuture may run it in another process)."""

    collect_fn: Callable[[Any, Any], Any]
    layout: Any
    padding: int = 0
    single: bool = False

    def __call__(self, values: Sequence[Any]) -> Any:
        outputs = values[0] if self.single else list(values)
        return unpad_output(self.collect_fn(self.layout, outputs), self.padding)


@dataclass
class PendingCall:
    """A call submitted to the ranks and not yet waited for (:meth:`WorkerGroup.submit`).

    ``futures``: one per rank the call runs on, in rank order (one for a RANK_ZERO call).
    ``collect(values)``: the caller's result from those futures' values, in the same
    order, after the method's collect function and padding removal. Whoever holds the
    futures waits for them the way it likes (``ray.get``, ``await``), with its own timeout.
    """

    futures: list[Any]
    collect: Callable[[list[Any]], Any]


def split_per_rank(method: str, world_size: int, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
    """verl's execute_all rule: a list of ``world_size`` items is split across the ranks
    (item ``r`` to rank ``r``); any other value goes whole to every rank.

    A call that splits some arguments and passes another list of a different length is
    ambiguous, almost always a wrong per-rank list: ``ValueError`` naming the method,
    the argument, the expected and the given length.
    """

    def is_split(value: Any) -> bool:
        return isinstance(value, list) and len(value) == world_size

    labelled = [(f"positional argument {i}", v) for i, v in enumerate(args)]
    labelled += [(f"argument {k!r}", v) for k, v in kwargs.items()]
    if any(is_split(v) for _, v in labelled):
        for label, value in labelled:
            if isinstance(value, list) and len(value) != world_size:
                raise DispatchError(
                    f"{method}: {label} is a per-rank list of the wrong length: "
                    f"expected {world_size} (one per rank), got {len(value)}"
                )
    calls = []
    for rank in range(world_size):
        rank_args = tuple(v[rank] if is_split(v) else v for v in args)
        rank_kwargs = {k: (v[rank] if is_split(v) else v) for k, v in kwargs.items()}
        calls.append((rank_args, rank_kwargs))
    return calls


class WorkerGroup:
    """A group of ranks running one worker class, addressed as one object.

    Subclasses provide the transport: :meth:`_submit` (start one call on one rank,
    return a future), :meth:`_wait` (futures to values) and :meth:`_collect_later`
    (collect outputs that are still futures).
    """

    #: Names a worker method may not take beyond the group's own attributes.
    _reserved: frozenset[str] = frozenset({"resource_pool", "name_prefix", "ray_cls_with_init"})

    def __init__(self, resource_pool: ResourcePool | None = None, **kwargs: Any) -> None:
        self._is_init_with_detached_workers = resource_pool is None
        self._procecss_dispatch_config = None  # verl's spelling, kept for compatibility
        self._workers: list[Any] = []
        self._worker_names: list[str] = []
        self._method_specs: dict[str, MethodSpec] = {}
        #: Each named mesh's dp rank and collect flag by rank, once asked of the ranks
        #: (verl's names: its code and tests read them).
        self._dispatch_info: dict[str, list[int]] = {}
        self._collect_info: dict[str, list[bool]] = {}
        # Submissions of one call to all ranks happen under this lock, so every rank
        # receives concurrent calls in the same order (collectives never interleave).
        self._submit_lock = threading.RLock()

    # -- the layout dispatch functions read ---------------------------------------
    @property
    def world_size(self) -> int:
        return len(self._workers)

    @property
    def workers(self) -> list[Any]:
        return self._workers

    @property
    def worker_names(self) -> list[str]:
        return self._worker_names

    @property
    def method_specs(self) -> dict[str, MethodSpec]:
        """The registered methods bound on this group, by name."""
        return dict(self._method_specs)

    # -- named meshes -------------------------------------------------------------
    def mesh_layout(self, mesh_name: str) -> MeshLayout:
        """Mesh ``mesh_name`` across the group (every rank's dp rank and collect flag),
        asked of the ranks on first use and kept. ``MeshError`` (a ValueError) when the
        ranks' answers do not form a usable mesh; an error from the ranks when one of
        them has not declared it."""
        if mesh_name not in self._dispatch_info or mesh_name not in self._collect_info:
            self._require_mesh_queries()
            dp_futures = self.execute_all_async("_query_dispatch_info", mesh_name)
            collect_futures = self.execute_all_async("_query_collect_info", mesh_name)
            dp_ranks, collect = self._wait(dp_futures), self._wait(collect_futures)
            MeshLayout.of(mesh_name, dp_ranks, collect)
            self._dispatch_info[mesh_name] = list(dp_ranks)
            self._collect_info[mesh_name] = list(collect)
        return MeshLayout.of(mesh_name, self._dispatch_info[mesh_name], self._collect_info[mesh_name])

    def meshes(self, cached: bool = False) -> dict[str, MeshLayout]:
        """Every mesh the ranks declared, by name (one call to every rank), each checked
        as :meth:`mesh_layout` checks it; a mesh some ranks did not declare is a
        ``MeshError``. ``cached=True`` answers without calling the ranks: the meshes
        asked of them before (by a dispatch or an earlier call). A group of workers that
        are not ``Worker``s has none."""
        if not cached and "_query_meshes" in self._method_specs:
            places = self._wait(self.execute_all_async("_query_meshes"))
            for name in dict.fromkeys(name for rank_places in places for name in rank_places):
                lacking = [rank for rank, rank_places in enumerate(places) if name not in rank_places]
                if lacking:
                    raise MeshError(f"mesh {name!r} is declared on some ranks but not on ranks {lacking}")
                dp_ranks = [rank_places[name][0] for rank_places in places]
                collect = [rank_places[name][1] for rank_places in places]
                MeshLayout.of(name, dp_ranks, collect)
                self._dispatch_info[name], self._collect_info[name] = dp_ranks, collect
        names = [name for name in self._dispatch_info if name in self._collect_info]
        return {name: MeshLayout.of(name, self._dispatch_info[name], self._collect_info[name]) for name in names}

    def _require_mesh_queries(self) -> None:
        if "_query_dispatch_info" not in self._method_specs:
            raise DispatchError(
                f"{type(self).__name__}: its workers do not declare meshes (they are not Worker subclasses)"
            )

    # -- transport hooks ----------------------------------------------------------
    def _submit(self, rank: int, method: str, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def _submit_many(self, method: str, calls: list[tuple[tuple, dict]]) -> list[Any]:
        futures: list[Any] = []
        with self._submit_lock:
            try:
                for rank, (a, k) in enumerate(calls):
                    futures.append(self._submit(rank, method, a, k))
            except Exception as exc:
                if not futures:  # no rank has the call: the error as it came
                    raise
                raise SubmitError(method, len(futures), len(calls), exc) from exc
        return futures

    def _wait(self, futures: Any) -> Any:
        raise NotImplementedError

    def _collect_later(self, collector: Collector, futures: list[Any], given_batch: bool) -> Any:
        """A future of ``collector(values of futures)``: a DataProtoFuture (``get()``
        collects) when the call was given a batch (a DataProto or a TensorDict), else the
        transport's own future."""
        raise NotImplementedError

    # -- calls --------------------------------------------------------------------
    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method_name`` on every rank; a list of world_size items is split across
        the ranks, anything else is sent whole. Returns one future per rank."""
        calls = split_per_rank(method_name, self.world_size, args, kwargs)
        return self._submit_many(method_name, calls)

    def execute_all_sync(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """:meth:`execute_all_async`, waited for: one value per rank."""
        return self._wait(self.execute_all_async(method_name, *args, **kwargs))

    execute_all = execute_all_async

    def execute_rank_zero_async(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method_name`` on rank 0 only, with the arguments as given."""
        with self._submit_lock:
            return self._submit(0, method_name, args, kwargs)

    def execute_rank_zero_sync(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        return self._wait(self.execute_rank_zero_async(method_name, *args, **kwargs))

    execute_rank_zero = execute_rank_zero_async

    def submit(
        self, method_name: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None, channel: Any = None
    ) -> PendingCall:
        """Dispatch and submit a call to ``method_name`` without waiting for it: its
        registered modes when it has them, else execute_all's. Arguments travel as given
        in ``args`` and ``kwargs`` (no keyword of this method can be reached from them,
        so a caller cannot switch blocking or any other control on). ``channel``: what
        takes the per-rank calls (its ``execute_all_async`` and ``execute_rank_zero_async``,
        e.g. a compiled graph's ``GraphChannel``); the group's own transport by default."""
        args, kwargs = tuple(args), dict(kwargs or {})
        channel = self if channel is None else channel
        spec = self._method_specs.get(method_name)
        if spec is None:
            return PendingCall(channel.execute_all_async(method_name, *args, **kwargs), list)
        d_args, d_kwargs, padding = dispatch_arguments(self, method_name, spec, args, kwargs)
        collect_fn = spec.dispatch_spec.collect_fn
        if spec.execute_mode == Execute.RANK_ZERO:
            future = channel.execute_rank_zero_async(method_name, *d_args, **d_kwargs)
            return PendingCall([future], Collector(collect_fn, self, padding, single=True))
        futures = channel.execute_all_async(method_name, *d_args, **d_kwargs)
        return PendingCall(futures, Collector(collect_fn, self, padding))

    def submit_rank(
        self, rank: int, method_name: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any | None:
        """Rank ``rank``'s share of the call :meth:`submit` makes: the method's registered
        dispatch (or execute_all's split) over the whole group, then only that rank's
        arguments submitted, on the group's own transport; its future, or None where the
        call does not run on that rank (a RANK_ZERO method, on a rank but 0). What brings
        one rank to where the others are (a replaced rank replays the calls they ran)."""
        args, kwargs = tuple(args), dict(kwargs or {})
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in this group of {self.world_size} ranks")
        spec = self._method_specs.get(method_name)
        if spec is not None:
            args, kwargs, _ = dispatch_arguments(self, method_name, spec, args, kwargs)
            if spec.execute_mode == Execute.RANK_ZERO:
                if rank != 0:
                    return None
                with self._submit_lock:
                    return self._submit(0, method_name, args, kwargs)
        rank_args, rank_kwargs = split_per_rank(method_name, self.world_size, args, kwargs)[rank]
        with self._submit_lock:
            return self._submit(rank, method_name, rank_args, rank_kwargs)

    def call_method(self, method_name: str, *args: Any, blocking: bool | None = None, **kwargs: Any) -> Any:
        """Call a worker method by name: with its registered modes when it has them,
        else like :meth:`execute_all_sync`."""
        spec = self._method_specs.get(method_name)
        if spec is None:
            futures = self.execute_all_async(method_name, *args, **kwargs)
            return futures if blocking is False else self._wait(futures)
        return self._call_registered(method_name, spec, args, kwargs, blocking)

    def _call_registered(
        self, name: str, spec: MethodSpec, args: tuple, kwargs: dict, blocking: bool | None = None
    ) -> Any:
        dispatch = spec.dispatch_spec
        blocking = spec.blocking if blocking is None else blocking
        given_batch = any(is_batch(v) or isinstance(v, DataProtoFuture) for v in (*args, *kwargs.values()))
        d_args, d_kwargs, padding = dispatch_arguments(self, name, spec, args, kwargs)
        rank_zero = spec.execute_mode == Execute.RANK_ZERO
        if rank_zero:
            futures = self.execute_rank_zero_async(name, *d_args, **d_kwargs)
        else:
            futures = self.execute_all_async(name, *d_args, **d_kwargs)
        if not blocking:
            if dispatch.collect_needs_values or padding:
                collector = Collector(dispatch.collect_fn, self.layout(), padding, single=rank_zero)
                return self._collect_later(collector, [futures] if rank_zero else list(futures), given_batch)
            return dispatch.collect_fn(self, futures)
        output = dispatch.collect_fn(self, self._wait(futures))
        return unpad_output(output, padding)

    def layout(self) -> Any:
        """What collect functions read from this group, as a snapshot that can travel to
        another process (the group itself here; transports override it)."""
        return self

    def _bind_worker_method(self, user_defined_cls: Any, func_generator: Callable | None = None) -> list[str]:
        """Give the group one method per ``@register``-ed worker method.

        The methods are looked up on access (``__getattr__``), not stored on the group,
        so a group holds no reference to itself: dropping the last reference to it
        releases its actor handles at once (and Ray ends the actors), as verl's tests
        expect after ``del group``. ``func_generator(name, spec)``, when given, builds
        methods that are stored instead."""
        bound = []
        for name, spec in registered_methods(user_defined_cls).items():
            # Registered names with a leading underscore (Worker's mesh queries) are bound
            # too, as verl binds them: the group calls them; a service lists public ones only.
            taken = hasattr(type(self), name) or name in self._reserved or name in self.__dict__
            if taken:
                raise ValueError(
                    f"worker method {name!r} cannot be registered: the worker group uses that name"
                )
            self._method_specs[name] = spec
            if func_generator is not None:
                setattr(self, name, func_generator(name, spec))
            bound.append(name)
        return bound

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: a bound worker method, or nothing.
        spec = self.__dict__.get("_method_specs", {}).get(name)
        if spec is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return self._make_group_method(name, spec)

    def _make_group_method(self, name: str, spec: MethodSpec) -> Callable[..., Any]:
        def group_method(*args: Any, **kwargs: Any) -> Any:
            return self._call_registered(name, spec, args, kwargs)

        group_method.__name__ = name
        group_method.__qualname__ = f"{type(self).__name__}.{name}"
        return group_method


def dispatch_arguments(group: Any, name: str, spec: MethodSpec, args: tuple, kwargs: dict) -> tuple[tuple, dict, int]:
    """Run a registered method's dispatch function: the per-rank arguments, and the
    rows a PROTO dispatch padded (to drop from the collected output). DataProtoFuture
    arguments are resolved first. A dispatch error names the method."""
    args, kwargs = materialize_futures(tuple(args), dict(kwargs))
    try:
        d_args, d_kwargs = spec.dispatch_spec.dispatch_fn(group, *args, **kwargs)
    except DispatchError as exc:
        message = str(exc)
        raise DispatchError(message if message.startswith(f"{name}:") else f"{name}: {message}") from None
    except Exception as exc:
        # A dispatch function (a custom one above all) that fails on its arguments: the
        # caller's arguments do not fit it, and nothing was submitted.
        fn = getattr(spec.dispatch_spec.dispatch_fn, "__name__", "dispatch_fn")
        detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else "no message"
        raise DispatchError(f"{name}: dispatch function {fn} raised {type(exc).__name__}: {detail}") from exc
    d_kwargs = dict(d_kwargs)
    padding = int(d_kwargs.pop(PADDING_KEY, 0) or 0)
    return tuple(d_args), d_kwargs, padding


def unpad_output(output: Any, padding: int) -> Any:
    """Drop the rows a PROTO dispatch padded from a collected batch (a DataProto or a
    TensorDict; per-rank lists keep every rank's entry)."""
    if padding and is_batch(output):
        return unpad_batch(output, padding)
    return output

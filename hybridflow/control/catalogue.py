"""The method catalogue of a served group: which methods a client may call, with which
modes, and which of them change state (and so are journaled)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from single_controller.base.worker_methods import public_methods, registered_methods

#: How a call on a method with no ``@register`` is described (verl's execute_all).
EXECUTE_ALL = "EXECUTE_ALL"
#: The snapshot protocol (torch's convention): the controller's own calls to take and load
#: a group's state (``hybridflow.control.durability``), not part of the group's API over HTTP.
STATE_DICT, LOAD_STATE_DICT = "state_dict", "load_state_dict"
SNAPSHOT_PROTOCOL = frozenset({STATE_DICT, LOAD_STATE_DICT})


@dataclass(frozen=True)
class MethodInfo:
    name: str
    dispatch_mode: str
    execute_mode: str
    registered: bool
    mutating: bool
    #: The mesh a method registered with ``make_nd_compute_dataproto_dispatch_fn`` is
    #: dispatched by (None for every other method).
    mesh: str | None = None

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dispatch_mode": self.dispatch_mode,
            "execute_mode": self.execute_mode,
            "registered": self.registered,
            "read_only": not self.mutating,
        }


def catalogue(worker_cls: Any, read_only: Iterable[str] = ()) -> dict[str, MethodInfo]:
    """The callable methods of a worker class (the library's one definition of them:
    public, not the library's plumbing, nor the snapshot protocol), by name. Every method
    is mutating unless named in ``read_only``. Methods named with a leading ``_`` (such as
    the ``_query_*`` methods a group asks its ranks for their meshes) are never listed, so
    no caller over HTTP reaches them."""
    specs = registered_methods(worker_cls)
    quiet = set(read_only)
    methods = {}
    for name in public_methods(worker_cls):
        if name in SNAPSHOT_PROTOCOL:
            continue
        spec = specs.get(name)
        methods[name] = MethodInfo(
            name=name,
            dispatch_mode=spec.dispatch_name if spec else EXECUTE_ALL,
            execute_mode=spec.execute_mode.name if spec else "ALL",
            registered=spec is not None,
            mutating=name not in quiet,
            mesh=(getattr(spec.dispatch_spec, "mesh_name", None) or None) if spec else None,
        )
    return methods


def per_rank_problem(method: str, world_size: int, args: Iterable[Any], kwargs: dict[str, Any]) -> str | None:
    """Over HTTP a list argument of an unregistered method is a per-rank list (verl's
    execute_all splits lists of world-size items): it must have one item per rank."""
    labelled = [(f"positional argument {i}", v) for i, v in enumerate(args)]
    labelled += [(f"argument {k!r}", v) for k, v in kwargs.items()]
    for label, value in labelled:
        if isinstance(value, list) and len(value) != world_size:
            return (
                f"{method}: {label} is a per-rank list of the wrong length: "
                f"expected {world_size} (one per rank), got {len(value)}"
            )
    return None

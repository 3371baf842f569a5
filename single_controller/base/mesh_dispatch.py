"""Dispatch by a named mesh (verl's ``make_nd_compute_dataproto_dispatch_fn``).

``@register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("train"))`` splits every
batch argument (a DataProto or a TensorDict, jagged tensors included) into as many equal
parts as mesh ``"train"`` has dp ranks, gives each rank the part of its dp rank (ranks
sharing a dp rank get the same object, which the Ray group puts in the object store once
for all of them), and answers the collecting ranks' outputs, in dp order, concatenated.

The mesh is whatever the workers declared (``Worker._register_dispatch_collect_info``);
the group asks its ranks once per mesh and keeps the answer
(``WorkerGroup.mesh_layout``). The two functions below are pure: given the
:class:`~single_controller.base.mesh.MeshLayout`, they split and collect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from single_controller.base.dispatch import DispatchError, DispatchSpec, split_batches, with_padding
from single_controller.base.mesh import MeshLayout
from single_controller.batch import concat_batches, is_batch

__all__ = [
    "MeshDispatchSpec",
    "collect_nd_compute_proto",
    "dispatch_nd_compute_proto",
    "make_nd_compute_dataproto_dispatch_fn",
    "mesh_of",
]


def mode_label(mesh_name: str) -> str:
    """How a mesh-dispatched method's mode is named (in errors and method catalogues)."""
    return f"ND_COMPUTE_PROTO({mesh_name})"


def dispatch_nd_compute_proto(mesh: MeshLayout, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """Every argument is a batch of one length: padded (a TensorDict always; a DataProto
    with auto padding on) to a multiple of ``mesh.dp_size``, split into that many parts;
    rank ``r`` gets part ``mesh.dp_ranks[r]``. Returns per-rank lists, with the padding
    under ``PADDING_KEY`` when rows were added."""
    split_args, split_kwargs, pad = split_batches(args, kwargs, mesh.dp_size, mode_label(mesh.name))

    def per_rank(parts: list) -> list:
        return [parts[dp] for dp in mesh.dp_ranks]

    new_args = tuple(per_rank(parts) for parts in split_args)
    new_kwargs = {key: per_rank(parts) for key, parts in split_kwargs.items()}
    return with_padding(new_args, new_kwargs, pad)


def collect_nd_compute_proto(mesh: MeshLayout, output: list) -> Any:
    """The collecting ranks' outputs, one per dp rank in dp order: concatenated when they
    are batches (the group then drops the padding), else as a list."""
    if len(output) != mesh.world_size:
        raise DispatchError(f"{mode_label(mesh.name)}: expected {mesh.world_size} outputs, got {len(output)}")
    chosen = [output[rank] for rank in mesh.collect_ranks]
    if all(is_batch(value) for value in chosen):
        return concat_batches(chosen)
    return chosen


def mesh_of(group: Any, mesh_name: str) -> MeshLayout:
    """``group.mesh_layout(mesh_name)``, checked against the group's world size."""
    getter = getattr(group, "mesh_layout", None)
    if getter is None:
        raise DispatchError(
            f"{mode_label(mesh_name)} needs a group that reports its meshes (mesh_layout), got {type(group).__name__}"
        )
    mesh = getter(mesh_name)
    if mesh.world_size != group.world_size:
        raise DispatchError(
            f"{mode_label(mesh_name)}: the mesh covers {mesh.world_size} ranks, the group has {group.world_size}"
        )
    return mesh


@dataclass(frozen=True)
class _NdDispatch:
    """``dispatch_fn(group, *args, **kwargs)`` for one mesh (picklable: it names the mesh)."""

    mesh_name: str

    def __call__(self, group: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        return dispatch_nd_compute_proto(mesh_of(group, self.mesh_name), *args, **kwargs)


@dataclass(frozen=True)
class _NdCollect:
    """``collect_fn(group, outputs)`` for one mesh."""

    mesh_name: str

    def __call__(self, group: Any, output: list) -> Any:
        return collect_nd_compute_proto(mesh_of(group, self.mesh_name), output)


@dataclass(frozen=True, eq=False)
class MeshDispatchSpec(DispatchSpec):
    """A dispatch mode bound to one mesh; reads as verl's ``{'dispatch_fn', 'collect_fn'}``."""

    mesh_name: str = ""

    @property
    def name(self) -> str:
        return mode_label(self.mesh_name)


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> MeshDispatchSpec:
    """The dispatch mode of mesh ``mesh_name``, for ``@register(dispatch_mode=...)``."""
    if not isinstance(mesh_name, str) or not mesh_name:
        raise ValueError(f"a mesh name is a non-empty string, got {mesh_name!r}")
    return MeshDispatchSpec(
        _NdDispatch(mesh_name), _NdCollect(mesh_name), collect_needs_values=True, mesh_name=mesh_name
    )

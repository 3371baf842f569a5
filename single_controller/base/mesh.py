"""Named meshes: where each rank of a group sits in a data-parallel layout it declares.

A worker declares, for each mesh it takes part in (``"train"``, ``"infer"``, ``"actor"``),
its data-parallel rank there and whether its output is the one collected for that dp
rank (``Worker._register_dispatch_collect_info``). Ranks that share a dp rank get the
same part of a batch; one of them answers for it. verl v0.5 and later declare meshes
this way, so that one group can dispatch differently for training (say pp x dp x tp)
and for generation (dp x tp) without the group knowing either layout.

Two records, both plain data:

- :class:`MeshPlaces`, on each worker: mesh name to (dp rank, collects?);
- :class:`MeshLayout`, on the controller: one mesh across the whole group (every rank's
  dp rank and collect flag), checked so that a batch split by it comes back whole.

Dispatching by a mesh is :mod:`single_controller.base.mesh_dispatch`.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MeshError", "MeshLayout", "MeshPlaces"]


class MeshError(ValueError, AssertionError):
    """A mesh declaration that cannot be used: a name registered twice, an unknown mesh,
    dp ranks with a gap, a dp rank with no (or two) collecting ranks. Also an
    ``AssertionError``, which is what verl raises (and its tests expect) for a clash."""


def _check_name(mesh_name: Any) -> str:
    if not isinstance(mesh_name, str) or not mesh_name:
        raise MeshError(f"a mesh name is a non-empty string, got {mesh_name!r}")
    return mesh_name


def _check_dp_rank(dp_rank: Any, what: str) -> int:
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, numbers.Integral) or dp_rank < 0:
        raise MeshError(f"{what}: a dp rank is a non-negative integer, got {dp_rank!r}")
    return int(dp_rank)


def _check_flag(is_collect: Any, what: str) -> bool:
    # A numpy or torch boolean scalar (a comparison of their integers) counts as a bool.
    scalar_bool = getattr(is_collect, "shape", None) == () and str(getattr(is_collect, "dtype", "")) in (
        "bool",
        "torch.bool",
    )
    if not isinstance(is_collect, bool) and not scalar_bool:
        raise MeshError(f"{what}: is_collect is a bool, got {is_collect!r}")
    return bool(is_collect)


class MeshPlaces:
    """One worker's places: for each mesh name, its dp rank and whether it collects."""

    def __init__(self) -> None:
        self._dp_rank: dict[str, int] = {}
        self._collects: dict[str, bool] = {}

    def register(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Declare this worker's place in ``mesh_name``; a mesh is declared once."""
        _check_name(mesh_name)
        what = f"mesh {mesh_name!r}"
        dp_rank = _check_dp_rank(dp_rank, what)
        is_collect = _check_flag(is_collect, what)
        if mesh_name in self._dp_rank:
            raise MeshError(
                f"mesh {mesh_name!r} is already registered on this worker "
                f"(dp rank {self._dp_rank[mesh_name]}, collect {self._collects[mesh_name]})"
            )
        self._dp_rank[mesh_name] = dp_rank
        self._collects[mesh_name] = is_collect

    def _known(self, mesh_name: str) -> str:
        if mesh_name not in self._dp_rank:
            raise MeshError(f"mesh {mesh_name!r} is not registered on this worker; registered: {sorted(self._dp_rank)}")
        return mesh_name

    def dp_rank(self, mesh_name: str) -> int:
        return self._dp_rank[self._known(mesh_name)]

    def is_collect(self, mesh_name: str) -> bool:
        return self._collects[self._known(mesh_name)]

    def names(self) -> list[str]:
        return list(self._dp_rank)

    def places(self) -> dict[str, tuple[int, bool]]:
        """Every mesh: ``name -> (dp rank, collects?)``."""
        return {name: (self._dp_rank[name], self._collects[name]) for name in self._dp_rank}

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """verl's ``get_dispatch_collect()`` answer: ``{"dispatch_dp_rank": {mesh: dp rank},
        "collect_dp_rank": {mesh: collects?}}`` (copies)."""
        return {"dispatch_dp_rank": dict(self._dp_rank), "collect_dp_rank": dict(self._collects)}

    def adopt(self, mesh_name: str, dispatch_dp_rank: Mapping[str, int], collect_dp_rank: Mapping[str, bool]) -> None:
        """Take another worker's place (its :meth:`snapshot`) as this worker's place in
        ``mesh_name``: how a fused worker answers for the roles it holds. The source's
        entry for ``mesh_name`` is taken when it has one, else its only entry; a source
        with several other meshes is ambiguous."""
        _check_name(mesh_name)
        if not isinstance(dispatch_dp_rank, Mapping) or not isinstance(collect_dp_rank, Mapping):
            raise MeshError("set_dispatch_collect takes the two mappings get_dispatch_collect() answers")
        if set(dispatch_dp_rank) != set(collect_dp_rank):
            raise MeshError(
                f"set_dispatch_collect: dispatch_dp_rank names meshes {sorted(dispatch_dp_rank)} but "
                f"collect_dp_rank names {sorted(collect_dp_rank)}"
            )
        if mesh_name in dispatch_dp_rank:
            source = mesh_name
        elif len(dispatch_dp_rank) == 1:
            source = next(iter(dispatch_dp_rank))
        else:
            raise MeshError(
                f"set_dispatch_collect({mesh_name!r}): the source registers {sorted(dispatch_dp_rank) or 'no'} "
                "meshes; give it one mesh, or one named like the target"
            )
        self.register(mesh_name, dispatch_dp_rank[source], collect_dp_rank[source])


@dataclass(frozen=True)
class MeshLayout:
    """One mesh across a group: ``dp_ranks[r]`` and ``collect[r]`` for every rank ``r``.

    Built by :meth:`of`, which checks what dispatch relies on: the dp ranks are
    ``0 .. dp_size - 1`` with none missing, and every dp rank has exactly one collecting
    rank, so a batch split into ``dp_size`` parts comes back whole and in order.
    """

    name: str
    dp_ranks: tuple[int, ...]
    collect: tuple[bool, ...]

    @classmethod
    def of(cls, name: str, dp_ranks: Sequence[int], collect: Sequence[bool]) -> MeshLayout:
        """The layout from per-rank answers; :class:`MeshError` naming what does not fit."""
        _check_name(name)
        dp_ranks = tuple(_check_dp_rank(d, f"mesh {name!r}, rank {r}") for r, d in enumerate(dp_ranks))
        collect = tuple(_check_flag(c, f"mesh {name!r}, rank {r}") for r, c in enumerate(collect))
        if not dp_ranks:
            raise MeshError(f"mesh {name!r} has no ranks")
        if len(collect) != len(dp_ranks):
            raise MeshError(f"mesh {name!r}: {len(dp_ranks)} dp ranks but {len(collect)} collect flags")
        dp_size = max(dp_ranks) + 1
        missing = sorted(set(range(dp_size)) - set(dp_ranks))
        if missing:
            raise MeshError(f"mesh {name!r}: dp ranks {missing} have no rank (dp ranks by rank: {list(dp_ranks)})")
        collectors: dict[int, list[int]] = {d: [] for d in range(dp_size)}
        for rank, (dp, collects) in enumerate(zip(dp_ranks, collect, strict=True)):
            if collects:
                collectors[dp].append(rank)
        wrong = {dp: ranks for dp, ranks in collectors.items() if len(ranks) != 1}
        if wrong:
            detail = ", ".join(f"dp rank {dp}: ranks {ranks}" for dp, ranks in wrong.items())
            raise MeshError(f"mesh {name!r}: every dp rank needs exactly one collecting rank; {detail}")
        return cls(name, dp_ranks, collect)

    @property
    def world_size(self) -> int:
        return len(self.dp_ranks)

    @property
    def dp_size(self) -> int:
        return max(self.dp_ranks) + 1

    @property
    def collect_ranks(self) -> list[int]:
        """The collecting rank of each dp rank, in dp order."""
        pairs = zip(self.dp_ranks, self.collect, strict=True)
        by_dp = {dp: rank for rank, (dp, collects) in enumerate(pairs) if collects}
        return [by_dp[dp] for dp in range(self.dp_size)]

    def describe(self) -> dict[str, Any]:
        """JSON-ready: ``{"dp_size", "dp_ranks" (by rank), "collect_ranks" (by dp rank)}``."""
        return {"dp_size": self.dp_size, "dp_ranks": list(self.dp_ranks), "collect_ranks": self.collect_ranks}

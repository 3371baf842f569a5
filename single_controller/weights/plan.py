"""Resharding by overlaps: which slices of which source ranks each destination rank needs.

For every destination rank and every parameter it holds, the planner intersects the
rank's box of the full tensor with each distinct box the source ranks hold; each
non-empty overlap is one :class:`SliceTransfer`, in the source shard's and the
destination shard's own coordinates. Where several source ranks hold the same box (dp or
pp copies), destination ranks take turns among them, so copies share the sending.
Nothing here moves data; a layout pair that cannot be resharded is a ValueError before
anything moves.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from single_controller.weights.layout import Box, ParamSpec, RankWeights, WeightLayout, box_numel


@dataclass(frozen=True)
class SliceTransfer:
    """One slice of one parameter from a source rank to a destination rank."""

    param: str
    src_rank: int
    dst_rank: int
    #: The slice in the source rank's shard (its own coordinates).
    src_slice: Box
    #: Where it goes in the destination rank's shard (its own coordinates).
    dst_slice: Box
    dtype: str
    itemsize: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.dst_slice)

    @property
    def numel(self) -> int:
        return box_numel(self.dst_slice)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def piece(self) -> tuple[int, str, Box]:
        """What the source puts: the same piece serves every destination that needs it."""
        return self.src_rank, self.param, self.src_slice


@dataclass(frozen=True)
class ReshardPlan:
    """Per destination rank, the slices it needs, in one deterministic order."""

    src_world: int
    dst_world: int
    per_dst: tuple[tuple[SliceTransfer, ...], ...]
    #: The bytes of one full copy of the model.
    full_bytes: int

    def transfers(self) -> Iterator[SliceTransfer]:
        """Every transfer, destination by destination: the order both ends of a
        point-to-point transfer walk, so their sends and receives match."""
        for transfers in self.per_dst:
            yield from transfers

    def bytes_per_dst_rank(self) -> list[int]:
        return [sum(t.nbytes for t in transfers) for transfers in self.per_dst]

    def slices_per_dst_rank(self) -> list[int]:
        return [len(transfers) for transfers in self.per_dst]

    def pieces_by_src_rank(self) -> list[list[tuple[str, Box]]]:
        """Per source rank, the distinct ``(param, src_slice)`` pieces some destination
        needs from it, each once, in plan order."""
        pieces: list[list[tuple[str, Box]]] = [[] for _ in range(self.src_world)]
        seen: set[tuple[int, str, Box]] = set()
        for transfer in self.transfers():
            if transfer.piece not in seen:
                seen.add(transfer.piece)
                pieces[transfer.src_rank].append((transfer.param, transfer.src_slice))
        return pieces

    @property
    def src_ranks(self) -> list[int]:
        """The source ranks that send anything."""
        return sorted({t.src_rank for t in self.transfers()})


def _intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return box if all(start < stop for start, stop in box) else None


def _relative(box: Box, origin: Box) -> Box:
    return tuple((start - o, stop - o) for (start, stop), (o, _) in zip(box, origin, strict=True))


def _compare_params(src: dict[str, ParamSpec], dst: dict[str, ParamSpec]) -> list[str]:
    problems = []
    if missing := [n for n in dst if n not in src]:
        problems.append(f"the source holds no {', '.join(missing)}")
    if extra := [n for n in src if n not in dst]:
        problems.append(f"the destination holds no {', '.join(extra)}")
    for name in (n for n in dst if n in src):
        s, d = src[name], dst[name]
        if s.shape != d.shape:
            problems.append(f"{name} is {list(s.shape)} in the source and {list(d.shape)} in the destination")
        if s.dtype != d.dtype:
            problems.append(f"{name} is {s.dtype} in the source and {d.dtype} in the destination")
    return problems


def _source_boxes(src: WeightLayout, spec: ParamSpec) -> dict[Box, list[RankWeights]]:
    """The distinct boxes of ``spec`` the source ranks hold, each with its holders; they
    must tile the full tensor."""
    boxes: dict[Box, list[RankWeights]] = {}
    for rank in src.holders(spec.name):
        boxes.setdefault(rank.box(spec.name), []).append(rank)
    covered = sum(box_numel(box) for box in boxes)
    distinct = list(boxes)
    disjoint = all(_intersect(a, b) is None for i, a in enumerate(distinct) for b in distinct[i + 1 :])
    if covered != spec.numel or not disjoint:
        held = sorted({r.tp_rank for ranks in boxes.values() for r in ranks})
        raise ValueError(
            f"cannot reshard: the source's ranks do not hold all of {spec.name} once "
            f"(tp ranks {held} of {src.tp_size} hold it)"
        )
    return boxes


def plan_resharding(src: WeightLayout, dst: WeightLayout) -> ReshardPlan:
    """The slices each destination rank needs from the source to hold its shards.

    Both layouts must hold the same parameters, with the same full shapes and dtypes, and
    the source must hold every part of each of them; else ValueError naming each problem.
    """
    src_params, dst_params = src.params, dst.params
    problems = _compare_params(src_params, dst_params)
    if problems:
        raise ValueError("cannot reshard: " + "; ".join(problems))
    boxes = {name: _source_boxes(src, spec) for name, spec in src_params.items()}
    per_dst = []
    for rank in dst.ranks:
        transfers = []
        for spec in rank.params:
            dst_box = rank.box(spec.name)
            for src_box, holders in boxes[spec.name].items():
                overlap = _intersect(dst_box, src_box)
                if overlap is None:
                    continue
                # copies of one box take turns, destination by destination
                chosen = holders[rank.rank % len(holders)]
                transfers.append(
                    SliceTransfer(
                        param=spec.name,
                        src_rank=chosen.rank,
                        dst_rank=rank.rank,
                        src_slice=_relative(overlap, src_box),
                        dst_slice=_relative(overlap, dst_box),
                        dtype=spec.dtype,
                        itemsize=spec.itemsize,
                    )
                )
        per_dst.append(tuple(transfers))
    return ReshardPlan(
        src_world=src.world_size, dst_world=dst.world_size, per_dst=tuple(per_dst), full_bytes=src.full_bytes
    )

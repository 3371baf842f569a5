"""How a group holds its weights: the layout a worker declares and a planner reads.

Each parameter is named by its logical name (``gate_proj``, not the fused storage a layer
may keep it in), with its full shape, its dtype and the dimension a tensor-parallel rank
splits (None: every tp rank holds all of it). Each rank says where it sits (tp, dp, pp),
which parameters it holds (a pp stage holds its own layers; dp ranks of one tp rank hold
copies) and on which device. Plain data, picklable and JSON-able: no torch, no Ray.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: A box of a tensor: per dimension ``(start, stop)``.
Box = tuple[tuple[int, int], ...]

#: Bytes per element of the dtypes a layout may name (torch's names without ``torch.``).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def box_numel(box: Box) -> int:
    numel = 1
    for start, stop in box:
        numel *= stop - start
    return numel


def box_slices(box: Box) -> tuple[slice, ...]:
    """The box as an index: ``tensor[box_slices(box)]``."""
    return tuple(slice(start, stop) for start, stop in box)


@dataclass(frozen=True)
class ParamSpec:
    """One logical parameter: full shape, dtype, and the dimension tp splits (or None)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    split_dim: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a parameter needs a non-empty name, got {self.name!r}")
        shape = tuple(self.shape)
        if not shape or not all(_is_int(n) and n > 0 for n in shape):
            raise ValueError(f"{self.name}: shape must be positive integers, got {list(self.shape)}")
        object.__setattr__(self, "shape", shape)
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"{self.name}: unknown dtype {self.dtype!r}; known: {', '.join(DTYPE_SIZES)}")
        if self.split_dim is not None and not (_is_int(self.split_dim) and 0 <= self.split_dim < len(shape)):
            raise ValueError(f"{self.name}: split_dim must be None or a dimension of {list(shape)}, got {self.split_dim!r}")

    @property
    def numel(self) -> int:
        return box_numel(self.full_box)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def full_box(self) -> Box:
        return tuple((0, n) for n in self.shape)

    def shard_box(self, tp_rank: int, tp_size: int) -> Box:
        """The part of the full tensor tp rank ``tp_rank`` of ``tp_size`` holds."""
        if self.split_dim is None:
            return self.full_box
        size = self.shape[self.split_dim]
        if size % tp_size:
            raise ValueError(
                f"{self.name}: dimension {self.split_dim} of {list(self.shape)} ({size}) is not divisible by tp {tp_size}"
            )
        per_rank = size // tp_size
        box = list(self.full_box)
        box[self.split_dim] = (tp_rank * per_rank, (tp_rank + 1) * per_rank)
        return tuple(box)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "split_dim": self.split_dim}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParamSpec:
        return cls(data["name"], tuple(data["shape"]), data.get("dtype", "float32"), data.get("split_dim"))


@dataclass(frozen=True)
class RankWeights:
    """What one rank holds: its place in the parallel layout, its parameters, its device.

    ``device_key`` names the physical device ("" on CPU): two ranks with the same key
    share one GPU, and NCCL cannot connect them."""

    rank: int
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    pp_rank: int = 0
    params: tuple[ParamSpec, ...] = ()
    device: str = "cpu"
    device_key: str = ""

    def __post_init__(self) -> None:
        for key in ("rank", "tp_rank", "dp_rank", "pp_rank"):
            if not (_is_int(getattr(self, key)) and getattr(self, key) >= 0):
                raise ValueError(f"rank weights: {key} must be a non-negative integer, got {getattr(self, key)!r}")
        if not (_is_int(self.tp_size) and self.tp_size > 0 and self.tp_rank < self.tp_size):
            raise ValueError(f"rank {self.rank}: tp_rank {self.tp_rank} is not in a tp of size {self.tp_size}")
        params = tuple(self.params)
        names = [p.name for p in params]
        if len(set(names)) != len(names):
            raise ValueError(f"rank {self.rank}: a parameter is declared twice in {names}")
        object.__setattr__(self, "params", params)
        for spec in params:  # divisibility, checked once here
            spec.shard_box(self.tp_rank, self.tp_size)

    def spec(self, name: str) -> ParamSpec:
        for spec in self.params:
            if spec.name == name:
                return spec
        raise KeyError(f"rank {self.rank} holds no parameter {name!r}")

    def box(self, name: str) -> Box:
        """The part of ``name``'s full tensor this rank holds."""
        return self.spec(name).shard_box(self.tp_rank, self.tp_size)

    def shard_shape(self, name: str) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.box(name))

    @property
    def shard_bytes(self) -> int:
        return sum(box_numel(self.box(p.name)) * p.itemsize for p in self.params)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "tp_rank": self.tp_rank, "tp_size": self.tp_size, "dp_rank": self.dp_rank,
            "pp_rank": self.pp_rank, "params": [p.to_dict() for p in self.params], "device": self.device,
            "device_key": self.device_key,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankWeights:
        fields = {k: data[k] for k in ("rank", "tp_rank", "tp_size", "dp_rank", "pp_rank", "device", "device_key") if k in data}
        return cls(params=tuple(ParamSpec.from_dict(p) for p in data.get("params", ())), **fields)


@dataclass(frozen=True)
class WeightLayout:
    """A group's layout: one :class:`RankWeights` per rank, in rank order, consistent with
    each other (one spec per parameter name, one tp size)."""

    ranks: tuple[RankWeights, ...]
    _params: dict[str, ParamSpec] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ranks = tuple(self.ranks)
        if not ranks:
            raise ValueError("a weight layout needs at least one rank")
        object.__setattr__(self, "ranks", ranks)
        for index, rank in enumerate(ranks):
            if rank.rank != index:
                raise ValueError(f"layout rank {index} declares itself rank {rank.rank}")
        tp_sizes = sorted({r.tp_size for r in ranks})
        if len(tp_sizes) > 1:
            raise ValueError(f"ranks of one group declare different tp sizes {tp_sizes}")
        for rank in ranks:
            for spec in rank.params:
                known = self._params.setdefault(spec.name, spec)
                if known != spec:
                    raise ValueError(f"ranks of one group declare {spec.name} differently: {known} and {spec}")

    @classmethod
    def of(cls, ranks: Iterable[RankWeights]) -> WeightLayout:
        return cls(tuple(ranks))

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def tp_size(self) -> int:
        return self.ranks[0].tp_size

    @property
    def params(self) -> dict[str, ParamSpec]:
        """Every parameter some rank holds, by name, in the order first declared."""
        return dict(self._params)

    def holders(self, name: str) -> list[RankWeights]:
        return [r for r in self.ranks if any(p.name == name for p in r.params)]

    @property
    def full_bytes(self) -> int:
        """The bytes of one full copy of the model."""
        return sum(spec.nbytes for spec in self._params.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "tp_size": self.tp_size,
            "full_bytes": self.full_bytes,
            "params": [spec.to_dict() for spec in self._params.values()],
            "ranks": [r.to_dict() for r in self.ranks],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WeightLayout:
        return cls(tuple(RankWeights.from_dict(r) for r in data["ranks"]))

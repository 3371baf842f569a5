"""Which way a sync's slices travel: Ray's object store, or a collective group of the
ranks involved (NCCL between GPUs; gloo between CPU ranks, where it serves as the
testable stand-in for the same code). Pure: decided from the two layouts and the plan."""

from __future__ import annotations

from dataclasses import dataclass

from single_controller.weights.layout import WeightLayout
from single_controller.weights.plan import ReshardPlan

OBJECT_STORE = "object_store"
COLLECTIVE = "collective"
#: What a caller may ask for; ``auto`` takes the collective path where NCCL can run it.
TRANSPORTS = ("auto", OBJECT_STORE, COLLECTIVE)


@dataclass(frozen=True)
class Route:
    transport: str
    #: torch.distributed backend of the collective path (None for the object store).
    backend: str | None
    #: Why this route, for the sync's report.
    reason: str


def _shared_devices(src: WeightLayout, dst: WeightLayout, plan: ReshardPlan) -> list[tuple[int, int]]:
    """Pairs (src rank, dst rank) of the plan that sit on one GPU."""
    pairs = {(t.src_rank, t.dst_rank) for t in plan.transfers()}
    return sorted(
        (s, d) for s, d in pairs
        if src.ranks[s].device_key and src.ranks[s].device_key == dst.ranks[d].device_key
    )


def choose_transport(src: WeightLayout, dst: WeightLayout, plan: ReshardPlan, requested: str = "auto") -> Route:
    """The route for ``plan``. ``collective`` needs every involved rank on one kind of
    device, and on GPUs no sending pair on the same GPU (NCCL refuses two ranks of one
    communicator on one device); ``auto`` takes it only for GPU ranks that meet that,
    and the object store otherwise. A request that cannot be met is a ValueError."""
    if requested not in TRANSPORTS:
        raise ValueError(f"unknown transport {requested!r}; known: {', '.join(TRANSPORTS)}")
    if requested == OBJECT_STORE:
        return Route(OBJECT_STORE, None, "asked for")
    involved = [src.ranks[r] for r in plan.src_ranks] + [r for r in dst.ranks if plan.per_dst[r.rank]]
    devices = sorted({r.device for r in involved})
    shared = _shared_devices(src, dst, plan)
    if devices == ["cuda"] and not shared:
        return Route(COLLECTIVE, "nccl", "every rank involved is on its own GPU")
    if requested == "auto":
        if devices != ["cuda"]:
            return Route(OBJECT_STORE, None, f"ranks on {'/'.join(devices) or 'no device'}: NCCL needs GPUs")
        pairs = ", ".join(f"src {s}/dst {d}" for s, d in shared)
        return Route(OBJECT_STORE, None, f"ranks that exchange slices share a GPU ({pairs}); NCCL cannot connect them")
    if devices == ["cpu"]:
        return Route(COLLECTIVE, "gloo", "asked for; every rank involved is on CPU")
    if len(devices) > 1:
        raise ValueError(f"a collective transfer needs every rank on one kind of device, got {devices}")
    pairs = ", ".join(f"src rank {s} and dst rank {d}" for s, d in shared)
    raise ValueError(f"a collective transfer over NCCL cannot connect ranks on one GPU: {pairs}")

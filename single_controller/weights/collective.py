"""The collective path of a sync: a torch.distributed process group of just the ranks
involved, built for one transfer, and point-to-point sends and receives of the plan's
slices over it.

Every worker already belongs to its own group's default process group, so this one is
made directly (``ProcessGroupNCCL`` / ``ProcessGroupGloo`` on a ``TCPStore``), outside
torch's default world, under a name unique to the transfer. Collective ranks are the
sending source ranks first, then every destination rank. Both ends walk the plan in its
one order, so each pair's sends and receives match (NCCL matches them by order; the tag,
the transfer's index in the plan, is for gloo). Torch only, no Ray: a plain
torch.multiprocessing program can drive it (``examples/weight_sync_gpu.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from single_controller.gloo_device import gloo_options
from single_controller.weights.layout import box_slices
from single_controller.weights.plan import ReshardPlan


@dataclass(frozen=True)
class TransferGroup:
    """Where and how the ranks of one transfer meet."""

    #: Unique per transfer: the store prefix, so concurrent transfers never mix keys.
    name: str
    addr: str
    port: int
    backend: str
    timeout_s: float = 300.0


@dataclass(frozen=True)
class CollectiveRanks:
    """Collective rank numbers of a plan's participants."""

    src: dict[int, int]
    dst: dict[int, int]

    @property
    def size(self) -> int:
        return len(self.src) + len(self.dst)

    @classmethod
    def of(cls, plan: ReshardPlan) -> CollectiveRanks:
        src = {rank: index for index, rank in enumerate(plan.src_ranks)}
        dst = {rank: len(src) + rank for rank in range(plan.dst_world)}
        return cls(src, dst)


def host_store(addr: str, timeout_s: float) -> dist.TCPStore:
    """The transfer's rendezvous, on a port the OS picks (``store.port``); the process
    that hosts it must keep it until every rank has finished the transfer."""
    return dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def open_group(group: TransferGroup, rank: int, size: int, store: dist.Store | None = None) -> dist.ProcessGroup:
    """This process's member of the transfer's process group (collective rank ``rank``)."""
    timeout = timedelta(seconds=group.timeout_s)
    if store is None:
        store = dist.TCPStore(group.addr, group.port, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"weights/{group.name}/", store)
    if group.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, options)
    if group.backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, size, gloo_options(timeout))
    raise ValueError(f"unknown collective backend {group.backend!r}; known: nccl, gloo")


def close_group(pg: dist.ProcessGroup) -> None:
    # NCCL's communicators are released here rather than whenever the object is collected.
    shutdown = getattr(pg, "shutdown", None)
    if callable(shutdown):
        shutdown()


def _finish(works: list, device: torch.device) -> None:
    for work in works:
        work.wait()
    if device.type == "cuda":
        # wait() orders the current stream after NCCL's; the host waits for the bytes.
        torch.cuda.synchronize(device)


def send_slices(
    pg: dist.ProcessGroup, plan: ReshardPlan, src_rank: int, views: dict[str, torch.Tensor], ranks: CollectiveRanks
) -> int:
    """Send what ``src_rank`` owes every destination, from its shards' logical views;
    the bytes sent. Each slice is copied out contiguous first (the send reads it while
    later calls may change the live weights)."""
    works, kept, sent, device = [], [], 0, torch.device("cpu")
    for tag, transfer in enumerate(plan.transfers()):
        if transfer.src_rank != src_rank:
            continue
        piece = views[transfer.param][box_slices(transfer.src_slice)].detach().contiguous()
        device = piece.device
        kept.append(piece)
        works.append(pg.send([piece], ranks.dst[transfer.dst_rank], tag))
        sent += transfer.nbytes
    _finish(works, device)
    return sent


def recv_slices(
    pg: dist.ProcessGroup, plan: ReshardPlan, dst_rank: int, views: dict[str, torch.Tensor], ranks: CollectiveRanks
) -> list[tuple[str, int, int]]:
    """Receive ``dst_rank``'s slices into its staged shards' logical views: straight into
    a contiguous target, else through a buffer. Per slice: (param, src rank, bytes)."""
    tags = [tag for tag, t in enumerate(plan.transfers()) if t.dst_rank == dst_rank]
    works, copies, received, device = [], [], [], torch.device("cpu")
    for tag, transfer in zip(tags, plan.per_dst[dst_rank], strict=True):
        target = views[transfer.param][box_slices(transfer.dst_slice)]
        device = target.device
        buffer = target if target.is_contiguous() else torch.empty_like(target, memory_format=torch.contiguous_format)
        if buffer is not target:
            copies.append((target, buffer))
        works.append(pg.recv([buffer], ranks.src[transfer.src_rank], tag))
        received.append((transfer.param, transfer.src_rank, buffer.numel() * buffer.element_size()))
    _finish(works, device)
    for target, buffer in copies:
        target.copy_(buffer)
    return received

"""The worker's side of a weight sync: a mixin for a ``Worker`` whose weights a group can
read out, reshard and take in.

A layer implements three hooks: ``_declare_weights`` (its :class:`RankWeights`),
``_weight_storage`` (its live tensors, by storage name: e.g. a fused gate-up matrix) and
``_logical_views`` (each logical parameter's shard as a view into such storage). The
mixin does the rest. Received slices go into a new storage, never the live one
(``_stage_weights``); ``_commit_weights`` swaps it in and sets the version in one method
call, and a rank runs one call at a time, so no call on the rank sees half of it. The
methods are underscored: the group's plumbing, driven by
:mod:`single_controller.weights.sync`, not a method a client calls.
"""

from __future__ import annotations

import socket
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from single_controller.weights.collective import (
    CollectiveRanks,
    TransferGroup,
    close_group,
    host_store,
    open_group,
    recv_slices,
    send_slices,
)
from single_controller.weights.layout import Box, RankWeights, box_slices
from single_controller.weights.plan import ReshardPlan, SliceTransfer


@dataclass
class _Staged:
    sync_id: str
    version: int
    storage: dict[str, torch.Tensor]


def _to_bytes(piece: torch.Tensor) -> Any:
    """A contiguous CPU tensor as a numpy byte array: any dtype (bfloat16, float8) travels
    out of band through Ray's object store, which reads numpy buffers without pickling."""
    return piece.reshape(-1).view(torch.uint8).numpy()


def _from_bytes(array: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    with warnings.catch_warnings():
        # the object store's buffer is read-only; it is only read, into the staged copy
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(array)
    return flat.view(getattr(torch, dtype)).reshape(shape)


def device_key(tensor: torch.Tensor) -> str:
    """The physical device a tensor lives on ("" on CPU): the node and the GPU's UUID,
    the same in every process whatever CUDA_VISIBLE_DEVICES numbers it."""
    if tensor.device.type != "cuda":
        return ""
    try:
        import ray

        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except ImportError:
        node = ""
    return f"{node or socket.gethostname()}/{torch.cuda.get_device_properties(tensor.device).uuid}"


class WeightSyncWorker:
    """Mixin (before the ``Worker`` base) for a layer that can take part in a weight sync."""

    # -- what a layer implements --------------------------------------------------------
    def _declare_weights(self) -> RankWeights:
        """This rank's layout (the mixin fills in ``device`` and ``device_key``)."""
        raise NotImplementedError

    def _weight_storage(self) -> dict[str, torch.Tensor]:
        """The live tensors the weights are stored in, by storage name."""
        raise NotImplementedError

    def _logical_views(self, storage: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each logical parameter's shard, by logical name, as a view into ``storage``
        (a dict shaped like ``_weight_storage``'s)."""
        raise NotImplementedError

    def _install_weight_storage(self, storage: dict[str, torch.Tensor]) -> None:
        """Make ``storage`` the live weights: by default each live tensor (a Parameter)
        takes the new tensor as its data, a pointer swap with no copy."""
        for name, live in self._weight_storage().items():
            live.data = storage[name]

    # -- state -----------------------------------------------------------------------------
    def _weights_reset(self) -> None:
        """The weights changed by other means (a fresh init): version 0, nothing staged."""
        self._sync_version = 0
        self._staged = None

    def _weights_version(self) -> int:
        """The version of the last sync or load these weights came from (0: none)."""
        return getattr(self, "_sync_version", 0)

    def _weight_layout(self) -> RankWeights:
        declared = self._declare_weights()
        storage = self._weight_storage()
        views = self._views_checked(storage)
        for spec in declared.params:  # the declaration must describe what the views hold
            view = views.get(spec.name)
            held = None if view is None else (tuple(view.shape), str(view.dtype).removeprefix("torch."))
            if held != (declared.shard_shape(spec.name), spec.dtype):
                raise ValueError(f"{spec.name}: declared as a {declared.shard_shape(spec.name)} {spec.dtype} shard, holds {held}")
        live = next(iter(storage.values()))
        kind = live.device.type
        return RankWeights(
            rank=declared.rank, tp_rank=declared.tp_rank, tp_size=declared.tp_size, dp_rank=declared.dp_rank,
            pp_rank=declared.pp_rank, params=declared.params, device=kind, device_key=device_key(live),
        )

    def _views_checked(self, storage: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The logical views of ``storage``, which must cover all of it: a staged storage
        starts empty, and a byte no view reaches would go live unset."""
        views = self._logical_views(storage)
        if sum(v.numel() for v in views.values()) != sum(t.numel() for t in storage.values()):
            raise ValueError("the layer's logical parameters do not cover its storage exactly")
        return views

    def _new_storage(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        storage = {name: torch.empty_like(t).detach() for name, t in self._weight_storage().items()}
        return storage, self._views_checked(storage)

    def _check_version(self, version: Any) -> int:
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ValueError(f"a weights version must be a positive integer, got {version!r}")
        return version

    # -- source side -----------------------------------------------------------------------
    def _put_weight_slices(self, pieces: list[tuple[str, Box]]) -> list[Any]:
        """Put each piece of this rank's shards in Ray's object store, once: ObjectRefs in
        the order asked. Read now, so later calls on this rank do not change them."""
        import ray

        views = self._logical_views(self._weight_storage())
        refs = []
        for param, box in pieces:
            piece = views[param][box_slices(box)].detach().contiguous().cpu()
            refs.append(ray.put(_to_bytes(piece)))
        return refs

    def _open_weight_transfer(self, host: bool, timeout_s: float = 300.0) -> tuple[str, int] | None:
        """On the rank that hosts a collective transfer's rendezvous: open it and answer
        its address; other ranks answer None."""
        if not host:
            return None
        from single_controller.rendezvous import node_ip_address

        addr = node_ip_address()
        self._transfer_store = host_store(addr, timeout_s)
        return addr, int(self._transfer_store.port)

    def _close_weight_transfer(self) -> None:
        self._transfer_store = None

    def _join_transfer(self, group: TransferGroup, rank: int, size: int) -> Any:
        return open_group(group, rank, size, store=getattr(self, "_transfer_store", None))

    def _send_weight_slices(self, group: TransferGroup | None, plan: ReshardPlan | None) -> int:
        """Send this rank's part of ``plan`` over the transfer's process group; the bytes
        sent (0 for a rank with nothing to send)."""
        if group is None or plan is None:
            return 0
        ranks = CollectiveRanks.of(plan)
        if self.rank not in ranks.src:
            return 0
        pg = self._join_transfer(group, ranks.src[self.rank], ranks.size)
        try:
            return send_slices(pg, plan, self.rank, self._logical_views(self._weight_storage()), ranks)
        finally:
            close_group(pg)

    # -- destination side --------------------------------------------------------------
    def _stage_weights(
        self,
        sync_id: str,
        version: int,
        transfers: tuple[SliceTransfer, ...] = (),
        refs: list[Any] | None = None,
        group: TransferGroup | None = None,
        plan: ReshardPlan | None = None,
    ) -> dict[str, Any]:
        """Receive this rank's slices into a new storage and keep it staged under
        ``sync_id`` (replacing any earlier staging): from ``refs`` (one ObjectRef per
        transfer) through the object store, or over ``group`` for ``plan``. Answers what
        arrived: bytes, slice count, and per slice (param, src rank, bytes)."""
        version = self._check_version(version)
        started = time.perf_counter()
        self._staged = None
        storage, views = self._new_storage()
        if group is not None:
            ranks = CollectiveRanks.of(plan)
            pg = self._join_transfer(group, ranks.dst[self.rank], ranks.size)
            try:
                received = recv_slices(pg, plan, self.rank, views, ranks)
            finally:
                close_group(pg)
            transfers = plan.per_dst[self.rank]
        else:
            received = self._fetch_slices(transfers, refs or [], views)
        covered = {}
        for transfer in transfers:
            covered[transfer.param] = covered.get(transfer.param, 0) + transfer.numel
        short = {name: (covered.get(name, 0), view.numel()) for name, view in views.items() if covered.get(name, 0) != view.numel()}
        if short:
            raise ValueError(f"the slices received do not fill this rank's shards (elements got, needed): {short}")
        self._staged = _Staged(sync_id, version, storage)
        return {
            "rank": self.rank,
            "bytes": sum(nbytes for _, _, nbytes in received),
            "slices": len(received),
            "received": received,
            "seconds": time.perf_counter() - started,
        }

    def _fetch_slices(
        self, transfers: tuple[SliceTransfer, ...], refs: list[Any], views: dict[str, torch.Tensor]
    ) -> list[tuple[str, int, int]]:
        import ray

        if len(refs) != len(transfers):
            raise ValueError(f"{len(transfers)} slices planned for rank {self.rank} but {len(refs)} references given")
        arrays = ray.get(list(refs))
        received = []
        for transfer, array in zip(transfers, arrays, strict=True):
            if array.nbytes != transfer.nbytes:
                raise ValueError(
                    f"slice of {transfer.param} from rank {transfer.src_rank}: {array.nbytes} bytes, planned {transfer.nbytes}"
                )
            piece = _from_bytes(array, transfer.dtype, transfer.shape)
            views[transfer.param][box_slices(transfer.dst_slice)].copy_(piece)
            received.append((transfer.param, transfer.src_rank, int(array.nbytes)))
        return received

    def _load_weights(self, sync_id: str, version: int, shards: dict[str, torch.Tensor] | None) -> dict[str, Any] | None:
        """Stage this rank's shards as read back by ``_read_weights`` (a rebuilt group's
        restore); each must have its logical shard's shape and dtype exactly. None: not
        this rank's turn (ranks are loaded one at a time), nothing changes."""
        if shards is None:
            return None
        version = self._check_version(version)
        self._staged = None
        storage, views = self._new_storage()
        if sorted(shards) != sorted(views):
            raise ValueError(f"shards for {sorted(shards)} but this rank holds {sorted(views)}")
        for name, view in views.items():
            given = shards[name]
            if not isinstance(given, torch.Tensor) or given.shape != view.shape or given.dtype != view.dtype:
                got = f"{list(given.shape)} {given.dtype}" if isinstance(given, torch.Tensor) else type(given).__name__
                raise ValueError(f"{name}: shard is {got}, this rank holds {list(view.shape)} {view.dtype}")
            view.copy_(given)
        self._staged = _Staged(sync_id, version, storage)
        return {"rank": self.rank, "bytes": sum(v.numel() * v.element_size() for v in views.values())}

    def _commit_weights(self, sync_id: str) -> int:
        """Swap the weights staged under ``sync_id`` in and take their version."""
        staged = getattr(self, "_staged", None)
        if staged is None or staged.sync_id != sync_id:
            raise RuntimeError(
                f"no weights staged for sync {sync_id} on rank {self.rank} "
                "(another sync or load staged after it, or the layer was rebuilt)"
            )
        self._install_weight_storage(staged.storage)
        self._sync_version, self._staged = staged.version, None
        return staged.version

    def _abort_weights(self, sync_id: str | None = None) -> bool:
        """Drop the weights staged under ``sync_id`` (any staging when None)."""
        staged = getattr(self, "_staged", None)
        if staged is not None and (sync_id is None or staged.sync_id == sync_id):
            self._staged = None
            return True
        return False

    def _read_weights(self, include: bool = True) -> dict[str, Any]:
        """This rank's shards (contiguous CPU copies, by logical name; None unless
        ``include``) and their version: what a rebuilt group needs to come back with
        exactly these weights."""
        if not include:
            return {"version": self._weights_version(), "shards": None}
        views = self._logical_views(self._weight_storage())
        shards = {
            name: view.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
            for name, view in views.items()
        }
        return {"version": self._weights_version(), "shards": shards}

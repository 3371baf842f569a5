"""DataProto: the batch that verl's worker methods take and return.

A DataProto has three parts, each easy to carry on its own:

- ``batch``: a :class:`tensordict.TensorDict` of tensors that share their first
  dimension (the rows), with exactly one batch dimension; or None;
- ``non_tensor_batch``: a dict of numpy arrays with one entry per row along their first
  axis (``dtype=object`` allowed: strings, lists, dicts);
- ``meta_info``: a dict about the whole batch (not split, copied to every piece).

Its operations follow verl v0.4's documented behaviour. Row operations (slicing,
indexing, ``chunk``, ``split``, ``repeat``, ``select_idxs``) return new DataProtos;
``padding``, ``reorder``, ``rename``, ``union``, ``pop`` and ``to`` change this one, as
in verl. Bad input raises :class:`DataProtoError` (a ``ValueError``) naming it.

Auto padding (``DataProtoConfig.auto_padding = True``, the ``VERL_AUTO_PADDING``
environment variable, or ``from_dict(..., auto_padding=True)`` for one DataProto) lets
a PROTO dispatch pad a batch that does not divide by the group's data-parallel size;
the padded rows are dropped from the answer. Without it such a batch is an error.

``from single_controller.protocol import DataProto, DataProtoFuture, DataProtoConfig``
and verl's helpers (``union_tensor_dict``, ``pad_dataproto_to_divisor``, ...) live here.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from single_controller import protocol_ops
from single_controller.batch import PADDING_KEY, compact_tensordict
from single_controller.protocol_future import DataProtoFuture
from single_controller.protocol_ops import *  # noqa: F403  (verl's helpers, served from here too)
from single_controller.protocol_ops import DataProtoError, union_numpy_dict, union_tensor_dict, union_two_dict

__all__ = ["DataProto", "DataProtoConfig", "DataProtoFuture", "DataProtoItem", *protocol_ops.__all__]

#: verl's name for the dispatch padding key (the rows a dispatch padded).
_padding_size_key = PADDING_KEY

#: Environment variable that turns auto padding on for every DataProto ("1" or "true").
AUTO_PADDING_ENV = "VERL_AUTO_PADDING"


class _DataProtoConfigMeta(type):
    _config: dict[str, bool] = {}
    #: The meta_info key that turns auto padding on for one DataProto (verl's key).
    auto_padding_key = "_verl_auto_padding"

    @property
    def auto_padding(cls) -> bool:
        from_env = os.environ.get(AUTO_PADDING_ENV, "false").strip().lower() in ("1", "true")
        return from_env or cls._config.get(cls.auto_padding_key, False)

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise DataProtoError(f"DataProtoConfig.auto_padding takes a bool, got {enabled!r}")
        cls._config[cls.auto_padding_key] = enabled


class DataProtoConfig(metaclass=_DataProtoConfigMeta):
    """Process-wide DataProto settings: ``DataProtoConfig.auto_padding = True``."""


@dataclass
class DataProtoItem:
    """One row of a DataProto (``data[i]``): the batch row, the non-tensor items, the meta_info."""

    batch: TensorDictBase | None = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


def _index_pair(idxs: Any) -> tuple[torch.Tensor, np.ndarray]:
    """The same row selection as a torch index and a numpy index."""
    if isinstance(idxs, list):
        idxs = torch.tensor(idxs)
        if idxs.dtype != torch.bool:
            idxs = idxs.long()
    if isinstance(idxs, np.ndarray):
        return torch.from_numpy(idxs), idxs
    if isinstance(idxs, torch.Tensor):
        return idxs, idxs.detach().cpu().numpy()
    raise TypeError(f"rows are selected by a list, numpy array or tensor of indices, got {type(idxs).__name__}")


def _split_sizes(n: int, chunks: int) -> list[int]:
    """``chunks`` sizes adding up to ``n``, the first ``n % chunks`` one larger."""
    return [n // chunks + (1 if i < n % chunks else 0) for i in range(chunks)]


@dataclass
class DataProto:
    """A batch of rows: ``batch`` (TensorDict), ``non_tensor_batch`` (numpy arrays) and
    ``meta_info`` (dict). See the module docstring for the contract."""

    batch: TensorDictBase | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.non_tensor_batch is None:
            self.non_tensor_batch = {}
        if self.meta_info is None:
            self.meta_info = {}
        self.check_consistency()

    def __getstate__(self) -> dict[str, Any]:
        # A slice's tensors view the whole batch's storage, which torch would pickle
        # in full: send only this DataProto's rows.
        state = dict(self.__dict__)
        if self.batch is not None:
            state["batch"] = compact_tensordict(self.batch)
        return state

    # -- construction -------------------------------------------------------------
    def check_consistency(self) -> None:
        """Raise :class:`DataProtoError` unless the batch has one batch dimension, every
        non-tensor value is a numpy array, and all of them have the same number of rows."""
        if self.batch is not None:
            if not isinstance(self.batch, TensorDictBase):
                raise DataProtoError(f"batch must be a TensorDict, got {type(self.batch).__name__}")
            if len(self.batch.batch_size) != 1:
                raise DataProtoError(
                    f"batch must have exactly one batch dimension, got batch_size={tuple(self.batch.batch_size)}"
                )
        if not isinstance(self.meta_info, dict):
            raise DataProtoError(f"meta_info must be a dict, got {type(self.meta_info).__name__}")
        rows = None if self.batch is None else int(self.batch.batch_size[0])
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                raise DataProtoError(f"non_tensor_batch[{key!r}] must be a numpy array, got {type(value).__name__}")
            if value.ndim == 0:
                raise DataProtoError(f"non_tensor_batch[{key!r}] needs a row axis, got a 0-d array")
            if rows is None:
                rows = value.shape[0]
            elif value.shape[0] != rows:
                raise DataProtoError(f"non_tensor_batch[{key!r}] has {value.shape[0]} rows, the batch has {rows}")

    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict[str, Any] | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> DataProto:
        """A DataProto from named tensors (sharing their first ``num_batch_dims``
        dimensions), non-tensor values (lists become ``dtype=object`` arrays) and meta_info.
        ``auto_padding=True`` turns auto padding on for this DataProto."""
        if not isinstance(num_batch_dims, int) or num_batch_dims <= 0:
            raise DataProtoError(f"num_batch_dims must be a positive integer, got {num_batch_dims!r}")
        tensors = dict(tensors or {})
        if non_tensors is not None and num_batch_dims != 1:
            raise DataProtoError("non_tensors need num_batch_dims=1")
        batch_size = None
        first = None
        for key, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise DataProtoError(f"tensors[{key!r}] must be a torch.Tensor, got {type(tensor).__name__}")
            shape = tuple(tensor.shape[:num_batch_dims])
            if len(shape) < num_batch_dims:
                raise DataProtoError(f"tensors[{key!r}] has {tensor.dim()} dims, fewer than num_batch_dims")
            if batch_size is None:
                batch_size, first = shape, key
            elif shape != batch_size:
                raise DataProtoError(
                    f"tensors do not share their batch dims: {first!r} has {batch_size}, {key!r} has {shape}"
                )
        non_tensor_batch = {
            key: value if isinstance(value, np.ndarray) else np.array(value, dtype=object)
            for key, value in (non_tensors or {}).items()
        }
        meta = dict(meta_info or {})
        if auto_padding:
            meta[DataProtoConfig.auto_padding_key] = True
        batch = TensorDict(tensors, batch_size=list(batch_size)) if tensors else None
        return cls(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=meta)

    @classmethod
    def from_single_dict(
        cls, data: dict[str, Any], meta_info: dict[str, Any] | None = None, auto_padding: bool = False
    ) -> DataProto:
        """A DataProto from one dict: torch tensors go to ``batch``, numpy arrays to
        ``non_tensor_batch``; anything else is a :class:`DataProtoError`."""
        tensors, non_tensors = {}, {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, np.ndarray):
                non_tensors[key] = value
            else:
                raise DataProtoError(
                    f"from_single_dict takes torch tensors and numpy arrays; {key!r} is a {type(value).__name__}"
                )
        return cls.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info, auto_padding=auto_padding)

    def to_tensordict(self) -> TensorDictBase:
        """This DataProto as one batch TensorDict (non-tensor columns as object columns,
        meta_info as metadata); :meth:`from_tensordict` reverses it."""
        return protocol_ops.dataproto_to_tensordict(self)

    @classmethod
    def from_tensordict(cls, tensor_dict: TensorDictBase, meta_info: dict[str, Any] | None = None) -> DataProto:
        """The DataProto a batch TensorDict holds (tensors, object columns, metadata)."""
        return cls(*protocol_ops.dataproto_parts_from_tensordict(tensor_dict, meta_info))

    # -- size and rows ------------------------------------------------------------
    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        for value in self.non_tensor_batch.values():
            return int(value.shape[0])
        return 0

    def __getitem__(self, item: Any) -> DataProto | DataProtoItem:
        """``data[i]``: a :class:`DataProtoItem`; ``data[a:b:c]``: a DataProto slice;
        ``data[list | ndarray | tensor]``: the DataProto of those rows (indices or a mask)."""
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (list, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        if isinstance(item, (int, np.integer)):
            batch = self.batch[int(item)] if self.batch is not None else None
            items = {key: value[item] for key, value in self.non_tensor_batch.items()}
            return DataProtoItem(batch=batch, non_tensor_batch=items, meta_info=self.meta_info)
        raise TypeError(f"a DataProto is indexed by an int, a slice or indices, got {type(item).__name__}")

    def _rows(self, batch: TensorDictBase | None, non_tensor: dict[str, np.ndarray]) -> DataProto:
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=self.meta_info)

    def select_idxs(self, idxs: Any) -> DataProto:
        """The rows at ``idxs`` (a list, numpy array or tensor of indices, or a bool mask)."""
        index, index_np = _index_pair(idxs)
        rows = int(index_np.sum()) if index_np.dtype == bool else int(index_np.shape[0])
        batch = None
        if self.batch is not None:
            selected = {key: value[index] for key, value in self.batch.items()}
            batch = TensorDict(selected, batch_size=[rows], device=self.batch.device)
        return self._rows(batch, {key: value[index_np] for key, value in self.non_tensor_batch.items()})

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """Rows ``start:end:step`` as a DataProto."""
        rows = slice(start, end, step)
        batch = self.batch[rows] if self.batch is not None else None
        return self._rows(batch, {key: value[rows] for key, value in self.non_tensor_batch.items()})

    def chunk(self, chunks: int) -> list[DataProto]:
        """``chunks`` consecutive pieces along the rows, each with this meta_info. The
        length must divide unless auto padding is on (then the first pieces are one row
        longer)."""
        if not isinstance(chunks, int) or chunks <= 0:
            raise DataProtoError(f"chunks must be a positive integer, got {chunks!r}")
        n = len(self)
        if n % chunks and not self.is_padding_enabled():
            raise DataProtoError(f"a DataProto of {n} rows does not split into {chunks} equal chunks")
        bounds = np.cumsum([0, *_split_sizes(n, chunks)]).tolist()
        return [self.slice(bounds[i], bounds[i + 1]) for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Pieces of ``split_size`` rows (the last one shorter when the length does not divide)."""
        if not isinstance(split_size, int) or split_size <= 0:
            raise DataProtoError(f"split_size must be a positive integer, got {split_size!r}")
        return [self.slice(start, start + split_size) for start in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: list[DataProto]) -> DataProto:
        """The rows of every DataProto in ``data``, in order, with the first one's meta_info."""
        if not data:
            raise DataProtoError("concat needs at least one DataProto")
        has_batch = {d.batch is not None for d in data}
        if len(has_batch) > 1:
            raise DataProtoError("concat: some DataProtos have a tensor batch and some do not")
        keys = set(data[0].non_tensor_batch)
        for index, d in enumerate(data):
            if set(d.non_tensor_batch) != keys:
                raise DataProtoError(
                    f"concat: item {index} has non-tensor keys {sorted(d.non_tensor_batch)}, the first {sorted(keys)}"
                )
        batch = torch.cat([d.batch for d in data], dim=0) if has_batch == {True} else None
        non_tensor = {key: np.concatenate([d.non_tensor_batch[key] for d in data], axis=0) for key in keys}
        return type(data[0])(batch=batch, non_tensor_batch=non_tensor, meta_info=data[0].meta_info)

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Every row ``repeat_times`` times: each row's copies together (``interleave``),
        or the whole batch after itself."""
        if not isinstance(repeat_times, int) or repeat_times <= 0:
            raise DataProtoError(f"repeat_times must be a positive integer, got {repeat_times!r}")
        n = len(self)
        order = torch.arange(n).repeat_interleave(repeat_times) if interleave else torch.arange(n).repeat(repeat_times)
        return self.select_idxs(order)

    def sample_level_repeat(self, repeat_times: Any) -> DataProto:
        """Row ``i`` repeated ``repeat_times[i]`` times, in order (a list, tuple, array or tensor)."""
        counts = torch.as_tensor(list(repeat_times) if isinstance(repeat_times, tuple) else repeat_times)
        if counts.dim() != 1 or counts.numel() != len(self):
            raise DataProtoError(f"repeat_times needs one count per row ({len(self)}), got shape {tuple(counts.shape)}")
        if (counts < 0).any():
            raise DataProtoError("repeat_times must not be negative")
        return self.select_idxs(torch.arange(len(self)).repeat_interleave(counts.long()))

    def unfold_column_chunks(self, n_split: int, split_keys: list[str] | None = None) -> DataProto:
        """Cut the second dimension of the ``split_keys`` values into ``n_split`` pieces
        and lay them out as rows (row ``i`` becomes rows ``i*n_split .. i*n_split+n_split-1``);
        every other value repeats each row ``n_split`` times to match."""
        split_keys = set(split_keys or [])

        def unfold(key: str, value: Any, repeat: Any) -> Any:
            if key not in split_keys:
                return repeat(value)
            if value.ndim < 2 or value.shape[1] % n_split:
                raise DataProtoError(f"{key!r} with shape {tuple(value.shape)} does not split into {n_split} columns")
            return value.reshape(value.shape[0] * n_split, value.shape[1] // n_split, *value.shape[2:])

        batch = None
        if self.batch is not None:
            tensors = {
                key: unfold(key, value, lambda v: v.repeat_interleave(n_split, dim=0))
                for key, value in self.batch.items()
            }
            batch = TensorDict(tensors, batch_size=[len(self) * n_split], device=self.batch.device)
        non_tensor = {
            key: unfold(key, value, lambda v: np.repeat(v, n_split, axis=0))
            for key, value in self.non_tensor_batch.items()
        }
        return self._rows(batch, non_tensor)

    # -- in-place changes (as verl) -----------------------------------------------
    def to(self, device: Any) -> DataProto:
        """Move the tensor batch to ``device``; returns this DataProto."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def reorder(self, indices: Any) -> None:
        """Put the rows in the order ``indices`` gives (in place)."""
        index, index_np = _index_pair(indices)
        if self.batch is not None:
            self.batch = self.batch[index]
        self.non_tensor_batch = {key: value[index_np] for key, value in self.non_tensor_batch.items()}

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append ``padding_size`` copies of the last row (of the first with
        ``padding_candidate="first"``), in place."""
        if padding_size == 0:
            return
        if padding_size < 0 or len(self) == 0:
            raise DataProtoError(f"cannot pad a DataProto of {len(self)} rows by {padding_size}")
        row = 0 if padding_candidate == "first" else len(self) - 1
        padded = DataProto.concat([self, self.select_idxs([row]).repeat(padding_size)])
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

    def is_padding_enabled(self) -> bool:
        """Whether dispatch may pad this DataProto (its own flag or ``DataProtoConfig``)."""
        return bool(self.meta_info.get(DataProtoConfig.auto_padding_key, False)) or DataProtoConfig.auto_padding

    def rename(self, old_keys: str | list[str] | None = None, new_keys: str | list[str] | None = None) -> DataProto:
        """Rename tensor keys ``old_keys[i]`` to ``new_keys[i]`` (in place); returns this DataProto."""
        old = [old_keys] if isinstance(old_keys, str) else list(old_keys or [])
        new = [new_keys] if isinstance(new_keys, str) else list(new_keys or [])
        if len(old) != len(new):
            raise DataProtoError(f"rename needs as many new keys as old ones, got {len(new)} and {len(old)}")
        if old and self.batch is None:
            raise DataProtoError("rename: this DataProto has no tensor batch")
        for before, after in zip(old, new, strict=True):
            if before not in self.batch.keys():
                raise DataProtoError(f"rename: no tensor {before!r}; have {sorted(self.batch.keys())}")
            self.batch.rename_key_(before, after)
        return self

    def union(self, other: DataProto) -> DataProto:
        """Add ``other``'s tensors, arrays and meta_info (in place); keys in both must
        hold equal values, and the batches the same number of rows. Returns this DataProto."""
        if self.batch is None:
            self.batch = other.batch
        elif other.batch is not None:
            self.batch = union_tensor_dict(self.batch, other.batch)
        self.non_tensor_batch = union_numpy_dict(self.non_tensor_batch, other.non_tensor_batch)
        self.meta_info = union_two_dict(self.meta_info, other.meta_info)
        self.check_consistency()
        return self

    # -- new DataProtos from keys -------------------------------------------------
    def select(
        self,
        batch_keys: list[str] | None = None,
        non_tensor_batch_keys: list[str] | None = None,
        meta_info_keys: list[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A DataProto of the named keys (all of a part when its keys are None); tensors
        are shared, the non-tensor and meta parts copied deeply with ``deepcopy``."""
        batch = self.batch
        if batch_keys is not None:
            missing = [k for k in batch_keys if self.batch is None or k not in self.batch.keys()]
            if missing:
                raise DataProtoError(f"select: no tensor {missing}")
            batch = self.batch.select(*batch_keys)
        non_tensor = self.non_tensor_batch
        if non_tensor_batch_keys is not None:
            non_tensor = {k: v for k, v in non_tensor.items() if k in non_tensor_batch_keys}
        meta = self.meta_info
        if meta_info_keys is not None:
            meta = {k: v for k, v in meta.items() if k in meta_info_keys}
        if deepcopy:
            non_tensor, meta = copy.deepcopy(non_tensor), copy.deepcopy(meta)
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def pop(
        self,
        batch_keys: list[str] | None = None,
        non_tensor_batch_keys: list[str] | None = None,
        meta_info_keys: list[str] | None = None,
    ) -> DataProto:
        """Remove the named keys from this DataProto and return them as a new one."""

        def take(part: Any, keys: list[str] | None, what: str) -> dict[str, Any]:
            keys = list(keys or [])
            missing = [k for k in keys if part is None or k not in part.keys()]
            if missing:
                raise DataProtoError(f"pop: no {what} {missing}")
            return {k: part.pop(k) for k in keys}

        tensors = take(self.batch, batch_keys, "tensor")
        non_tensors = take(self.non_tensor_batch, non_tensor_batch_keys, "non-tensor")
        meta = take(self.meta_info, meta_info_keys, "meta_info key")
        return type(self).from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)

    # -- iteration, persistence, size ---------------------------------------------
    def make_iterator(
        self, mini_batch_size: int, epochs: int, seed: int | None = None, dataloader_kwargs: dict | None = None
    ) -> Iterator[DataProto]:
        """Mini-batches of ``mini_batch_size`` rows, ``epochs`` times over, each with this
        meta_info. ``dataloader_kwargs`` go to the torch DataLoader that draws the row
        indices (``shuffle=True`` with ``seed`` gives a repeatable order)."""
        if not isinstance(mini_batch_size, int) or mini_batch_size <= 0 or len(self) % mini_batch_size:
            raise DataProtoError(f"mini_batch_size {mini_batch_size!r} must divide the {len(self)} rows")
        if dataloader_kwargs is not None and not isinstance(dataloader_kwargs, dict):
            raise DataProtoError(f"dataloader_kwargs must be a dict, got {type(dataloader_kwargs).__name__}")
        from torch.utils.data import DataLoader

        generator = None
        if seed is not None:
            generator = torch.Generator()
            generator.manual_seed(seed)
        loader = DataLoader(
            range(len(self)), batch_size=mini_batch_size, generator=generator, **(dataloader_kwargs or {})
        )

        def batches() -> Iterator[DataProto]:
            for _ in range(epochs):
                for rows in loader:
                    piece = self.select_idxs(rows)
                    piece.meta_info = self.meta_info
                    yield piece

        return batches()

    def save_to_disk(self, filepath: str) -> None:
        """Write this DataProto to ``filepath`` (torch's pickle format)."""
        torch.save(self, filepath)

    @staticmethod
    def load_from_disk(filepath: str) -> DataProto:
        """Read a DataProto written by :meth:`save_to_disk`. It unpickles: only load files
        you wrote."""
        return torch.load(filepath, weights_only=False)

    def nbytes(self) -> tuple[int, int]:
        """Bytes held by the tensors and by the non-tensor arrays."""
        tensor_bytes = sum(t.numel() * t.element_size() for t in self.batch.values()) if self.batch is not None else 0
        return tensor_bytes, sum(v.nbytes for v in self.non_tensor_batch.values())

    def print_size(self, prefix: str = "") -> None:
        tensors, arrays = self.nbytes()
        message = f"Size of tensordict: {tensors / 1024**3} GB, size of non_tensor_batch: {arrays / 1024**3} GB"
        print(f"{prefix}, {message}" if prefix else message)

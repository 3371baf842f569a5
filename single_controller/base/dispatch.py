"""The dispatch table: for each :class:`Dispatch` mode, how a call is split and collected.

Every function here is pure. ``dispatch_fn(group, *args, **kwargs)`` returns
``(args, kwargs)`` in which every value is a list with one item per rank (the
group's executor sends item ``r`` to rank ``r``); ``collect_fn(group, outputs)``
turns the per-rank outputs (a list indexed by rank) into the caller's result.
``group`` is anything that reports its layout: ``world_size`` always, plus
``get_megatron_rank_info(rank)`` and ``tp_size``/``dp_size``/``pp_size``/``cp_size``
for the MEGATRON modes and ``micro_dp_group_size`` for ALL_MICRO_DP. A batch (the
PROTO modes) is a :class:`~single_controller.protocol.DataProto` or a TensorDict.
Built-in dispatch functions never modify the caller's arguments; they raise
:class:`DispatchError` (a ``ValueError``) naming the argument that does not fit.

Looking modes up, adding and replacing them is :mod:`single_controller.base.dispatch_registry`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from single_controller.base.modes import Dispatch, Mode
from single_controller.batch import (
    PADDING_KEY,
    batch_len,
    chunk_batch,
    concat_batches,
    is_batch,
    may_pad,
    pad_batch,
)

# PADDING_KEY (from single_controller.batch): the reserved key a dispatch function may
# add to its returned kwargs, the number of rows it padded, which the group strips from
# the collected batch. verl's name for it, so verl's dispatch functions are honoured too.

DispatchFn = Callable[..., tuple[tuple, dict]]
CollectFn = Callable[[Any, list], Any]


class DispatchError(ValueError):
    """An argument does not fit the dispatch mode (wrong type or length)."""


_SPEC_KEYS = ("dispatch_fn", "collect_fn")


@dataclass(frozen=True, eq=False)
class DispatchSpec(Mapping):
    """A dispatch mode's two functions.

    ``collect_needs_values`` is False when ``collect_fn`` only selects and reorders
    outputs, so it can run on Ray ObjectRefs for a non-blocking call; True when it
    combines values (concatenation) and must run where the values are.

    It reads as verl's registry entry too: a mapping with exactly the keys
    ``dispatch_fn`` and ``collect_fn``, equal to a dict holding the same two functions.
    """

    dispatch_fn: DispatchFn
    collect_fn: CollectFn
    collect_needs_values: bool = False

    @classmethod
    def of(cls, value: Mapping) -> DispatchSpec:
        """A spec from any mapping with callable ``dispatch_fn`` and ``collect_fn`` (a
        verl registry entry); the collect runs on values unless it is the identity.
        ``ValueError`` naming what is missing or not callable."""
        if isinstance(value, DispatchSpec):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"a dispatch mode entry is a mapping of dispatch_fn and collect_fn, got {value!r}")
        missing = [key for key in _SPEC_KEYS if key not in value]
        extra = sorted(set(value) - set(_SPEC_KEYS))
        if missing or extra:
            raise ValueError(
                "a custom dispatch mode is a dict with exactly 'dispatch_fn' and 'collect_fn'; "
                f"missing {missing}, unexpected {extra}"
            )
        if not callable(value["dispatch_fn"]) or not callable(value["collect_fn"]):
            raise ValueError("custom dispatch_fn and collect_fn must be callable")
        collect_fn = value["collect_fn"]
        return cls(value["dispatch_fn"], collect_fn, collect_needs_values=collect_fn is not collect_all_to_all)

    def __getitem__(self, key: str) -> Callable:
        if key not in _SPEC_KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_SPEC_KEYS)

    def __len__(self) -> int:
        return len(_SPEC_KEYS)


def _label(key: int | str) -> str:
    return f"positional argument {key}" if isinstance(key, int) else f"argument {key!r}"


def _map_args(
    args: tuple, kwargs: dict, fn: Callable[[str, Any], Any], first_index: int = 0
) -> tuple[tuple, dict]:
    new_args = tuple(fn(_label(i), value) for i, value in enumerate(args, start=first_index))
    new_kwargs = {key: fn(_label(key), value) for key, value in kwargs.items()}
    return new_args, new_kwargs


def _require_list(label: str, value: Any, length: int, unit: str) -> Sequence:
    if not isinstance(value, (list, tuple)):
        raise DispatchError(
            f"{label} must be a list with one item per {unit} ({length}), got {type(value).__name__}"
        )
    if len(value) != length:
        raise DispatchError(
            f"{label} must be a list with one item per {unit}: expected length {length}, got {len(value)}"
        )
    return value


def split_batches(
    args: tuple, kwargs: dict, chunks: int, mode: str, first_index: int = 0
) -> tuple[tuple, dict, int]:
    """Split every batch argument into ``chunks`` equal parts, padding it first when its
    length does not divide (a TensorDict always; a DataProto when its auto padding is
    on, as verl does). All batches must share one length."""
    lengths: dict[str, int] = {}

    def check(label: str, value: Any) -> Any:
        if not is_batch(value):
            raise DispatchError(
                f"{mode} expects a DataProto or TensorDict batch for {label}, got {type(value).__name__}"
            )
        lengths[label] = batch_len(value)
        return value

    _map_args(args, kwargs, check, first_index)
    if len(set(lengths.values())) > 1:
        raise DispatchError(f"{mode} needs batches of one length, got {lengths}")
    pads: list[int] = []

    def split(label: str, value: Any) -> list:
        padded, pad = pad_batch(value, chunks)
        if pad and not may_pad(value):
            raise DispatchError(
                f"{mode}: {label} has {batch_len(value)} rows, which do not split into {chunks} equal "
                "parts; set DataProtoConfig.auto_padding = True (or DataProto.from_dict(..., "
                "auto_padding=True)) to pad it"
            )
        pads.append(pad)
        return chunk_batch(padded, chunks)

    new_args, new_kwargs = _map_args(args, kwargs, split, first_index)
    return new_args, new_kwargs, (pads[0] if pads else 0)


def with_padding(args: tuple, kwargs: dict, pad: int) -> tuple[tuple, dict]:
    if pad:
        kwargs = {**kwargs, PADDING_KEY: pad}
    return args, kwargs


# -- broadcast and identity ------------------------------------------------------


def dispatch_one_to_all(group, *args, **kwargs) -> tuple[tuple, dict]:
    """Send every argument whole to every rank."""
    n = group.world_size
    return _map_args(args, kwargs, lambda _label, value: [value] * n)


def dispatch_all_to_all(group, *args, **kwargs) -> tuple[tuple, dict]:
    """Pass arguments through unchanged: the caller already wrote one item per rank (or
    the execute mode is RANK_ZERO and the arguments go to rank 0 as they are)."""
    return tuple(args), dict(kwargs)


def collect_all_to_all(group, output):
    """Return the outputs as they are: a list indexed by rank (or rank 0's value)."""
    return output


# -- data parallel ---------------------------------------------------------------


def dispatch_dp_compute(group, *args, **kwargs) -> tuple[tuple, dict]:
    """Every argument is a list with one item per rank; item ``r`` goes to rank ``r``."""
    n = group.world_size
    return _map_args(args, kwargs, lambda label, value: list(_require_list(label, value, n, "rank")))


def collect_dp_compute(group, output) -> list:
    """One output per rank, in rank order."""
    if len(output) != group.world_size:
        raise DispatchError(f"expected {group.world_size} outputs, got {len(output)}")
    return list(output)


def dispatch_dp_compute_proto(group, *args, **kwargs) -> tuple[tuple, dict]:
    """Every argument is a batch: pad it to a multiple of world_size, split it evenly."""
    new_args, new_kwargs, pad = split_batches(args, kwargs, group.world_size, "DP_COMPUTE_PROTO")
    return with_padding(new_args, new_kwargs, pad)


def collect_dp_compute_proto(group, output):
    """Concatenate the per-rank batches in rank order (the group then drops the padding)."""
    return concat_batches(collect_dp_compute(group, output))


def dispatch_dp_compute_proto_with_func(group, *args, **kwargs) -> tuple[tuple, dict]:
    """The first positional argument is a function, sent whole to every rank; every other
    argument is a batch, split as DP_COMPUTE_PROTO splits it (verl's
    ``Worker.execute_with_func_generator`` runs ``func(worker, *batches)`` on each rank)."""
    if not args or not callable(args[0]):
        raise DispatchError(
            "DP_COMPUTE_PROTO_WITH_FUNC takes a function as its first positional argument, then batches"
        )
    func, batches = args[0], args[1:]
    split_args, split_kwargs, pad = split_batches(
        batches, kwargs, group.world_size, "DP_COMPUTE_PROTO_WITH_FUNC", first_index=1
    )
    return with_padding(([func] * group.world_size, *split_args), split_kwargs, pad)


def dispatch_direct_rollout(group, *args, **kwargs):
    """DIRECT_ROLLOUT_METHOD methods are called on a rollout engine's own actors (verl's
    vLLM executor), never through a worker group."""
    raise DispatchError(
        "a DIRECT_ROLLOUT_METHOD method is called on the rollout's own actors, not through a worker group"
    )


# -- Megatron 3D layouts ---------------------------------------------------------


def _rank_infos(group, mode: str) -> list:
    getter = getattr(group, "get_megatron_rank_info", None)
    if getter is None:
        raise DispatchError(
            f"{mode} needs a group that reports its tp/pp/dp layout (get_megatron_rank_info), "
            f"got {type(group).__name__}"
        )
    return [getter(rank) for rank in range(group.world_size)]


def _cp_size(group) -> int:
    return int(getattr(group, "cp_size", 1) or 1)


def dispatch_megatron_compute(group, *args, **kwargs) -> tuple[tuple, dict]:
    """Every argument is a list with one item per dp rank; each rank gets its dp rank's item
    (so tp and pp ranks of one dp group see the same object)."""
    infos = _rank_infos(group, "MEGATRON_COMPUTE")
    dp = group.dp_size

    def per_rank(label: str, value: Any) -> list:
        items = _require_list(label, value, dp, "dp rank")
        return [items[info.dp_rank] for info in infos]

    return _map_args(args, kwargs, per_rank)


def collect_megatron_compute(group, output) -> list:
    """One output per dp rank, in dp order, taken from tp rank 0 of the last pp stage."""
    infos = _rank_infos(group, "MEGATRON_COMPUTE")
    last_pp = group.pp_size - 1
    chosen = [
        (info.dp_rank, output[rank])
        for rank, info in enumerate(infos)
        if info.tp_rank == 0 and info.pp_rank == last_pp and getattr(info, "cp_rank", 0) == 0
    ]
    return [value for _, value in sorted(chosen, key=lambda item: item[0])]


def dispatch_megatron_compute_proto(group, *args, **kwargs) -> tuple[tuple, dict]:
    """Every argument is a batch: pad to a multiple of dp_size, one chunk per dp rank."""
    split_args, split_kwargs, pad = split_batches(args, kwargs, group.dp_size, "MEGATRON_COMPUTE_PROTO")
    new_args, new_kwargs = dispatch_megatron_compute(group, *split_args, **split_kwargs)
    return with_padding(new_args, new_kwargs, pad)


def collect_megatron_compute_proto(group, output):
    """Concatenate the dp ranks' batches from :func:`collect_megatron_compute`."""
    return concat_batches(collect_megatron_compute(group, output))


def _pp_as_dp_index(info, group) -> int:
    dp_cp = getattr(info, "cp_rank", 0) * group.dp_size + info.dp_rank
    return dp_cp * group.pp_size + info.pp_rank


def dispatch_megatron_pp_as_dp(group, *args, **kwargs) -> tuple[tuple, dict]:
    """Treat (cp, dp, pp) as one data-parallel axis of size pp*dp*cp: item
    ``(cp*dp_size + dp_rank)*pp_size + pp_rank`` goes to that rank and its tp peers."""
    infos = _rank_infos(group, "MEGATRON_PP_AS_DP")
    n = group.pp_size * group.dp_size * _cp_size(group)

    def per_rank(label: str, value: Any) -> list:
        items = _require_list(label, value, n, "pp x dp rank")
        return [items[_pp_as_dp_index(info, group)] for info in infos]

    return _map_args(args, kwargs, per_rank)


def collect_megatron_pp_as_dp(group, output) -> list:
    """One output per (pp, dp) position from its tp rank 0, in the order dispatch used."""
    infos = _rank_infos(group, "MEGATRON_PP_AS_DP")
    chosen = [(_pp_as_dp_index(info, group), output[r]) for r, info in enumerate(infos) if info.tp_rank == 0]
    return [value for _, value in sorted(chosen, key=lambda item: item[0])]


def dispatch_megatron_pp_as_dp_proto(group, *args, **kwargs) -> tuple[tuple, dict]:
    """Batches padded and split into pp*dp*cp chunks, then as MEGATRON_PP_AS_DP."""
    n = group.pp_size * group.dp_size * _cp_size(group)
    split_args, split_kwargs, pad = split_batches(args, kwargs, n, "MEGATRON_PP_AS_DP_PROTO")
    new_args, new_kwargs = dispatch_megatron_pp_as_dp(group, *split_args, **split_kwargs)
    return with_padding(new_args, new_kwargs, pad)


def collect_megatron_pp_as_dp_proto(group, output):
    return concat_batches(collect_megatron_pp_as_dp(group, output))


def collect_megatron_pp_only(group, output) -> list:
    """One output per pp stage, in pp order, from tp rank 0 of dp rank 0 (weight names
    and shapes are the same across tp and dp, so one per stage suffices)."""
    infos = _rank_infos(group, "MEGATRON_PP_ONLY")
    chosen = [
        (info.pp_rank, output[rank])
        for rank, info in enumerate(infos)
        if info.tp_rank == 0 and info.dp_rank == 0 and getattr(info, "cp_rank", 0) == 0
    ]
    return [value for _, value in sorted(chosen, key=lambda item: item[0])]


# -- HybridEngine micro-dp -------------------------------------------------------


def _micro_dp(group) -> tuple[int, int]:
    size = int(getattr(group, "micro_dp_group_size", 1) or 1)
    if size <= 0 or group.world_size % size:
        raise DispatchError(f"micro_dp_group_size {size} does not divide world_size {group.world_size}")
    return size, group.world_size // size


def dispatch_all_micro_dp(group, *args, **kwargs) -> tuple[tuple, dict]:
    """Consecutive ranks form micro-dp groups of ``micro_dp_group_size``. A batch argument
    is padded and split into one chunk per micro-dp group; a list argument must have one
    item per micro-dp group. Every rank of a micro-dp group gets that group's item."""
    size, groups = _micro_dp(group)
    batch_lengths = {batch_len(v) for v in (*args, *kwargs.values()) if is_batch(v)}
    if len(batch_lengths) > 1:
        raise DispatchError(f"ALL_MICRO_DP needs batches of one length, got {sorted(batch_lengths)}")
    pads: list[int] = []

    def per_rank(label: str, value: Any) -> list:
        if is_batch(value):
            padded, pad = pad_batch(value, groups)
            pads.append(pad)
            items = chunk_batch(padded, groups)
        else:
            items = _require_list(label, value, groups, "micro-dp group")
        return [items[rank // size] for rank in range(group.world_size)]

    new_args, new_kwargs = _map_args(args, kwargs, per_rank)
    return with_padding(new_args, new_kwargs, pads[0] if pads else 0)


def collect_all_micro_dp(group, output):
    """Outputs of each micro-dp group's first rank (local rank 0), in group order;
    concatenated when they are batches."""
    size, _ = _micro_dp(group)
    chosen = [output[rank] for rank in range(0, group.world_size, size)]
    if chosen and all(is_batch(value) for value in chosen):
        return concat_batches(chosen)
    return chosen


#: The dispatch table, verl's ``DISPATCH_MODE_FN_REGISTRY``. Keys are :class:`Dispatch` modes.
DISPATCH_TABLE: dict[Mode, DispatchSpec] = {
    Dispatch.RANK_ZERO: DispatchSpec(dispatch_all_to_all, collect_all_to_all),
    Dispatch.ONE_TO_ALL: DispatchSpec(dispatch_one_to_all, collect_all_to_all),
    Dispatch.ALL_TO_ALL: DispatchSpec(dispatch_all_to_all, collect_all_to_all),
    Dispatch.DP_COMPUTE: DispatchSpec(dispatch_dp_compute, collect_dp_compute),
    Dispatch.DP_COMPUTE_PROTO: DispatchSpec(dispatch_dp_compute_proto, collect_dp_compute_proto, True),
    Dispatch.DP_COMPUTE_PROTO_WITH_FUNC: DispatchSpec(
        dispatch_dp_compute_proto_with_func, collect_dp_compute_proto, True
    ),
    Dispatch.DP_COMPUTE_METRIC: DispatchSpec(dispatch_dp_compute_proto, collect_dp_compute),
    Dispatch.MEGATRON_COMPUTE: DispatchSpec(dispatch_megatron_compute, collect_megatron_compute),
    Dispatch.MEGATRON_COMPUTE_PROTO: DispatchSpec(
        dispatch_megatron_compute_proto, collect_megatron_compute_proto, True
    ),
    Dispatch.MEGATRON_PP_AS_DP: DispatchSpec(dispatch_megatron_pp_as_dp, collect_megatron_pp_as_dp),
    Dispatch.MEGATRON_PP_AS_DP_PROTO: DispatchSpec(
        dispatch_megatron_pp_as_dp_proto, collect_megatron_pp_as_dp_proto, True
    ),
    Dispatch.MEGATRON_PP_ONLY: DispatchSpec(dispatch_one_to_all, collect_megatron_pp_only),
    Dispatch.ALL_MICRO_DP: DispatchSpec(dispatch_all_micro_dp, collect_all_micro_dp, True),
    Dispatch.DIRECT_ROLLOUT_METHOD: DispatchSpec(dispatch_direct_rollout, dispatch_direct_rollout),
}

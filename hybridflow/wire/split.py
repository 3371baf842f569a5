"""Cutting a call into pieces along dim 0 (a job's ``?split=N``), lazily and bounded.

The argument split is the first positional one, or else the one keyword argument, that is
a list of tensors (one per dp rank, as MEGATRON_COMPUTE takes). :func:`split_call` checks
the whole request (pieces times tensors within ``limits.max_split_views``, every tensor at
least ``pieces`` rows) before it makes any view; a piece's views are made when it is read.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.limits import DEFAULT_LIMITS, WireLimits

__all__ = ["SplitCall", "split_call"]

Call = tuple[list, dict]


def _is_tensor_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, torch.Tensor) for t in value)


class SplitCall(Sequence[Call]):
    """The ``(args, kwargs)`` of each piece, made on access: piece ``i`` of a tensor of
    ``n`` rows is rows ``[i * q + min(i, r), ...)`` of ``q + (i < r)`` rows, where
    ``q, r = divmod(n, pieces)`` (``torch.tensor_split``'s cut)."""

    def __init__(self, args: list, kwargs: dict, pieces: int, key: int | str | None) -> None:
        self._args, self._kwargs, self._pieces, self._key = args, kwargs, pieces, key

    def __len__(self) -> int:
        return self._pieces

    def __getitem__(self, index: int) -> Call:  # type: ignore[override]
        if not -self._pieces <= index < self._pieces:
            raise IndexError(index)
        index %= self._pieces
        if self._key is None:
            return self._args, self._kwargs
        whole = self._args[0] if self._key == 0 else self._kwargs[self._key]
        piece = [_rows(tensor, index, self._pieces) for tensor in whole]
        if self._key == 0:
            return [piece, *self._args[1:]], self._kwargs
        return self._args, {**self._kwargs, self._key: piece}

    def __iter__(self) -> Iterator[Call]:
        return (self[i] for i in range(self._pieces))


def _rows(tensor: torch.Tensor, index: int, pieces: int) -> torch.Tensor:
    quotient, remainder = divmod(tensor.shape[0], pieces)
    return tensor.narrow(0, index * quotient + min(index, remainder), quotient + (index < remainder))


def split_call(args: list, kwargs: dict, pieces: int, limits: WireLimits = DEFAULT_LIMITS) -> SplitCall:
    """The call's arguments for each piece (a lazy sequence), after checking that the
    split fits; a split that does not is a :class:`WireError` naming why. ``pieces`` of 1
    (or less) is the call as it is."""
    if isinstance(pieces, bool) or not isinstance(pieces, int):
        raise WireError(f"split must be an integer, got {pieces!r:.40}")
    if pieces <= 1:
        return SplitCall(args, kwargs, 1, None)
    if args and _is_tensor_list(args[0]):
        key: int | str = 0
        target = args[0]
    else:
        candidates = [k for k, v in kwargs.items() if _is_tensor_list(v)]
        if args or len(candidates) != 1:
            raise WireError("split needs one argument that is a list of tensors (one per dp rank)")
        key, target = candidates[0], kwargs[candidates[0]]
    views = pieces * len(target)
    if views > limits.max_split_views:
        raise WireError(
            f"split {pieces} of {len(target)} tensors would make {views} pieces, over the limit of "
            f"{limits.max_split_views} (limits.max_split_views)"
        )
    for tensor in target:
        if tensor.dim() == 0 or tensor.shape[0] < pieces:
            raise WireError(f"cannot split a tensor of shape {list(tensor.shape)} into {pieces} pieces")
    return SplitCall(args, kwargs, pieces, key)

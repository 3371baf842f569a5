"""Rows of jagged tensors (``torch.nested`` with ``layout=torch.jagged``: rows of different
lengths) taken apart, sliced, selected and joined through their values and offsets.

A jagged tensor is its rows' elements joined in one ``values`` tensor plus ``offsets``,
where each row starts. Every operation here works on those two tensors with vectorised
torch calls, so it costs time and memory in proportion to the bytes it moves, never a
Python tensor per row (``unbind`` makes one per row: seconds for a few hundred thousand
rows). Results own their storage (a part pickles only its own rows). Bad input raises
``ValueError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "concat_jagged",
    "is_jagged",
    "jagged_from_parts",
    "jagged_nbytes",
    "jagged_parts",
    "select_jagged",
    "slice_jagged",
    "split_jagged",
]


def is_jagged(value: Any) -> bool:
    """Whether ``value`` is a nested tensor (rows of different lengths)."""
    return isinstance(value, torch.Tensor) and value.is_nested


def _require_jagged(tensor: Any, what: str) -> torch.Tensor:
    if not is_jagged(tensor) or tensor.layout != torch.jagged:
        raise ValueError(f"{what} takes a nested tensor with layout=torch.jagged")
    return tensor


def _gather(values: torch.Tensor, dim: int, starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``values``' runs ``[starts[i], starts[i] + lengths[i])`` along ``dim``, joined in order:
    one index per element moved, built without a Python loop."""
    total = int(lengths.sum()) if lengths.numel() else 0
    ends = torch.cumsum(lengths, 0)
    # position of each output element = its run's start + its place within the run
    shift = torch.repeat_interleave(starts - (ends - lengths), lengths, output_size=total)
    return values.index_select(dim, torch.arange(total, dtype=torch.int64, device=values.device) + shift)


def _offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])


def jagged_parts(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A jagged tensor as plain tensors, e.g. to send over a wire: ``(values, offsets,
    ragged_dim)``. ``values`` holds every row's elements, the rows joined along dimension
    ``ragged_dim - 1`` of a row; ``offsets`` (int64, one more than the rows) is where each
    row starts in it. :func:`jagged_from_parts` reverses it."""
    tensor = _require_jagged(tensor, "jagged_parts")
    values, offsets, dim = tensor.values(), tensor.offsets().to(torch.int64), int(tensor._ragged_idx)
    lengths = tensor.lengths()
    if lengths is not None:  # rows with gaps between them: pack them
        lengths = lengths.to(torch.int64)
        values = _gather(values, dim - 1, offsets[:-1], lengths)
        offsets = _offsets_of(lengths)
    return values, offsets, dim


def jagged_from_parts(values: torch.Tensor, offsets: torch.Tensor, ragged_dim: int = 1) -> torch.Tensor:
    """The jagged tensor :func:`jagged_parts` took apart, as a view of ``values`` (no copy
    of the elements; work in proportion to the rows). ``ValueError`` unless the offsets
    are one-dimensional integers that start at 0, never decrease and end at the length
    of ``values`` along the ragged dimension."""
    if isinstance(ragged_dim, bool) or not isinstance(ragged_dim, int) or not 1 <= ragged_dim <= values.dim():
        raise ValueError(f"ragged_dim must be between 1 and {values.dim()} for values of shape {tuple(values.shape)}")
    if offsets.dim() != 1 or offsets.numel() < 2 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offsets must be a 1-D integer tensor of rows + 1 entries, got {offsets.dtype} "
                         f"of shape {tuple(offsets.shape)}")
    offsets = offsets.to(torch.int64)
    total = values.shape[ragged_dim - 1]
    if offsets[0] != 0 or offsets[-1] != total or bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError(f"offsets must start at 0, never decrease and end at {total} (the values' ragged length)")
    return torch.nested.nested_tensor_from_jagged(values, offsets, jagged_dim=ragged_dim)


def _njt(values: torch.Tensor, offsets: torch.Tensor, ragged_dim: int) -> torch.Tensor:
    """A jagged tensor from parts this module made (so known to fit: no check)."""
    return torch.nested.nested_tensor_from_jagged(values, offsets, jagged_dim=ragged_dim)


def jagged_nbytes(tensor: torch.Tensor) -> int:
    """Bytes a jagged tensor holds: its values' and its offsets' (and lengths', if any)."""
    tensor = _require_jagged(tensor, "jagged_nbytes")
    parts = [tensor.values(), tensor.offsets()]
    if tensor.lengths() is not None:
        parts.append(tensor.lengths())
    return sum(part.numel() * part.element_size() for part in parts)


def slice_jagged(tensor: torch.Tensor, start: int, stop: int, copy: bool = True) -> torch.Tensor:
    """Rows ``[start, stop)`` as a jagged tensor: with their own copy of those rows' values
    (what a part sent elsewhere needs), or with ``copy=False`` a view of them where it can."""
    values, offsets, dim = jagged_parts(_require_jagged(tensor, "slice_jagged"))
    rows = offsets.numel() - 1
    if not 0 <= start < stop <= rows:
        raise ValueError(f"rows [{start}, {stop}) are not a non-empty part of a tensor of {rows} rows")
    first, last = int(offsets[start]), int(offsets[stop])
    part = values.narrow(dim - 1, first, last - first)
    part_offsets = offsets[start : stop + 1]
    if copy:
        part = part.clone(memory_format=torch.contiguous_format)
    if copy or first:
        part_offsets = part_offsets - first
    return _njt(part, part_offsets, dim)


def split_jagged(tensor: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Consecutive parts of ``sizes`` rows each (every size positive, together every row)."""
    rows = tensor.size(0) if is_jagged(tensor) else None
    if any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in sizes) or sum(sizes) != rows:
        raise ValueError(f"sizes {list(sizes)[:8]} must be positive and add up to the tensor's {rows} rows")
    parts, start = [], 0
    for size in sizes:
        parts.append(slice_jagged(tensor, start, start + size))
        start += size
    return parts


def select_jagged(tensor: torch.Tensor, index: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """The rows ``index`` names (one or more, repeats allowed), in that order."""
    values, offsets, dim = jagged_parts(_require_jagged(tensor, "select_jagged"))
    index = torch.as_tensor(index, dtype=torch.int64)
    rows = offsets.numel() - 1
    if index.dim() != 1 or not index.numel():
        raise ValueError(f"index must be a non-empty 1-D list of rows, got shape {tuple(index.shape)}")
    if bool(((index < 0) | (index >= rows)).any()):
        raise ValueError(f"index names rows outside [0, {rows})")
    first = int(index[0])
    if index.numel() == 1 or bool((index[1:] - index[:-1] == 1).all()):  # a run of rows: one slice
        return slice_jagged(tensor, first, first + index.numel())
    starts = offsets[index]
    lengths = offsets[index + 1] - starts
    return _njt(_gather(values, dim - 1, starts, lengths), _offsets_of(lengths), dim)


def concat_jagged(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One jagged tensor holding the rows of ``tensors`` (jagged tensors of two or more
    dimensions, alike but for their rows' lengths), in order."""
    if not tensors:
        raise ValueError("nothing to concatenate")
    parts = []
    for i, tensor in enumerate(tensors):
        if not is_jagged(tensor) or tensor.layout != torch.jagged:
            raise ValueError(f"tensor {i} is not a nested tensor with layout=torch.jagged")
        if tensor.dim() < 2:
            raise ValueError(f"tensor {i}: a nested tensor has two or more dimensions, got shape {tuple(tensor.shape)}")
        parts.append(jagged_parts(tensor))
    dims = sorted({dim for _, _, dim in parts})
    if len(dims) > 1:
        raise ValueError(f"the tensors are ragged along different dimensions: {dims}")
    dim = dims[0]
    try:
        values = torch.cat([part_values for part_values, _, _ in parts], dim=dim - 1)
    except RuntimeError as exc:
        raise ValueError(f"the tensors' rows differ in more than their ragged length: {exc}") from None
    offsets = torch.empty(sum(part_offsets.numel() - 1 for _, part_offsets, _ in parts) + 1, dtype=torch.int64)
    offsets[0], row, shift = 0, 1, 0
    for _, part_offsets, _ in parts:  # each part's row ends, moved past the parts before it: one pass
        rows = part_offsets.numel() - 1
        torch.add(part_offsets[1:], shift, out=offsets[row : row + rows])
        row, shift = row + rows, shift + int(part_offsets[-1])
    return _njt(values, offsets, dim)

"""A per-row column of Python objects in a batch TensorDict, at a cost in proportion to
its objects.

tensordict keeps such a column as a ``NonTensorStack``: one ``NonTensorData`` (a
tensorclass) per row, several microseconds each to build, as much again to pickle and to
unpickle: seconds for a column of a hundred thousand small values, where a numpy object
array of them (a DataProto's column) pickles in milliseconds. An :class:`ObjectColumn` is
a ``NonTensorStack`` that keeps its values in one list and builds those members only when
something asks for them (tensordict's own indexing, setting an item, locking...): from
then on it is a ``NonTensorStack`` like any other. Until then, its length, ``tolist()``,
pickling and the helpers below (slicing, selecting and joining rows, what dispatch does)
work on the list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack

__all__ = ["ObjectColumn", "column_values", "concat_columns", "select_column", "slice_column"]

#: Values a NonTensorStack wraps in a NonTensorData itself (tensordict's own fast path).
_PLAIN = (str, int, float, bool, bytes, type(None))


class ObjectColumn(NonTensorStack):
    """A ``NonTensorStack`` whose members are built from its values on first use. Build
    one with :meth:`of`."""

    @classmethod
    def of(cls, values: Sequence[Any]) -> ObjectColumn:
        """A column holding ``values``, one per row (kept as a list, not copied item by item)."""
        items = list(values)
        column = cls.__new__(cls)
        # what tensordict's flat stack sets up, less the members
        column.__dict__.update(
            _is_locked=None, stack_dim=0, _batch_size=torch.Size([len(items)]), _hook_out=None, _hook_in=None,
            _device=None, _members=None, _column_values=items,
        )
        return column

    @property
    def tensordicts(self) -> list[Any]:
        members = self.__dict__.get("_members")
        if members is None:
            values = self.__dict__.get("_column_values")
            if values is None:
                raise AttributeError("tensordicts")
            # the values move into the members: from here on those are the column's truth
            wrapped = [value if type(value) in _PLAIN else NonTensorData(data=value) for value in values]
            members = NonTensorStack(*wrapped).tensordicts if wrapped else []
            self.__dict__.update(_members=members, _column_values=None)
        return members

    @tensordicts.setter
    def tensordicts(self, members: list[Any]) -> None:
        self.__dict__.update(_members=members, _column_values=None)

    @property
    def device(self) -> torch.device | None:
        if self.__dict__.get("_column_values") is not None:
            return None  # Python objects live on no device
        return NonTensorStack.device.fget(self)

    @device.setter
    def device(self, value: Any) -> None:
        NonTensorStack.device.fset(self, value)

    def _has_names(self) -> bool:
        if self.__dict__.get("_column_values") is not None:
            return False
        return super()._has_names()

    def tolist(self, **kwargs: Any) -> list[Any]:
        values = self.__dict__.get("_column_values")
        if values is not None and not kwargs.get("as_linked_list"):
            return list(values)
        return super().tolist(**kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        values = self.__dict__.get("_column_values")
        if values is not None:  # the list, not a tensorclass per row
            return ObjectColumn.of, (values,)
        return super().__reduce_ex__(protocol)


def column_values(column: NonTensorStack) -> list[Any]:
    """The values of a one-dimensional column, one per row. For an :class:`ObjectColumn`
    that has not built its members, its own list: read it, never change it."""
    if not isinstance(column, NonTensorStack) or column.batch_dims != 1:
        raise ValueError("an object column is a NonTensorStack with one batch dimension")
    values = column.__dict__.get("_column_values") if isinstance(column, ObjectColumn) else None
    return values if values is not None else column.tolist()


def slice_column(column: NonTensorStack, start: int, stop: int) -> ObjectColumn:
    """Rows ``[start, stop)`` as a column of their own."""
    return ObjectColumn.of(column_values(column)[start:stop])


def select_column(column: NonTensorStack, index: torch.Tensor | Sequence[int]) -> ObjectColumn:
    """The rows ``index`` names, in that order (bounds checked by the caller)."""
    values = column_values(column)
    rows = index.tolist() if isinstance(index, torch.Tensor) else index
    return ObjectColumn.of([values[i] for i in rows])


def concat_columns(columns: Sequence[NonTensorStack]) -> ObjectColumn:
    """One column holding the rows of ``columns``, in order."""
    values: list[Any] = []
    for column in columns:
        values.extend(column_values(column))
    return ObjectColumn.of(values)

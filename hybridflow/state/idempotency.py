"""Idempotency-Key: a repeated request gets the first request's answer, once.

A key's first request runs; a repeat that arrives while it runs waits for it and gets
the same answer; a repeat after it gets the kept answer. The same key with a different
body (another fingerprint) is refused, as payment APIs do. Answers that say "try again"
(the group was unavailable, the call timed out) are not kept, so a retry runs anew.
Kept answers are bounded by count and by bytes, oldest dropped first; nothing is kept
per key once its request finished and its answer was not.
"""

from __future__ import annotations

import asyncio
import sys
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

T = TypeVar("T")

#: Bytes counted for any object that is not a tensor, array, string or container (a
#: number, None...), and for each container itself.
OBJECT_BYTES = 64
#: How deep containers are walked; anything deeper counts as one object.
MAX_DEPTH = 64
#: Strings and bytes this long are counted once however often they are referenced.
_SHARED_BYTES = 4096
_SCALARS = frozenset({int, float, bool, complex, type(None)})
_TEXT = frozenset({str, bytes, bytearray})


def _tensor_bytes(tensor: Any, seen: set[int]) -> int:
    """The bytes of the storages a tensor keeps alive (a view keeps its whole storage),
    each storage counted once; a jagged tensor's values and offsets."""
    if tensor.is_nested:
        import torch  # loaded: this is one of its tensors

        parts = [tensor.values()]
        if tensor.layout == torch.jagged:
            parts += [tensor.offsets(), tensor.lengths()]
        return sum(_tensor_bytes(part, seen) for part in parts if part is not None)
    own = tensor.numel() * tensor.element_size()
    try:
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return own + OBJECT_BYTES
    if key in seen:
        return OBJECT_BYTES
    if key:
        seen.add(key)
    return max(own, size) + OBJECT_BYTES


def _children(value: Any, modules: dict[str, Any]) -> Any:
    """What a container holds, or None for a value counted by itself."""
    tensordict = modules.get("tensordict")
    if tensordict is not None:
        if isinstance(value, tensordict.NonTensorStack):
            column = modules.get("single_controller.object_column")
            if column is not None and value.batch_dims == 1:
                return column.column_values(value)  # an ObjectColumn's list, no member per row
            return value.tolist()
        if isinstance(value, tensordict.NonTensorData):
            return (value.data,)
        if isinstance(value, tensordict.TensorDictBase):
            return [value.get(key) for key in value.keys()]
    if isinstance(value, Mapping):
        return [item for pair in value.items() for item in pair]
    if isinstance(value, (list, tuple, set, frozenset)):
        return value
    if isinstance(value, np.ndarray) and value.dtype.kind == "O":
        return value.reshape(-1).tolist()
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return vars(value).values()
    return None


def estimate_bytes(value: Any, stop_above: int | None = None, raw_divisor: int = 1) -> int:
    """How much memory a value keeps, counted by its content: tensors by their storages,
    numeric arrays by their bytes, strings and bytes by their size; containers, numpy
    object arrays, TensorDicts, ``NonTensorData``, object columns (``NonTensorStack``),
    DataProtos and other objects by what they hold (walked ``MAX_DEPTH`` deep, each
    container and large string once, so shared parts and cycles are not counted again).
    Stops once the count passes ``stop_above`` (the number returned is then only known to
    be over it). Costs a step per object it counts: in proportion to the value's size.

    ``raw_divisor`` weighs the raw buffers (tensors, numeric arrays) against the rest:
    each of their bytes counts ``1 / raw_divisor`` (to count work where a buffer is
    copied and an object walked, not memory)."""
    torch = sys.modules.get("torch")
    modules = sys.modules
    seen: set[int] = set()
    total = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack and (stop_above is None or total <= stop_above):
        node, depth = stack.pop()
        kind = type(node)
        if kind in _SCALARS:
            total += OBJECT_BYTES
            continue
        if kind in _TEXT:
            size = sys.getsizeof(node)
            if size >= _SHARED_BYTES:
                if id(node) in seen:
                    continue
                seen.add(id(node))
            total += size
            continue
        if torch is not None and isinstance(node, torch.Tensor):
            total += _tensor_bytes(node, seen) // raw_divisor
            continue
        if isinstance(node, np.ndarray) and node.dtype.kind != "O":
            total += node.nbytes // raw_divisor + OBJECT_BYTES
            continue
        if depth >= MAX_DEPTH or id(node) in seen:
            total += OBJECT_BYTES
            continue
        children = _children(node, modules)
        total += OBJECT_BYTES
        if children is None:
            continue
        seen.add(id(node))
        if isinstance(node, np.ndarray):
            total += 8 * node.size  # its pointers
        for child in children:
            if stop_above is not None and total > stop_above:
                break
            child_kind = type(child)
            if child_kind in _SCALARS:  # the common case of a large column, without a stack entry
                total += OBJECT_BYTES
            elif child_kind is str and len(child) < _SHARED_BYTES // 4:
                total += sys.getsizeof(child)
            else:
                stack.append((child, depth + 1))
    return total


class IdempotencyConflict(Exception):
    """The key was used before with a different request body."""


@dataclass
class _Kept(Generic[T]):
    fingerprint: str | None
    answer: T
    size: int


class IdempotencyCache(Generic[T]):
    def __init__(self, max_entries: int = 10_000, max_bytes: int = 256 << 20) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._kept: OrderedDict[Hashable, _Kept[T]] = OrderedDict()
        self._kept_bytes = 0
        self._running: dict[Hashable, tuple[str | None, asyncio.Future[T]]] = {}

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def kept_bytes(self) -> int:
        return self._kept_bytes

    @property
    def running(self) -> int:
        return len(self._running)

    def lookup(self, key: Hashable, fingerprint: str | None) -> T | None:
        """The kept answer for ``key`` (IdempotencyConflict when the body differs)."""
        kept = self._kept.get(key)
        if kept is None:
            return None
        _check(key, kept.fingerprint, fingerprint)
        self._kept.move_to_end(key)
        return kept.answer

    async def run(
        self,
        key: Hashable,
        fingerprint: str | None,
        compute: Callable[[], Awaitable[T]],
        keep: Callable[[T], bool] = lambda _answer: True,
    ) -> T:
        """The answer for ``key``: kept, shared with a request still running, or computed
        now by ``compute`` (and kept when ``keep(answer)``). The computation runs as a
        task of its own, so a caller that goes away does not cancel it for the others."""
        kept = self.lookup(key, fingerprint)
        if kept is not None:
            return kept
        running = self._running.get(key)
        if running is not None:
            _check(key, running[0], fingerprint)
            return await asyncio.shield(running[1])
        task = asyncio.ensure_future(compute())
        self._running[key] = (fingerprint, task)

        def finished(done: asyncio.Future[T]) -> None:
            self._running.pop(key, None)
            if not done.cancelled() and done.exception() is None and keep(done.result()):
                self.store(key, fingerprint, done.result())

        task.add_done_callback(finished)
        return await asyncio.shield(task)

    def forget(self, which: Callable[[Hashable], bool]) -> int:
        """Drop the kept answers whose key ``which`` picks (e.g. a group's, when its state is
        discarded); returns how many went."""
        dropped = [key for key in self._kept if which(key)]
        for key in dropped:
            self._kept_bytes -= self._kept.pop(key).size
        return len(dropped)

    def store(self, key: Hashable, fingerprint: str | None, answer: T, size: int | None = None) -> None:
        """Keep an answer, dropping the oldest ones past the bounds (an answer larger
        than the byte bound is not kept at all)."""
        size = estimate_bytes(answer) if size is None else size
        old = self._kept.pop(key, None)
        if old is not None:
            self._kept_bytes -= old.size
        if self.max_entries <= 0 or size > self.max_bytes:
            return
        self._kept[key] = _Kept(fingerprint, answer, size)
        self._kept_bytes += size
        while len(self._kept) > self.max_entries or self._kept_bytes > self.max_bytes:
            _, dropped = self._kept.popitem(last=False)
            self._kept_bytes -= dropped.size


def _check(key: Hashable, first: str | None, now: str | None) -> None:
    if first is not None and now is not None and first != now:
        raise IdempotencyConflict(
            f"Idempotency-Key {key[-1] if isinstance(key, tuple) else key!r} was used with a different request body"
        )

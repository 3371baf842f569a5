"""DataProtoFuture: the answer of a ``blocking=False`` PROTO call made with a batch (a
DataProto or a TensorDict), before it is fetched.

It holds the per-rank Ray futures and how to combine their values (``collect_fn``: the
mode's collect, with the dispatch padding dropped), and optionally how to cut the
combined value afterwards (``dispatch_fn``: :meth:`chunk` uses it). ``get()`` waits for
the ranks and returns the batch. It imports nothing heavy: Ray only inside ``get``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DataProtoFuture", "materialize_futures"]


@dataclass(frozen=True)
class _ChunkPicker:
    """``data.chunk(chunks)[index]``, picklable (a future may travel to another process)."""

    index: int
    chunks: int

    def __call__(self, data: Any) -> Any:
        return data.chunk(self.chunks)[self.index]


@dataclass
class DataProtoFuture:
    """``collect_fn(values of futures)``, then ``dispatch_fn`` of that when set."""

    collect_fn: Callable[[list[Any]], Any]
    futures: list[Any]
    dispatch_fn: Callable[[Any], Any] | None = None

    @staticmethod
    def concat(data: list[Any]) -> DataProtoFuture:
        """A future of the concatenation of these futures' batches, in order."""
        return DataProtoFuture(collect_fn=_concat, futures=list(data))

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        """``chunks`` futures, the ``i``-th of the ``i``-th chunk of this one's DataProto."""
        if not isinstance(chunks, int) or chunks <= 0:
            raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
        return [
            DataProtoFuture(collect_fn=self.collect_fn, futures=self.futures, dispatch_fn=_ChunkPicker(i, chunks))
            for i in range(chunks)
        ]

    def get(self, timeout: float | None = None) -> Any:
        """Wait for every rank (at most ``timeout`` seconds) and return the value."""
        import ray

        output = self.collect_fn(ray.get(list(self.futures), timeout=timeout))
        return self.dispatch_fn(output) if self.dispatch_fn is not None else output


def materialize_futures(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments with every DataProtoFuture replaced by its value (verl resolves them
    in the worker; here the caller resolves them before dispatch)."""
    if not any(isinstance(v, DataProtoFuture) for v in (*args, *kwargs.values())):
        return args, kwargs
    new_args = tuple(v.get() if isinstance(v, DataProtoFuture) else v for v in args)
    new_kwargs = {k: (v.get() if isinstance(v, DataProtoFuture) else v) for k, v in kwargs.items()}
    return new_args, new_kwargs


def _concat(values: list[Any]) -> Any:
    """The values (DataProtos or TensorDicts) concatenated, in order."""
    from single_controller.batch import concat_batches

    if not values:
        raise ValueError("cannot concatenate no futures")
    return concat_batches(values)

"""Putting many objects in Ray's object store at once (verl's ``ray_utils.parallel_put``)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

#: At most this many threads put objects at once when the caller does not say.
MAX_PUT_THREADS = 16


class EmptyPutError(ValueError, AssertionError):
    """``parallel_put`` got nothing to put. Also an AssertionError: verl asserts this."""


def parallel_put(data_list: Sequence[Any], max_workers: int | None = None) -> list[Any]:
    """``ray.put`` every item of ``data_list`` from a pool of threads (serialising large
    objects in parallel); the ObjectRefs in the items' order. ``max_workers`` defaults to
    ``min(len(data_list), 16)``. An empty list is an :class:`EmptyPutError`."""
    items = list(data_list)
    if not items:
        raise EmptyPutError("parallel_put needs at least one object to put")
    workers = max_workers if max_workers is not None else min(len(items), MAX_PUT_THREADS)
    if not isinstance(workers, int) or workers <= 0:
        raise ValueError(f"max_workers must be a positive integer, got {max_workers!r}")
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="parallel_put") as pool:
        return list(pool.map(ray.put, items))

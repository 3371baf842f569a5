"""Which state store a location names."""

from __future__ import annotations

import os
from typing import Literal

from hybridflow.state.redis_store import RedisStateStore
from hybridflow.state.sqlite_store import MemoryStateStore, SQLiteStateStore
from hybridflow.state.store import DEFAULT_MAX_ANSWER_BYTES, DEFAULT_MAX_ANSWERS, REDIS_SCHEMES, StateStore


def open_store(
    location: str | os.PathLike[str] | None,
    *,
    namespace: str = "hybridflow",
    synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
    busy_timeout_s: float = 10.0,
    max_answers: int = DEFAULT_MAX_ANSWERS,
    max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
) -> StateStore:
    """The store a location names: None for an in-memory store, a ``redis://``,
    ``rediss://`` or ``unix://`` URL for a Redis store (keys under ``namespace``),
    anything else a SQLite file path (its directory is created)."""
    bounds = {"max_answers": max_answers, "max_answer_bytes": max_answer_bytes}
    if location is None:
        return MemoryStateStore(**bounds)
    location = os.fspath(location)
    if location.startswith(REDIS_SCHEMES):
        return RedisStateStore(location, namespace=namespace, **bounds)
    if not location:
        raise ValueError("state path must not be empty (null means in memory)")
    return SQLiteStateStore(location, synchronous=synchronous, busy_timeout_s=busy_timeout_s, **bounds)

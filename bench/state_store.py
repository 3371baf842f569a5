"""The cost of recording one acknowledged call in a state store."""

from __future__ import annotations

import statistics
import time

from hybridflow.state.store import StateStore, StoredAnswer


def bench_record_call(store: StateStore, n: int = 1000, *, scope: str = "bench/record_call") -> float:
    """p50 seconds of :meth:`StateStore.record_call` for a typical acknowledged call (a
    4-rank ``add``: entry and idempotency answer already encoded), over ``n`` calls on a
    scope of its own, which is reset before and after. Compare a durable store with
    :class:`MemoryStateStore` to get the added cost per call."""
    import torch

    from hybridflow.state.codec import encode_answer, encode_call, fingerprint

    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    entry = encode_call("add", (), {"x": [1, 1, 1, 1]})
    answer = encode_answer([torch.tensor([float(rank + 1)]) for rank in range(4)])
    digest = fingerprint(entry)
    store.reset(scope)
    times = []
    try:
        for seq in range(1, n + 1):
            started = time.perf_counter()
            store.record_call(scope, seq, entry, StoredAnswer(f"bench-{seq}", digest, answer))
            times.append(time.perf_counter() - started)
    finally:
        store.reset(scope)
    return statistics.median(times)

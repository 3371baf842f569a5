"""Timing helpers the benchmarks share: a median, a timed loop, and two calls timed in
alternating rounds so that machine noise hits both alike."""

from __future__ import annotations

import statistics
import time


def p50(samples: list[float]) -> float:
    return statistics.median(samples)


def timed(fn, n: int, warmup: int = 5) -> list[float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def interleaved(first, second, n: int, rounds: int = 5) -> tuple[list[float], list[float]]:
    """``n`` timings of each of two calls, taken in alternating rounds so that machine
    noise hits both alike."""
    a: list[float] = []
    b: list[float] = []
    for _ in range(rounds):
        a += timed(first, n // rounds)
        b += timed(second, n // rounds)
    return a, b

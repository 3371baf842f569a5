"""Cumulative inference statistics per OIP model, in the shape of Triton's statistics
extension (``GET /v2/models/{name}/stats``).

Prometheus metrics (``hybridflow.control.metrics``) cannot be read back by the process that
records them, so the controller keeps these counts as well. One controller replica
serves each model, so a process-wide table per model name is the model's whole count.

Durations are cumulative nanoseconds with a count, as Triton reports them:

- ``queue``: waiting for a batch (``InferResult.queue_s``);
- ``compute_input``: checking the request's inputs against the model's current spec
  (the rest of ``infer`` before the group call);
- ``compute_infer``: the group call itself (``InferResult.compute_s``);
- ``compute_output``: nothing here takes time after the call (the ingress encodes the
  outputs), so it is counted with 0 ns.

A request that ran in a batch of ``n`` counts as ``1/n`` of that batch's execution:
``execution_count`` and each ``batch_stats`` entry add up exactly when every request of
a batch is recorded (each gets its own ``InferResult``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

NS = 1e9
#: The one version every model has (``versions: ["1"]`` in the model metadata).
VERSION = "1"


@dataclass
class Duration:
    """A count and a total time; ``ns`` kept as a float so 1/n shares add up."""

    count: float = 0.0
    ns: float = 0.0

    def add(self, seconds: float, share: float = 1.0) -> None:
        self.count += share
        self.ns += max(seconds, 0.0) * NS * share

    def as_json(self) -> dict[str, int]:
        return {"count": round(self.count), "ns": round(self.ns)}


@dataclass
class BatchStatistics:
    """Executions of one batch size (a request's share of it: 1/size)."""

    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class ModelStatistics:
    name: str
    last_inference_ms: int = 0
    inference_count: int = 0
    execution_count: float = 0.0
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    batches: dict[int, BatchStatistics] = field(default_factory=dict)

    def failed(self, total_s: float) -> None:
        """A request that got no outputs, ``total_s`` after it reached ``infer``."""
        self.last_inference_ms = int(time.time() * 1000)
        self.fail.add(total_s)

    def succeeded(self, total_s: float, queue_s: float, infer_s: float, batch_size: int) -> None:
        """A request answered ``total_s`` after it reached ``infer``, of which it waited
        ``queue_s`` for a batch of ``batch_size`` and ran ``infer_s`` in the group call."""
        self.last_inference_ms = int(time.time() * 1000)
        input_s = max(total_s - queue_s - infer_s, 0.0)
        size = max(int(batch_size), 1)
        share = 1.0 / size
        self.success.add(total_s)
        self.inference_count += 1
        self.execution_count += share
        self.queue.add(queue_s)
        self.compute_input.add(input_s)
        self.compute_infer.add(infer_s)
        self.compute_output.add(0.0)
        batch = self.batches.setdefault(size, BatchStatistics())
        batch.compute_input.add(input_s, share)
        batch.compute_infer.add(infer_s, share)
        batch.compute_output.add(0.0, share)

    def as_triton(self) -> dict[str, Any]:
        """One ``$model_stat`` of Triton's statistics response."""
        return {
            "name": self.name,
            "version": VERSION,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": round(self.execution_count),
            "inference_stats": {
                "success": self.success.as_json(),
                "fail": self.fail.as_json(),
                "queue": self.queue.as_json(),
                "compute_input": self.compute_input.as_json(),
                "compute_infer": self.compute_infer.as_json(),
                "compute_output": self.compute_output.as_json(),
                "cache_hit": Duration().as_json(),
                "cache_miss": Duration().as_json(),
            },
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": batch.compute_input.as_json(),
                    "compute_infer": batch.compute_infer.as_json(),
                    "compute_output": batch.compute_output.as_json(),
                }
                for size, batch in sorted(self.batches.items())
            ],
        }


_TABLE: dict[str, ModelStatistics] = {}


def of(model: str) -> ModelStatistics:
    """This process's statistics of ``model`` (zeros until its first request)."""
    found = _TABLE.get(model)
    if found is None:
        found = _TABLE[model] = ModelStatistics(model)
    return found

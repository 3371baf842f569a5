"""End to end: dynamic batching of the `mlp` model (serve_config.yaml's `batching`) on the
session's service. Concurrent OIP requests share forwards of the tp=4 layer, and each
answer is bit for bit the one the layer gives the request alone (through the group route,
which never batches)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hybridflow_client.python_client import AsyncSingleControllerClient, SingleControllerClient
from tests.mlp_reference import SMALL

pytest.importorskip("httpx")


async def _infer_together(url: str, xs: list[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    async with AsyncSingleControllerClient(url, timeout=120) as client:
        answers = await asyncio.gather(*(client.infer_tensors("mlp", {"x": x}) for x in xs))
    return [(a.outputs["y"], (a.raw.get("parameters") or {}).get("batch_size", 1)) for a in answers]


def test_concurrent_infer_requests_share_forwards_and_each_answer_is_its_own(service, http):
    assert http.post("/v1/groups/mlp/init_model", json={"kwargs": {"config": SMALL}}).status_code == 200
    hidden = SMALL["hidden_size"]
    generator = torch.Generator().manual_seed(14)
    # three shapes at once: [8, 2] and [8, 3] requests batch (apart); seq 7 is not a
    # multiple of tp 4, so those requests run alone (batched, their sums would change order)
    shapes = [(8, 2), (8, 3), (8, 2), (7, 2)] * 4
    xs = [torch.randn(seq, batch, hidden, generator=generator) for seq, batch in shapes]
    answers: list[tuple[torch.Tensor, int]] = []
    for _ in range(3):  # concurrency is the client's to offer; a loaded machine may spread one round out
        answers = asyncio.run(_infer_together(service.url, xs))
        if max(size for _, size in answers) > 1:
            break
    sizes = [size for _, size in answers]
    assert max(sizes) > 1, f"no two concurrent requests shared a forward: batch sizes {sizes}"
    assert all(size == 1 for (seq, _), size in zip(shapes, sizes, strict=True) if seq == 7)
    with SingleControllerClient(service.url, timeout=120) as client:
        for x, (y, size) in zip(xs, answers, strict=True):
            (alone,) = client.call("mlp", "run_layer", x=[x], binary=True)
            assert y.shape == x.shape
            assert torch.equal(y, alone), f"batch of {size}: max difference {float((y - alone).abs().max())}"

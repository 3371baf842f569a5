"""What the image and cluster tests share: Docker commands, a free host port, waiting for
the service, and the tutorial's calls over HTTP with the numbers the README gives."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("IMAGE", "hybridflow-serve")

#: The README's small layer (the tutorial's `init_model` step), small enough for JSON.
SMALL_LAYER = {"hidden_size": 64, "intermediate_size": 128, "hidden_act": "silu", "pretraining_tp": 1, "tp": 4}


def docker(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def wait_ready(client: httpx.Client, timeout_s: float, failure: Callable[[], str | None]) -> float:
    """Poll ``/readyz`` until it answers 200; return the seconds it took. ``failure``
    names a reason to stop waiting (the container exited), or None."""
    start = time.monotonic()
    last = "no answer"
    while time.monotonic() - start < timeout_s:
        reason = failure()
        if reason:
            raise AssertionError(f"gave up waiting for /readyz: {reason}")
        try:
            response = client.get("/readyz", timeout=10)
            if response.status_code == 200:
                return time.monotonic() - start
            last = f"{response.status_code} {response.text[:300]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(3)
    raise AssertionError(f"/readyz not 200 within {timeout_s:g} s; last: {last}")


def container_logs(name: str, lines: int = 60) -> str:
    result = docker("logs", "--tail", str(lines), name, check=False)
    return result.stdout + result.stderr


# -- the tutorial over HTTP ----------------------------------------------------------------


def call(client: httpx.Client, group: str, method: str, **body: Any) -> dict[str, Any]:
    response = client.post(f"/v1/groups/{group}/{method}", json=body)
    assert response.status_code == 200, f"{group}.{method}: {response.status_code} {response.text[:500]}"
    return response.json()


def tensor_values(output: list[dict[str, Any]]) -> list[float]:
    """The per-rank FP32 [1] tensors a GPUAccumulator group answers, as numbers."""
    values = []
    for item in output:
        assert item["datatype"] == "FP32" and item["shape"] == [1], item
        values.append(item["data"][0])
    return values


def tensor_from_json(obj: dict[str, Any]) -> torch.Tensor:
    assert obj["datatype"] == "FP32", obj["datatype"]
    return torch.from_numpy(np.asarray(obj["data"], dtype=np.float32).reshape(obj["shape"]))


def reference_layer(shards: list[dict[str, Any]], x: torch.Tensor) -> torch.Tensor:
    """The unsharded layer from its tensor-parallel shards, in float64:
    down(silu(gate(x)) * up(x)), summed over the shards of the row-parallel down projection."""
    y = torch.zeros(x.shape[:-1] + (SMALL_LAYER["hidden_size"],), dtype=torch.float64)
    xd = x.double()
    for shard in shards:
        gate, up = tensor_from_json(shard["gate_up_proj.weight"]).double().chunk(2, dim=0)
        down = tensor_from_json(shard["down_proj.weight"]).double()
        y += (torch.nn.functional.silu(xd @ gate.T) * (xd @ up.T)) @ down.T
    return y


def mlp_infer(client: httpx.Client, x: torch.Tensor) -> torch.Tensor:
    """One Open Inference Protocol call on the `mlp` model (JSON tensors)."""
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.flatten().tolist()}]}
    response = client.post("/v2/models/mlp/infer", json=body)
    assert response.status_code == 200, f"mlp infer: {response.status_code} {response.text[:500]}"
    (output,) = response.json()["outputs"]
    assert output["name"] == "y" and output["shape"] == list(x.shape), output
    return tensor_from_json(output)


def check_tutorial(client: httpx.Client) -> None:
    """The README's walk-through on a fresh service: the plain accumulator, the pool of
    four, the rank-zero method and the layer through OIP, with the README's numbers."""
    assert call(client, "accumulator", "get_value")["output"] == 0
    call(client, "accumulator", "add", args=[10])
    assert call(client, "accumulator", "get_value")["output"] == 10
    assert tensor_values(call(client, "gpu_accumulator", "add", kwargs={"x": [1, 1, 1, 1]})["output"]) == [1, 2, 3, 4]
    rank_zero = call(client, "test_actor", "foo_rank_zero", kwargs={"x": 1, "y": 2})
    assert rank_zero["output"] == 5 and rank_zero["execute_mode"] == "RANK_ZERO"

    call(client, "mlp", "init_model", kwargs={"config": SMALL_LAYER})
    shards = call(client, "mlp", "get_weights")["output"]
    assert len(shards) == SMALL_LAYER["tp"]
    x = torch.rand(3, 2, SMALL_LAYER["hidden_size"], generator=torch.Generator().manual_seed(17))
    y = mlp_infer(client, x)
    reference = reference_layer(shards, x)
    error = float((y.double() - reference).norm() / reference.norm())
    assert error <= 1e-5, f"mlp infer is off the unsharded reference by {error:.2e}"

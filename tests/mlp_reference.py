"""Unsharded references for the tp MLP layer: from its JSON shards (as served over HTTP), and
from a Hugging Face Llama checkpoint the tests write."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

SMALL = {"hidden_size": 64, "intermediate_size": 128, "hidden_act": "silu", "pretraining_tp": 1, "tp": 4}


def from_json(obj):
    dtype = {"FP32": np.float32}[obj["datatype"]]
    return torch.from_numpy(np.asarray(obj["data"], dtype=dtype).reshape(obj["shape"]))


def to_json(t):
    return {"datatype": "FP32", "shape": list(t.shape), "data": t.flatten().tolist()}


def reference_mlp(weights, x):
    """Unsharded forward from the tp shards: down(silu(gate(x)) * up(x))."""
    y = torch.zeros(x.shape[:-1] + (SMALL["hidden_size"],), dtype=torch.float64)
    for shard in weights:
        gate_up = from_json(shard["gate_up_proj.weight"]).double()
        gate, up = gate_up.chunk(2, dim=0)
        down = from_json(shard["down_proj.weight"]).double()
        y += (torch.nn.functional.silu(x.double() @ gate.T) * (x.double() @ up.T)) @ down.T
    return y


def assert_close(y, ref):
    """Relative error at most 1e-5 (fp32 against a float64 reference)."""
    err = (y.double() - ref).norm() / ref.norm()
    assert err <= 1e-5, err


def write_llama_mlp_checkpoint(
    directory: Path, hidden: int, ffn: int, layers: int, seed: int
) -> tuple[Path, dict[str, torch.Tensor]]:
    """A Hugging Face Llama layout of ``layers`` MLP layers (its MLP tensors only) in
    ``directory``/model.safetensors, seeded: (its path, its tensors)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        prefix = f"model.layers.{layer}.mlp."
        tensors[prefix + "gate_proj.weight"] = torch.randn(ffn, hidden, generator=g) / 8
        tensors[prefix + "up_proj.weight"] = torch.randn(ffn, hidden, generator=g) / 8
        tensors[prefix + "down_proj.weight"] = torch.randn(hidden, ffn, generator=g) / 8
    path = directory / "model.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def checkpoint_mlp(tensors: dict[str, torch.Tensor], layer: int, x: torch.Tensor) -> torch.Tensor:
    """Layer ``layer``'s forward from the checkpoint's full matrices, in float64."""
    gate, up, down = (tensors[f"model.layers.{layer}.mlp.{name}.weight"].double()
                      for name in ("gate_proj", "up_proj", "down_proj"))
    h = x.double()
    return (torch.nn.functional.silu(h @ gate.T) * (h @ up.T)) @ down.T

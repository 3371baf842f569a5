"""An unsharded reference for the tp MLP layer served over HTTP, from its JSON shards."""

from __future__ import annotations

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

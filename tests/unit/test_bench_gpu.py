"""bench.gpu's pieces that need no GPU: the served config it writes and its precision switch."""

from __future__ import annotations

import torch
import yaml

from bench.gpu import DATASHEET_TFLOPS, Precision, datasheet, gpu_serve_config
from hybridflow.config import load_config


def test_gpu_serve_config_serves_mlp_alone_at_tp1():
    document = yaml.safe_load(gpu_serve_config().read_text())
    args = document["applications"][0]["args"]
    config = load_config(args)  # a config the service accepts
    assert [d.name for d in config.deployments] == ["mlp"]
    (group,) = args["deployments"][0]["groups"]
    assert group["pool"] == {"process_on_nodes": [1], "use_gpu": torch.cuda.is_available()}
    assert group["megatron"]["tensor_model_parallel_size"] == 1
    assert group["init_calls"][0]["kwargs"]["config"]["tp"] == 1
    models = {m["name"]: m for m in args["deployments"][0]["models"]}
    assert "batching" in models["mlp"] and "batching" not in models["mlp_unbatched"]
    assert [a["name"] for a in document["applications"]] == ["hybridflow", "noop"]


def test_precision_switches_tf32_for_its_block_only():
    before = torch.backends.cuda.matmul.allow_tf32
    with Precision("tf32") as precision:
        assert torch.backends.cuda.matmul.allow_tf32 and precision.dtype == torch.float32
    with Precision("fp32"):
        assert not torch.backends.cuda.matmul.allow_tf32
    assert Precision("bf16").dtype == torch.bfloat16
    assert torch.backends.cuda.matmul.allow_tf32 == before


def test_datasheet_knows_hopper_cards_only():
    assert datasheet("NVIDIA H100 80GB HBM3") == DATASHEET_TFLOPS["H100"]
    assert datasheet("NVIDIA H200") == DATASHEET_TFLOPS["H200"]
    assert datasheet("Tesla T4") is None

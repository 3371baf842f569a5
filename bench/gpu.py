"""The tp MLP layer and the batched ``infer`` path on a GPU, against the card's own peak.

    python -m bench.gpu layer              # megatron layer forward, TFLOP/s per dtype and size
    python -m bench.gpu infer              # serve run on the GPU: /v2/models/mlp/infer batched vs not
    python -m bench.gpu layer infer --quick

``layer`` needs no Ray: one process, world size 1 (nccl on a GPU, gloo on a CPU), builds
``ParallelLlamaMLP`` (4096 x 11008, the service's layer) as a worker does, and times its
forward for several token counts in three precisions: fp32 as served (TF32 off), fp32 with
TF32 matmuls allowed, and bf16 (the same layer cast). A forward is ``6 * hidden * ffn``
FLOPs per token (gate and up: ``2 * hidden * 2 * ffn``; down: ``2 * ffn * hidden``). The
card's peak is measured in the same run, an 8192^3 ``torch.matmul`` in each precision, and
beside it the datasheet's dense figure where the card is known. The per-rank shard of a
tp=4 layer (``ffn / 4``, no all-reduce) is timed too: what each of four GPUs would run.

A single GPU cannot hold a tp=4 NCCL group (NCCL refuses two ranks on one device), so
``infer`` serves the ``mlp`` model at tp=1 on the GPU: the path is the service's own
(proxy, ingress, controller, batcher, group call, worker, GPU forward) with one rank.
It runs ``bench.run``'s batching figure against it and checks each batched answer against
the unbatched one.

Writes bench/results/gpu.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
HIDDEN, FFN = 4096, 11008

#: Dense tensor-core (or, for fp32, CUDA-core) peaks from NVIDIA's datasheets, TFLOP/s.
DATASHEET_TFLOPS = {
    "H100": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4},  # H100 SXM
    "H200": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4},
}
PRECISIONS = ("fp32", "tf32", "bf16")


def datasheet(name: str) -> dict[str, float] | None:
    return next((peaks for card, peaks in DATASHEET_TFLOPS.items() if card in name), None)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_op(fn: Callable[[], Any], min_seconds: float, warmup: int = 3) -> float:
    """Median seconds per call of ``fn``, over repeats filling ``min_seconds`` (at least 5)."""
    for _ in range(warmup):
        fn()
    _synchronize()
    samples: list[float] = []
    started = time.perf_counter()
    while len(samples) < 5 or time.perf_counter() - started < min_seconds:
        begin = time.perf_counter()
        fn()
        _synchronize()
        samples.append(time.perf_counter() - begin)
    return statistics.median(samples)


class Precision:
    """fp32 with TF32 off (the layer as served), fp32 with TF32 on, or bf16."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.dtype = torch.bfloat16 if name == "bf16" else torch.float32

    def __enter__(self) -> Precision:
        self._saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.name == "tf32"
        return self

    def __exit__(self, *exc: object) -> None:
        torch.backends.cuda.matmul.allow_tf32 = self._saved


def matmul_peak(device: torch.device, precision: Precision, n: int, min_seconds: float) -> float:
    """TFLOP/s of an ``n^3`` matmul of random data: what this card gives in this run."""
    a = torch.randn(n, n, device=device, dtype=precision.dtype)
    b = torch.randn(n, n, device=device, dtype=precision.dtype)
    seconds = time_op(lambda: torch.matmul(a, b), min_seconds)
    return 2 * n**3 / seconds / 1e12


def bench_layer(token_shapes: list[tuple[int, int]], min_seconds: float, peak_n: int) -> dict[str, Any]:
    """Forward TFLOP/s of the served layer (and a tp=4 rank's shard) per precision and size."""
    from bench.layer_init import init_megatron_rank
    from single_controller.device import get_torch_device
    from single_controller.models.llama import ParallelLlamaMLP
    from single_controller.rendezvous import free_port

    init_megatron_rank(0, 1, free_port())
    device = get_torch_device()
    layers = {
        "tp1": ParallelLlamaMLP({"hidden_size": HIDDEN, "intermediate_size": FFN}).to(device),
        # one rank of tp=4: a quarter of gate/up rows and down columns, no all-reduce
        "tp4_rank_shard": ParallelLlamaMLP({"hidden_size": HIDDEN, "intermediate_size": FFN // 4}).to(device),
    }
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    sheet = datasheet(name) if device.type == "cuda" else None
    out: dict[str, Any] = {"device": name, "layer": {"hidden_size": HIDDEN, "intermediate_size": FFN},
                           "precisions": {}}
    for precision_name in PRECISIONS:
        with Precision(precision_name) as precision, torch.no_grad():
            peak = matmul_peak(device, precision, peak_n, min_seconds)
            rows = []
            for layer_name, layer in layers.items():
                layer.to(precision.dtype)
                ffn = layer.intermediate_size
                for seq, batch in token_shapes:
                    x = torch.randn(seq, batch, HIDDEN, device=device, dtype=precision.dtype)
                    seconds = time_op(lambda: layer(x), min_seconds)  # noqa: B023
                    tflops = 6 * HIDDEN * ffn * seq * batch / seconds / 1e12
                    rows.append({
                        "layer": layer_name, "shape": [seq, batch, HIDDEN], "tokens": seq * batch,
                        "ms": seconds * 1e3, "tflops": tflops, "of_measured_peak": tflops / peak,
                        "of_datasheet_peak": tflops / sheet[precision_name] if sheet else None,
                    })
                    print(precision_name, json.dumps(rows[-1]), flush=True)
                layer.to(torch.float32)
            out["precisions"][precision_name] = {
                "matmul_peak_tflops": peak, "matmul_peak_n": peak_n,
                "datasheet_tflops": sheet[precision_name] if sheet else None, "forwards": rows,
            }
    import torch.distributed as dist

    dist.destroy_process_group()
    return out


def gpu_serve_config() -> Path:
    """``bench.run``'s config with the ``mlp`` deployment alone, at tp=1 on a GPU bundle."""
    import yaml

    from bench.http_figures import bench_config

    document = yaml.safe_load(bench_config().read_text())
    app = document["applications"][0]
    app["args"]["state"] = {"path": None}
    deployments = [d for d in app["args"]["deployments"] if d["name"] == "mlp"]
    # the `mlp` group and its models alone (other groups of the deployment need more GPUs)
    deployments[0]["groups"] = [g for g in deployments[0]["groups"] if g["name"] == "mlp"]
    deployments[0]["models"] = [m for m in deployments[0].get("models", []) if m["group"] == "mlp"]
    group = deployments[0]["groups"][0]
    group.pop("weights_from", None)
    group["pool"] = {"process_on_nodes": [1], "use_gpu": torch.cuda.is_available()}
    group["megatron"]["tensor_model_parallel_size"] = 1
    for call in group.get("init_calls", []):
        call["kwargs"]["config"]["tp"] = 1
    app["args"]["deployments"] = deployments
    path = RESULTS / "gpu_serve_config.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def bench_infer(quick: bool) -> dict[str, Any]:
    """The batching figure of ``bench.run`` on the GPU-served layer, and the largest relative
    difference between a batched answer and the same request unbatched."""
    import httpx
    import numpy as np

    from bench.http_figures import BATCH_CLIENTS, BATCH_SHAPE, bench_batching, oip_body
    from tests.serve_process import ServeProcess

    proc = ServeProcess(config=gpu_serve_config())
    started = time.perf_counter()
    proc.start(timeout_s=600, ready_path="/readyz")
    out: dict[str, Any] = {"cold_start_s": time.perf_counter() - started}
    try:
        out.update(bench_batching(proc.url, quick))

        async def compare() -> float:
            xs = [torch.rand(*BATCH_SHAPE) for _ in range(BATCH_CLIENTS)]
            async with httpx.AsyncClient(base_url=proc.url, timeout=300) as client:

                async def infer(model: str, x: torch.Tensor) -> np.ndarray:
                    body, headers = oip_body("x", x, binary_output=False)
                    response = await client.post(f"/v2/models/{model}/infer", content=body, headers=headers)
                    response.raise_for_status()
                    (output,) = response.json()["outputs"]
                    return np.asarray(output["data"], dtype=np.float32).reshape(output["shape"])

                batched = await asyncio.gather(*(infer("mlp", x) for x in xs))
                alone = [await infer("mlp_unbatched", x) for x in xs]
            return max(float(np.linalg.norm(b - a) / np.linalg.norm(a)) for b, a in zip(batched, alone, strict=True))

        out["batched_vs_unbatched_max_rel_err"] = asyncio.run(compare())
        # Where a lone request's milliseconds go: the ingress replica's own time (its access
        # log) and the ranks' forward (Ray's timeline), beside what the client saw.
        from bench.hops import breakdown

        body, headers = oip_body("x", torch.rand(*BATCH_SHAPE), binary_output=True)
        with httpx.Client(base_url=proc.url, timeout=300) as http:
            out["lone_request_hops"] = breakdown(proc, http, "/v2/models/mlp_unbatched/infer", body,
                                                 {"ingress": "hybridflow_ingress"}, "run_layer", 50, headers=headers,
                                                 ranks=1)
    finally:
        proc.kill()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="+", choices=("layer", "infer"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu.json")
    options = parser.parse_args(argv)
    quick = options.quick
    # the bench reads the served cluster's task timeline (bench.hops), as bench.run does
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    results: dict[str, Any] = {
        "quick": quick,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
    }
    options.out.parent.mkdir(parents=True, exist_ok=True)
    if "layer" in options.parts:
        shapes = [(8, 2), (8, 32)] + ([] if quick else [(512, 4), (2048, 4), (4096, 8)])
        results["layer"] = bench_layer(shapes, min_seconds=0.2 if quick else 1.0, peak_n=2048 if quick else 8192)
        options.out.write_text(json.dumps(results, indent=2) + "\n")  # kept should infer fail
    if "infer" in options.parts:
        results["infer"] = bench_infer(quick)
    if "layer" in options.parts and "infer" in options.parts:
        # A lone request against the forward it runs: what the served path adds on the GPU.
        fp32 = results["layer"]["precisions"]["fp32"]["forwards"]
        forward_ms = next(r["ms"] for r in fp32 if r["layer"] == "tp1" and r["shape"][:2] == [8, 2])
        results["request_vs_forward"] = {
            "forward_ms": forward_ms,
            "lone_request_unbatched_p50_ms": results["infer"]["batching_single_p50_unbatched_ms"],
            "added_ms": results["infer"]["batching_single_p50_unbatched_ms"] - forward_ms,
            "batched_over_unbatched_rps_16": results["infer"]["batching_rps_ratio"],
        }
    options.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

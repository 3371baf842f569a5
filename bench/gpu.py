"""The tp MLP layer and the batched ``infer`` path on a GPU, against the card's own peak.

    python -m bench.gpu layer              # megatron layer forward, TFLOP/s per dtype and size
    python -m bench.gpu infer              # serve run on the GPU against hand-written floors
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
It measures it as ``bench.run`` does (``bench.floor_runs``), each target alone on the
machine with the load generator: the hand-written floors (FastAPI + uvicorn over one Ray
GPU actor holding the same layer, plain calls and a compiled graph), the service on
HAProxy, the plain floor again, the service on Serve's proxy. Its targets
(``GPU_TARGETS``): a lone unbatched request's p50 at most the plain app's, and batched
requests/s at 64 clients at least the compiled-graph app's. It checks each batched answer
against the unbatched one too. ``make bench-gpu`` (``layer infer``) takes under 6 minutes
on a 16-CPU node.

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
PATHS = ("haproxy", "serve_proxy")

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
    deployments = [d for d in app["args"]["deployments"] if d["name"] == "mlp"]  # at tp=1 already
    group = deployments[0]["groups"][0]
    group["pool"] = {"process_on_nodes": [1], "use_gpu": torch.cuda.is_available()}
    app["args"]["deployments"] = deployments
    path = RESULTS / "gpu_serve_config.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


#: The GPU node's targets: ratios of ``bench.floor_runs.figures`` on each request path.
GPU_TARGETS = {
    "gpu_infer_p50_floor_ratio": ("lone unbatched infer p50 / the plain hand-written app's", "infer_lone_p50_ms_vs_plain",
                                  1.0, "max"),
    "gpu_batched_rps_floor_ratio": ("batched mlp requests/s at 64 clients / the compiled-graph app's",
                                    "infer_batched_rps_64_vs_compiled", 1.0, "min"),
}


def gpu_targets(infer: dict[str, Any]) -> dict[str, Any]:
    """The targets' figures (``<target>_<path>``) and a ``targets`` record as ``bench.run``
    writes one."""
    out: dict[str, Any] = {}
    targets = {}
    for name, (label, source, goal, kind) in GPU_TARGETS.items():
        for path in PATHS:
            value = infer.get(f"{source}_{path}")
            if value is None:
                continue
            key = f"{name}_{path}"
            out[key] = value
            met = value <= goal if kind == "max" else value >= goal
            targets[key] = {"label": f"{label}, {path}", "target": goal, "value": value, "met": met,
                            "sign": "<=" if kind == "max" else ">="}
    out["targets"] = targets
    return out


def gpu_settings(quick: bool) -> Any:
    """The load generator's settings on a GPU node: a request takes milliseconds, so short
    windows hold thousands of requests (and the run fits its 6 minutes)."""
    from bench.floor_runs import Settings

    if quick:
        return Settings(Settings.for_run(True).processes, lone_s=2.0, window_s=3.0, warmup_s=1.0, idle_s=1.0)
    return Settings(Settings.for_run(False).processes, lone_s=3.0, window_s=4.0, warmup_s=1.0, idle_s=2.0)


def bench_infer(quick: bool) -> dict[str, Any]:
    """The served layer on the GPU against the hand-written floors, each run alone, on both
    request paths (``bench.http_figures.served_against_floors``), with the batching figures;
    and, on the HAProxy run, the largest relative difference between a batched answer and
    the same request unbatched, and where a lone request's time goes."""
    from bench.http_figures import served_against_floors

    out = served_against_floors(quick, extra=lambda proc, settings: gpu_service_checks(proc), config=gpu_serve_config(),
                                add=False, settings=gpu_settings(quick))
    out["cold_start_s"] = out["served_runs"]["services"]["haproxy"]["start_s"]
    out.update(gpu_targets(out))
    return out


def gpu_service_checks(proc: Any) -> dict[str, Any]:
    import httpx
    import numpy as np

    from bench.http_figures import BATCH_CLIENTS, BATCH_SHAPE, oip_body

    out: dict[str, Any] = {}

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
    started = time.perf_counter()
    if "layer" in options.parts:
        shapes = [(8, 2), (8, 32)] + ([] if quick else [(512, 4), (2048, 4), (4096, 8)])
        results["layer"] = bench_layer(shapes, min_seconds=0.2 if quick else 1.0, peak_n=2048 if quick else 8192)
        options.out.write_text(json.dumps(results, indent=2) + "\n")  # kept should infer fail
    if "infer" in options.parts:
        results["infer"] = bench_infer(quick)
        results["targets"] = results["infer"].pop("targets")
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
    results["bench_seconds"] = time.perf_counter() - started
    options.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k != "infer"}, indent=2))
    infer = results.get("infer", {})
    print(json.dumps({k: v for k, v in infer.items() if k != "served_runs"}, indent=1))
    for entry in results.get("targets", {}).values():
        print(f"{entry['label']:70s} {entry['value']:8.3f}  target {entry['sign']} {entry['target']}  "
              f"{'met' if entry['met'] else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

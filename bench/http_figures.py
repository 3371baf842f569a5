"""The served path's figures: cold start against its floor; the HTTP ``add`` and the
``mlp`` inference against hand-written floors, each run alone (``bench.floor_runs``), on
both request paths; the HTTP add against the no-op route, uploads, gRPC beside HTTP, and
batching (``bench.run`` puts them in latest.json). Every requests/s figure comes from the
load generator (``bench.load_generator``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch
import yaml

from bench.cold_start import Measured, cpu_figures, measured_run, measured_start
from bench.hops import breakdown
from bench.library_figures import BATCH_CLIENTS, BATCH_SHAPE
from bench.start_timeline import read_milestones
from bench.timing import interleaved, p50, timed
from tests.serve_process import CONFIG, ROOT, ServeProcess

RESULTS = ROOT / "bench" / "results"


def serve_mlp_at_tp1(deployment: dict[str, Any]) -> None:
    """The ``mlp`` deployment of a serve config, in place: its ``mlp`` group alone (the
    rollout group's tp=2 needs the tp=4 group's weights), at tp=1 on one process, serving
    ``mlp`` (batching) and ``mlp_unbatched`` (the same group and method, a forward per
    request: the batching figure's floor)."""
    deployment["groups"] = [g for g in deployment["groups"] if g["name"] == "mlp"]
    group = deployment["groups"][0]
    group.pop("weights_from", None)
    group["pool"] = {**group["pool"], "process_on_nodes": [1]}
    group["megatron"]["tensor_model_parallel_size"] = 1
    for call in group.get("init_calls", []):
        call["kwargs"]["config"]["tp"] = 1
    (mlp,) = [m for m in deployment.get("models", []) if m["name"] == "mlp"]
    unbatched = {key: value for key, value in mlp.items() if key != "batching"}
    deployment["models"] = [mlp, {**unbatched, "name": "mlp_unbatched"}]


def bench_config() -> Path:
    """serve_config.yaml with the `mlp` layer at tp=1 (:func:`serve_mlp_at_tp1`), and the
    no-op floor app at /noop."""
    document = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    app = document["applications"][0]
    app["args"]["max_body_bytes"] = 1 << 30
    for deployment in app["args"]["deployments"]:
        if deployment["name"] == "mlp":
            serve_mlp_at_tp1(deployment)
    document["applications"].append({"name": "noop", "route_prefix": "/noop", "import_path": "bench.noop_app:app"})
    path = RESULTS / "bench_config.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def noop_only_config() -> Path:
    document = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    document["applications"] = [{"name": "noop", "route_prefix": "/noop", "import_path": "bench.noop_app:app"}]
    path = RESULTS / "noop_config.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def cold_start(config: Path, ready_path: str) -> tuple[Measured, ServeProcess]:
    """``serve run`` of ``config`` until ``ready_path`` answers, its processes sampled."""
    proc = ServeProcess(config=config)
    return measured_start(proc, 600, ready_path), proc


def safetensors_body(name: str, t: torch.Tensor) -> bytes:
    from hybridflow_client.wire.safetensors_body import encode_safetensors

    return encode_safetensors({name: t})


def oip_body(name: str, t: torch.Tensor, binary_output: bool) -> tuple[bytes, dict[str, str]]:
    raw = t.numpy().tobytes()
    header = json.dumps(
        {"inputs": [{"name": name, "datatype": "FP32", "shape": list(t.shape), "parameters": {"binary_data_size": len(raw)}}],
         "outputs": [{"name": "y", "parameters": {"binary_data": binary_output}}]}
    ).encode()
    return header + raw, {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"}


def rank_processes(args: dict[str, Any]) -> dict[str, int]:
    """``{worker class: processes}`` that a serve config's groups start: a pool's ranks, a
    merged pool's colocated processes once, a plain actor one; groups on another group's
    processes (``same_as`` with ``colocate_with``) none of their own."""
    counts: dict[str, int] = {}
    for deployment in args["deployments"]:
        groups = {g["name"]: g for g in deployment["groups"]}
        for group in deployment["groups"]:
            pool = group.get("pool", {})
            if group.get("plain_actor"):
                ranks = 1
            elif "process_on_nodes" in pool:
                ranks = sum(pool["process_on_nodes"])
            elif "merge" in pool:
                ranks = sum(sum(groups[m]["pool"]["process_on_nodes"]) for m in pool["merge"])
            else:
                continue
            counts[group["worker"]] = counts.get(group["worker"], 0) + ranks
    return counts


def cold_start_floor(config: Path) -> Measured:
    """One script starting the processes the config's groups start, with the same imports
    (bench/floor_app.py's start_ranks), in a fresh interpreter, its processes sampled."""
    args = yaml.safe_load(config.read_text())["applications"][0]["args"]
    code = ("import json, sys; from bench.floor_app import start_ranks; "
            "print(start_ranks(json.loads(sys.argv[1])))")
    measured, out = measured_run([sys.executable, "-c", code, json.dumps(rank_processes(args))], ROOT, 600)
    float(out.strip().splitlines()[-1])  # the script's own figure, after its imports
    return measured


def start_milestones(proc: ServeProcess, launched_at: float, ready_at: float) -> dict[str, float]:
    """``cold_start_<milestone>_s`` of ``proc``'s start (bench/start_timeline.py), or none
    where Ray's timeline cannot be read."""
    try:
        found = read_milestones(proc.gcs_address(), launched_at, ready_at)
    except (subprocess.SubprocessError, ValueError, KeyError) as exc:
        print(f"bench: no cold-start milestones ({type(exc).__name__}: {exc})", file=sys.stderr)
        return {}
    return {f"cold_start_{name}_s": seconds for name, seconds in found.items()}


def bench_http(quick: bool, library: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    noop_start, noop_proc = cold_start(noop_only_config(), "/noop/ready")
    noop_proc.kill()
    noop_cold = noop_start.wall_s
    floor = cold_start_floor(CONFIG)
    out["cold_start_floor_s"] = floor.wall_s
    # The cold start of serve_config.yaml as shipped (the bench's own config adds the no-op
    # app, whose build and replica would start beside it).
    launched_at = time.time()
    full_start, shipped = cold_start(CONFIG, "/readyz")
    full_cold = full_start.wall_s
    try:
        out.update(start_milestones(shipped, launched_at, launched_at + full_cold))
    finally:
        shipped.kill()
    # Where the difference lies: the CPU each start's processes spent, by kind.
    out.update(cpu_figures(full_start.sampler.cpu_of_kinds(), floor.sampler.cpu_of_kinds()))
    out["cold_start_machine_busy_fraction"] = full_start.machine_busy_fraction
    out["cold_start_noop_s"] = noop_cold
    out["cold_start_service_s"] = full_cold
    out["cold_start_ratio"] = full_cold / noop_cold
    out["cold_start_floor_ratio"] = full_cold / out["cold_start_floor_s"]
    out.update(served_against_floors(quick, lambda proc, settings: service_figures(proc, quick, library, settings)))
    return out


def served_against_floors(quick: bool, extra: Any = None, config: Path | None = None,
                          add: bool = True, settings: Any = None) -> dict[str, Any]:
    """The floors and the service in whole runs, one at a time: floors, the service on
    HAProxy (with ``extra(proc, settings)``'s figures), the floors again (a full run), the
    service on Serve's proxy. ``add``: the config serves the ``add``'s group (its floor
    runs too); ``settings``: the load generator's (``Settings.for_run(quick)``). The figures (``bench.floor_runs.figures``), the batching
    figures of the HAProxy run, the load generator's settings, and every run's own record
    under ``served_runs``."""
    from bench.floor_runs import Settings, figures, floor_run, service_run

    settings = settings or Settings.for_run(quick)
    config = config or bench_config()
    add_floor = ("add",) if add else ()
    floors = [floor_run(settings, (*add_floor, "infer_plain", "infer_compiled"), scaling=True)]
    services = {"haproxy": service_run("haproxy", config, settings, add=add,
                                       extra=None if extra is None else lambda proc: extra(proc, settings))}
    if not quick:
        floors.append(floor_run(settings, (*add_floor, "infer_plain")))
    services["serve_proxy"] = service_run("serve_proxy", config, settings, add=add)
    out: dict[str, Any] = dict(services["haproxy"].pop("figures", {}))
    out.update(figures(floors, services))
    out.update(batching_figures(services["haproxy"]))
    out["load_generator"] = settings.figures()
    out["served_runs"] = {"floors": floors, "services": services}
    return out


def service_figures(proc: ServeProcess, quick: bool, library: dict[str, Any], settings: Any) -> dict[str, Any]:
    """The service's other figures, on the HAProxy run: the 4-rank ``add`` against the
    no-op route, where its time goes, requests/s of both, uploads, and gRPC."""
    from bench.load_generator import Load, run_load

    out: dict[str, Any] = {}
    n = 100 if quick else 400
    with httpx.Client(base_url=proc.url, timeout=300) as http:
        assert http.get("/noop/ready").status_code == 200
        pids = set()
        for summary in http.get("/v1/groups").json()["groups"]:
            ranks = http.get(f"/v1/groups/{summary['name']}").json().get("ranks", [])
            pids |= {r["pid"] for r in ranks if "pid" in r}
        out["service_worker_processes"] = len(pids)
        # a 4-rank group, as the library floor (execute_all over 4 workers)
        add = lambda: http.post("/v1/groups/gpu_accumulator/add", json={"kwargs": {"x": [1, 1, 1, 1]}})  # noqa: E731
        noop = lambda: http.post("/noop/call", json={"kwargs": {"x": 1}})  # noqa: E731
        adds, noops = interleaved(add, noop, n)
        out["http_add_p50_ms"] = p50(adds) * 1e3
        out["http_noop_p50_ms"] = p50(noops) * 1e3
        floor = out["http_noop_p50_ms"] + library["execute_all_add_p50_ms"]
        out["http_add_floor_ms"] = floor
        out["http_add_ratio"] = out["http_add_p50_ms"] / floor
        # Where an add's milliseconds go: Serve's access logs and Ray's timeline.
        out["http_add_hops"] = breakdown(
            proc, http, "/v1/groups/gpu_accumulator/add", {"kwargs": {"x": [1, 1, 1, 1]}},
            {"ingress": "hybridflow_ingress"},  # the controllers live in the ingress
            "add", n // 2,
        )

        def rps(path: str, document: Any) -> float:
            return run_load(Load.of_json(proc.url, path, document, concurrency=32, processes=settings.processes,
                                         warmup_s=settings.warmup_s, window_s=settings.window_s)).rps

        out["rps_add_32"] = rps("/v1/groups/gpu_accumulator/add", {"kwargs": {"x": [1, 1, 1, 1]}})
        out["rps_noop_32"] = rps("/noop/call", {"kwargs": {"x": 1}})
        out["rps_ratio"] = out["rps_add_32"] / out["rps_noop_32"]
        out.update(bench_tensors(http, quick))
    if proc.grpc_address is not None:  # the Open Inference Protocol over gRPC beside HTTP
        out.update(bench_grpc(proc, quick))
    return out


def bench_tensors(http: httpx.Client, quick: bool) -> dict[str, Any]:
    """Uploads and round trips of one large tensor: safetensors, OIP binary, JSON, against
    the same bytes posted to the no-op route."""
    out: dict[str, Any] = {}
    mib = 16 if quick else 64
    t = torch.rand(mib * (1 << 20) // 4 // 1024, 1, 1024)
    nbytes = t.numel() * 4
    body = safetensors_body("x", t)
    reps = 2 if quick else 3

    def post_noop() -> None:
        http.post("/noop/call", content=body, headers={"Content-Type": "application/octet-stream"})

    def post_safetensors(method: str) -> None:
        r = http.post(f"/v1/groups/test_actor/{method}", content=body,
                      headers={"Content-Type": "application/x-safetensors", "Accept": "application/x-safetensors"})
        r.raise_for_status()

    oip_in = oip_body("x", t, binary_output=False)
    oip_round = oip_body("x", t, binary_output=True)

    def post_oip(model: str, request: tuple[bytes, dict[str, str]]) -> None:
        payload, headers = request
        r = http.post(f"/v2/models/{model}/infer", content=payload, headers=headers)
        r.raise_for_status()

    small = torch.rand(1 << 18)  # 1 MiB as JSON
    json_body = {"args": [{"datatype": "FP32", "shape": [small.numel()], "data": small.tolist()}]}

    def post_json() -> None:
        http.post("/v1/groups/test_actor/echo", json=json_body).raise_for_status()

    mb = nbytes / 1e6
    out["tensor_mib"] = mib
    out["noop_bandwidth_MBps"] = mb / min(timed(post_noop, reps, warmup=1))
    # Upload: the tensor in, its 8-byte checksum out (the no-op route's shape of work).
    out["safetensors_bandwidth_MBps"] = mb / min(timed(lambda: post_safetensors("checksum"), reps, warmup=1))
    out["oip_binary_bandwidth_MBps"] = mb / min(timed(lambda: post_oip("checksum", oip_in), reps, warmup=1))
    # Round trip: the tensor in and back out (twice the bytes over HTTP), per tensor.
    out["safetensors_echo_MBps"] = mb / min(timed(lambda: post_safetensors("echo"), reps, warmup=1))
    out["oip_binary_echo_MBps"] = mb / min(timed(lambda: post_oip("echo", oip_round), reps, warmup=1))
    out["json_1MiB_bandwidth_MBps"] = (small.numel() * 4 / 1e6) / min(timed(post_json, reps, warmup=1))
    out["safetensors_ratio"] = out["safetensors_bandwidth_MBps"] / out["noop_bandwidth_MBps"]
    out["oip_binary_ratio"] = out["oip_binary_bandwidth_MBps"] / out["noop_bandwidth_MBps"]
    return out


def bench_grpc(proc: ServeProcess, quick: bool) -> dict[str, Any]:
    """`mlp` over gRPC beside the HTTP binary path, and the front's share of each path
    (bench/grpc_path.py); a ``grpc_error`` says why a figure is missing."""
    from bench.grpc_path import service_figures

    try:
        return service_figures(proc.url, proc.grpc_address, proc.session_dir(), 20 if quick else 60, "hybridflow")
    except Exception as exc:  # the other figures stand; latest.json says why these are missing
        return {"grpc_error": f"{type(exc).__name__}: {exc}"}


def mlp_batching() -> dict[str, Any]:
    """The shipped `mlp` model's batching settings."""
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    return next(
        m["batching"] for d in config["applications"][0]["args"]["deployments"]
        for m in d.get("models", []) if m["name"] == "mlp"
    )


def batching_figures(service: dict[str, Any]) -> dict[str, Any]:
    """`mlp` (batching) against `mlp_unbatched` (the same layer, a forward per request) on
    one service run (``bench.floor_runs.service_run``): requests/s at ``BATCH_CLIENTS``
    clients, and a lone client's p50 against the unbatched one's plus the longest wait."""
    if "batched" not in service or "unbatched" not in service:
        return {}
    batching = mlp_batching()
    batched, unbatched = service["batched"], service["unbatched"]
    wait_ms = batching["max_queue_delay_microseconds"] / 1e3
    return {
        "batching_clients": BATCH_CLIENTS,
        "batching_shape": list(BATCH_SHAPE),
        "batching_max_batch_size": batching["max_batch_size"],
        "batching_max_wait_ms": wait_ms,
        "batching_rps": batched[f"rps_{BATCH_CLIENTS}"],
        "batching_rps_unbatched": unbatched[f"rps_{BATCH_CLIENTS}"],
        "batching_rps_ratio": batched[f"rps_{BATCH_CLIENTS}"] / unbatched[f"rps_{BATCH_CLIENTS}"],
        "batching_single_p50_ms": batched["lone_p50_ms"],
        "batching_single_p50_unbatched_ms": unbatched["lone_p50_ms"],
        # at most 1.0: one client's p50 no more than the unbatched p50 plus the max wait
        "batching_latency_ratio": batched["lone_p50_ms"] / (unbatched["lone_p50_ms"] + wait_ms),
    }

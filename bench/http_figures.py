"""The served path's figures: the HTTP add against the hand-written floor and the no-op
route, uploads, requests/s, cold start against its floor, gRPC beside HTTP, and batching
(``bench.run`` puts them in latest.json)."""

from __future__ import annotations

import asyncio
import json
import statistics
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


def bench_config() -> Path:
    """serve_config.yaml plus the no-op floor app at /noop, and the `mlp` model again as
    `mlp_unbatched` (the same group and method, no batching: the batching figure's floor)."""
    document = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    app = document["applications"][0]
    app["args"]["max_body_bytes"] = 1 << 30
    for deployment in app["args"]["deployments"]:
        for model in list(deployment.get("models", [])):
            if model["name"] == "mlp":
                unbatched = {key: value for key, value in model.items() if key != "batching"}
                deployment["models"].append({**unbatched, "name": "mlp_unbatched"})
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


async def post_concurrently(url: str, path: str, body: dict, clients: int, seconds: float) -> tuple[int, float]:
    """``clients`` clients posting ``body`` to ``path`` one call after another for
    ``seconds``: the calls they completed, and the seconds that took."""
    done = 0
    deadline = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                response = await client.post(path, json=body)
                response.raise_for_status()
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return done, time.perf_counter() - start


async def _throughput(url: str, path: str, body: dict, clients: int, seconds: float) -> float:
    done, took = await post_concurrently(url, path, body, clients, seconds)
    return done / took


def safetensors_body(name: str, t: torch.Tensor) -> bytes:
    from hybridflow.wire.safetensors_call import encode_safetensors

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


def start_floor_app(ranks: int) -> tuple[subprocess.Popen, str]:
    """The hand-written app (bench/floor_app.py) in a process of its own, ready."""
    from single_controller.rendezvous import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.floor_app", "--port", str(port), "--ranks", str(ranks)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the floor app exited with {proc.returncode}")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the floor app did not answer within 300 s")


def bench_floor(proc: ServeProcess, http: httpx.Client, n: int, seconds: float) -> dict[str, Any]:
    """The service's 8-rank ONE_TO_ALL add against the hand-written app over the same worker
    class and rank count: p50 (alternating rounds) and requests/s at 32 clients."""
    from bench.floor_app import WORKER

    group = "gpu_accumulator_decorator"
    ranks = len(http.get(f"/v1/groups/{group}").json()["ranks"])
    floor, url = start_floor_app(ranks)
    out: dict[str, Any] = {"floor_ranks": ranks, "floor_worker": WORKER}
    try:
        with httpx.Client(base_url=url, timeout=120) as direct:
            service_add = lambda: http.post(f"/v1/groups/{group}/add", json={"kwargs": {"x": 1}}).raise_for_status()  # noqa: E731
            floor_add = lambda: direct.post("/add", json={"x": 1}).raise_for_status()  # noqa: E731
            adds, floors = interleaved(service_add, floor_add, n)
        out["add8_p50_ms"] = p50(adds) * 1e3
        out["floor_add8_p50_ms"] = p50(floors) * 1e3
        out["add8_floor_ratio"] = out["add8_p50_ms"] / out["floor_add8_p50_ms"]
        out["rps_add8_32"] = asyncio.run(
            _throughput(proc.url, f"/v1/groups/{group}/add", {"kwargs": {"x": 1}}, 32, seconds))
        out["rps_floor_32"] = asyncio.run(_throughput(url, "/add", {"x": 1}, 32, seconds))
        out["rps_floor_ratio"] = out["rps_add8_32"] / out["rps_floor_32"]
    finally:
        floor.terminate()
        floor.wait(timeout=60)
    return out


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
    _, proc = cold_start(bench_config(), "/readyz")  # the service the other figures are taken on
    n = 100 if quick else 400
    try:
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

            seconds = 5 if quick else 15
            rps_add = asyncio.run(
                _throughput(proc.url, "/v1/groups/gpu_accumulator/add", {"kwargs": {"x": [1, 1, 1, 1]}}, 32, seconds)
            )
            rps_noop = asyncio.run(_throughput(proc.url, "/noop/call", {"kwargs": {"x": 1}}, 32, seconds))
            out.update(bench_floor(proc, http, n, seconds))
            out["rps_add_32"] = rps_add
            out["rps_noop_32"] = rps_noop
            out["rps_ratio"] = rps_add / rps_noop

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
        out.update(bench_batching(proc.url, quick))
        if proc.grpc_address is not None:  # the Open Inference Protocol over gRPC beside HTTP
            out.update(bench_grpc(proc, quick))
    finally:
        proc.kill()
    return out


def bench_grpc(proc: ServeProcess, quick: bool) -> dict[str, Any]:
    """`mlp` over gRPC beside the HTTP binary path, and the front's share of each path
    (bench/grpc_path.py); a ``grpc_error`` says why a figure is missing."""
    from bench.grpc_path import service_figures

    try:
        return service_figures(proc.url, proc.grpc_address, proc.session_dir(), 20 if quick else 60, "hybridflow")
    except Exception as exc:  # the other figures stand; latest.json says why these are missing
        return {"grpc_error": f"{type(exc).__name__}: {exc}"}


def bench_batching(url: str, quick: bool) -> dict[str, Any]:
    """`mlp` (batching) against `mlp_unbatched` (the same layer, a forward per request):
    requests/s at 16 clients and p50 at one client, binary OIP, windows interleaved."""
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    batching = next(
        m["batching"] for d in config["applications"][0]["args"]["deployments"]
        for m in d.get("models", []) if m["name"] == "mlp"
    )
    x = torch.rand(*BATCH_SHAPE)
    payload, headers = oip_body("x", x, binary_output=True)
    seconds = 6 if quick else 12
    singles = 8 if quick else 32

    async def run() -> dict[str, Any]:
        limits = httpx.Limits(max_connections=BATCH_CLIENTS)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

            async def post(model: str) -> int:
                response = await client.post(f"/v2/models/{model}/infer", content=payload, headers=headers)
                response.raise_for_status()
                size = response.headers.get("inference-header-content-length")
                header = json.loads(response.content[: int(size)] if size else response.content)
                return (header.get("parameters") or {}).get("batch_size", 1)

            async def window(model: str) -> tuple[int, float, list[int]]:
                done, sizes = 0, []
                deadline = time.perf_counter() + seconds

                async def client_loop() -> None:
                    nonlocal done
                    while time.perf_counter() < deadline:
                        sizes.append(await post(model))
                        done += 1

                start = time.perf_counter()
                await asyncio.gather(*(client_loop() for _ in range(BATCH_CLIENTS)))
                return done, time.perf_counter() - start, sizes

            async def single_pairs(lone: dict[str, list[float]]) -> None:
                # One client, the two models in turn request by request, so the machine's
                # drift hits both series alike (in blocks it moved the p50s by milliseconds).
                for _ in range(singles):
                    for model in lone:
                        start = time.perf_counter()
                        await post(model)
                        lone[model].append(time.perf_counter() - start)

            for model in ("mlp", "mlp_unbatched"):
                await post(model)  # warm: spec cached, first forward done
            totals = {m: [0, 0.0] for m in ("mlp", "mlp_unbatched")}
            sizes: list[int] = []
            lone: dict[str, list[float]] = {m: [] for m in ("mlp", "mlp_unbatched")}
            for _ in range(2):  # A B A B: machine noise hits both alike
                for model in ("mlp", "mlp_unbatched"):
                    done, took, seen = await window(model)
                    totals[model][0] += done
                    totals[model][1] += took
                    if model == "mlp":
                        sizes += seen
                await single_pairs(lone)
            return {"totals": totals, "sizes": sizes, "lone": lone}

    measured = asyncio.run(run())
    rps = {m: done / took for m, (done, took) in measured["totals"].items()}
    wait_ms = batching["max_queue_delay_microseconds"] / 1e3
    lone = {m: p50(samples) * 1e3 for m, samples in measured["lone"].items()}
    return {
        "batching_clients": BATCH_CLIENTS,
        "batching_shape": list(BATCH_SHAPE),
        "batching_max_batch_size": batching["max_batch_size"],
        "batching_max_wait_ms": wait_ms,
        "batching_rps": rps["mlp"],
        "batching_rps_unbatched": rps["mlp_unbatched"],
        "batching_rps_ratio": rps["mlp"] / rps["mlp_unbatched"],
        "batching_mean_batch_size": statistics.mean(measured["sizes"]) if measured["sizes"] else None,
        "batching_single_p50_ms": lone["mlp"],
        "batching_single_p50_unbatched_ms": lone["mlp_unbatched"],
        # the same comparison pair by pair (each batched request against the unbatched one
        # sent right after it), which the machine's drift moves less than two p50s
        "batching_single_paired_added_ms": statistics.median(
            (b - u) * 1e3 for b, u in zip(measured["lone"]["mlp"], measured["lone"]["mlp_unbatched"], strict=True)
        ),
        # at most 1.0: one client's p50 no more than the unbatched p50 plus the max wait
        "batching_latency_ratio": lone["mlp"] / (lone["mlp_unbatched"] + wait_ms),
    }

"""Benchmarks: every layer against its floor, as ratios measured side by side in one run.

    make bench                 # full run (< 10 minutes on 2 cores)
    python -m bench.run --quick

Writes bench/results/latest.json (raw numbers and ratios) and bench/results/latest.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch
import yaml

from bench.cold_start import cpu_seconds
from bench.hops import breakdown
from bench.report import write_benchmarks_page
from tests.serve_process import ROOT, ServeProcess

RESULTS = ROOT / "bench" / "results"

#: The batching figure's request: 16 clients, each sending [8, 2, 4096] FP32.
BATCH_CLIENTS, BATCH_SHAPE = 16, (8, 2, 4096)


def p50(samples: list[float]) -> float:
    return statistics.median(samples)


def timed(fn, n: int, warmup: int = 5) -> list[float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def interleaved(first, second, n: int, rounds: int = 5) -> tuple[list[float], list[float]]:
    """``n`` timings of each of two calls, taken in alternating rounds so that machine
    noise hits both alike."""
    a: list[float] = []
    b: list[float] = []
    for _ in range(rounds):
        a += timed(first, n // rounds)
        b += timed(second, n // rounds)
    return a, b


# -- library -----------------------------------------------------------------------


def bench_library(quick: bool) -> dict[str, Any]:
    import ray

    from single_controller.base import Worker
    from single_controller.base.decorator import Dispatch, register
    from single_controller.models.mlp_worker import MLPLayerWorker
    from single_controller.ray import (
        MegatronRayWorkerGroup,
        RayClassWithInitArgs,
        RayResourcePool,
        RayWorkerGroup,
    )

    @ray.remote
    class Plain:
        def m(self, x):
            return x

    @ray.remote
    class Member(Worker):
        @register(Dispatch.ONE_TO_ALL)
        def m(self, x):
            return x

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    out: dict[str, Any] = {}
    n = 200 if quick else 1000
    try:
        actors = [Plain.remote() for _ in range(4)]
        ray.get([a.m.remote(0) for a in actors])
        pool = RayResourcePool([4], use_gpu=False)
        group = RayWorkerGroup(pool, RayClassWithInitArgs(cls=Member))
        raw, lib = interleaved(lambda: ray.get([a.m.remote(1) for a in actors]), lambda: group.m(1), n)
        out["fanout_raw_p50_ms"] = p50(raw) * 1e3
        out["one_to_all_p50_ms"] = p50(lib) * 1e3
        out["one_to_all_ratio"] = out["one_to_all_p50_ms"] / out["fanout_raw_p50_ms"]
        out["execute_all_add_p50_ms"] = p50(timed(lambda: group.execute_all_sync("m", x=[1, 1, 1, 1]), n // 2)) * 1e3
        out.update(bench_loop_vs_thread(group, n // 2))
        # The same group's ONE_TO_ALL through its compiled graph (wg.compile()), beside raw Ray.
        compiled_group = group.compile()
        raw, comp = interleaved(lambda: ray.get([a.m.remote(1) for a in actors]), lambda: compiled_group.m(1), n)
        out["one_to_all_compiled_p50_ms"] = p50(comp) * 1e3
        out["one_to_all_compiled_ratio"] = p50(comp) / p50(raw)
        compiled_group.teardown()  # its ranks poll while it exists (bench_compiled_idle)
        try:
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as inp:
                dag = MultiOutputNode([a.m.bind(inp) for a in actors])
            compiled = dag.experimental_compile()
            cg = timed(lambda: ray.get(compiled.execute(1)), n // 2)
            out["compiled_graph_fanout_p50_ms"] = p50(cg) * 1e3
            out["compiled_graph_ratio_to_raw"] = out["compiled_graph_fanout_p50_ms"] / out["fanout_raw_p50_ms"]
            compiled.teardown()
        except Exception as exc:  # compiled graphs are experimental; report, do not fail
            out["compiled_graph_error"] = f"{type(exc).__name__}: {exc}"
        group.shutdown()
        out.update(bench_colocated_start(pool, Member))
        out.update(bench_tensor_returns(pool, n))

        # MEGATRON_COMPUTE: tp=4 MLP forward against single-process torch
        seq, batch, hidden, ffn = (128, 4, 4096, 11008) if quick else (512, 4, 4096, 11008)
        layer = MegatronRayWorkerGroup(
            pool, RayClassWithInitArgs(cls=MLPLayerWorker),
            default_megatron_kwargs={"tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 1},
        )
        config = {"hidden_size": hidden, "intermediate_size": ffn, "hidden_act": "silu", "pretraining_tp": 1}
        layer.init_model(config)
        shards = layer.get_weights()
        gate = torch.cat([s["gate_up_proj.weight"].chunk(2)[0] for s in shards])
        up = torch.cat([s["gate_up_proj.weight"].chunk(2)[1] for s in shards])
        down = torch.cat([s["down_proj.weight"] for s in shards], dim=1)
        del shards
        x = torch.rand(seq, batch, hidden)
        reps = 2 if quick else 3

        def single() -> torch.Tensor:
            with torch.no_grad():
                return torch.nn.functional.linear(
                    torch.nn.functional.silu(torch.nn.functional.linear(x, gate))
                    * torch.nn.functional.linear(x, up),
                    down,
                )

        puts_before = layer.object_store_puts
        tp_times, single_times = [], []
        for _ in range(reps):
            tp_times += timed(lambda: layer.run_layer([x]), 1, warmup=0)
            single_times += timed(single, 1, warmup=0)
        (y,) = layer.run_layer([x])
        out["mlp_shape"] = [seq, batch, hidden, ffn]
        out["mlp_tp4_s"] = min(tp_times)
        out["mlp_single_process_s"] = min(single_times)
        out["mlp_ratio"] = out["mlp_tp4_s"] / out["mlp_single_process_s"]
        out["mlp_rel_err"] = float((y - single()).norm() / single().norm())
        out["megatron_compute_puts_per_call"] = (layer.object_store_puts - puts_before) / (reps + 1)
        out.update(bench_batching_bound(layer))
        out["megatron_compute_dp_size"] = layer.dp_size
        layer.shutdown()
        out.update(bench_compiled_idle(pool, Member))  # last: it leaves prestarted idle workers
        pool.remove()
    finally:
        ray.shutdown()
    return out


def idle_cores(pids: list[int], seconds: float = 3.0) -> float | None:
    """Cores the processes ``pids`` (on this node) kept busy over ``seconds`` of the
    driver doing nothing, from ``/proc``; None where there is no ``/proc``."""

    def cpu_s() -> float:
        return sum(cpu_seconds(Path(f"/proc/{pid}/stat").read_text()) for pid in pids)

    try:
        before = cpu_s()
        time.sleep(seconds)
        return (cpu_s() - before) / seconds
    except OSError:
        return None


def bench_compiled_idle(pool: Any, worker_cls: Any) -> dict[str, float | None]:
    """What a compiled graph costs while nobody calls it: the cores a group's ranks keep
    busy with the graph compiled (after one call), then after its teardown."""
    from single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

    group = RayWorkerGroup(pool, RayClassWithInitArgs(cls=worker_cls))
    try:
        pids = [info["pid"] for info in group.rank_info()]
        compiled = group.compile()
        compiled.m(1)
        out = {"compiled_idle_cores": idle_cores(pids)}
        compiled.teardown()
        out["plain_idle_cores"] = idle_cores(pids)
        return out
    finally:
        group.shutdown()


def bench_batching_bound(layer: Any) -> dict[str, float]:
    """The most any batcher could gain on this machine, HTTP left out: a ``BATCH_SHAPE``
    request's forward alone, against its share of one forward of ``BATCH_CLIENTS`` of them
    concatenated (a full batch). Where the forward is bound by arithmetic rather than by
    reading the weights, this is far below ``BATCH_CLIENTS``."""
    lone = torch.rand(*BATCH_SHAPE)
    full = torch.cat([lone] * BATCH_CLIENTS, dim=1)
    lone_s = p50(timed(lambda: layer.run_layer([lone]), 5, warmup=1))
    full_s = p50(timed(lambda: layer.run_layer([full]), 3, warmup=1))
    return {
        "layer_forward_lone_ms": lone_s * 1e3,
        "layer_forward_full_batch_ms": full_s * 1e3,
        "batching_forward_bound": lone_s * BATCH_CLIENTS / full_s,
    }


def bench_loop_vs_thread(group: Any, n: int) -> dict[str, float]:
    """A group call from an event loop, as the controller makes it: submitted, then its
    futures awaited on the loop, against the earlier design's blocking call in a thread
    (``asyncio.to_thread``, one per call)."""
    from hybridflow.control.supervisor import as_asyncio

    async def on_loop() -> Any:
        pending = group.submit("m", (1,))
        return pending.collect(await asyncio.gather(*as_asyncio(pending.futures)))

    async def in_thread() -> Any:
        return await asyncio.to_thread(group.m, 1)

    async def measure() -> tuple[list[float], list[float]]:
        loop_s, thread_s = [], []
        for _ in range(5):
            for fn, samples in ((on_loop, loop_s), (in_thread, thread_s)):
                for i in range(n // 5 + 2):
                    start = time.perf_counter()
                    await fn()
                    if i >= 2:  # the first two warm the path
                        samples.append(time.perf_counter() - start)
        return loop_s, thread_s

    loop_s, thread_s = asyncio.run(measure())
    return {
        "group_call_on_loop_p50_ms": p50(loop_s) * 1e3,
        "group_call_in_thread_p50_ms": p50(thread_s) * 1e3,
        "group_call_loop_over_thread": p50(loop_s) / p50(thread_s),
    }


def bench_tensor_returns(pool: Any, n: int) -> dict[str, float]:
    """ONE_TO_ALL of a number to which every rank answers a one-element tensor: a default
    group against one whose ranks send tensors out of band (``send_tensors_out_of_band()``,
    as the service's groups do), calls interleaved."""
    import ray

    from single_controller.base import Worker
    from single_controller.base.decorator import Dispatch, register
    from single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

    # A class of its own: its ranks load torch (it refers to it), the other bench classes' do not.
    @ray.remote
    class OneElement(Worker):
        @register(Dispatch.ONE_TO_ALL)
        def one_element(self, x):
            return torch.full((1,), float(x))  # the tutorial's add answers so

    out_of_band_cls = RayClassWithInitArgs(cls=OneElement)
    out_of_band_cls.send_tensors_out_of_band()
    default = RayWorkerGroup(pool, RayClassWithInitArgs(cls=OneElement))
    out_of_band = RayWorkerGroup(pool, out_of_band_cls)
    try:
        assert [t.tolist() for t in out_of_band.one_element(2)] == [[2.0]] * pool.world_size
        plain, band = interleaved(lambda: default.one_element(1), lambda: out_of_band.one_element(1), n)
    finally:
        default.shutdown()
        out_of_band.shutdown()
    return {
        "tensor_return_p50_ms": p50(plain) * 1e3,
        "tensor_return_out_of_band_p50_ms": p50(band) * 1e3,
        "tensor_return_ratio": p50(band) / p50(plain),
    }


def bench_colocated_start(pool: Any, worker_cls: Any, roles: int = 2) -> dict[str, float]:
    """Start ``roles`` worker classes on one pool: a group each, against one colocated
    group (one process per bundle holding every role) then spawned per role."""
    from single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
    from single_controller.ray.colocated import create_colocated_worker_cls

    start = time.perf_counter()
    separate = [RayWorkerGroup(pool, RayClassWithInitArgs(cls=worker_cls)) for _ in range(roles)]
    separate_s = time.perf_counter() - start
    for group in separate:
        group.shutdown()
    start = time.perf_counter()
    fused = RayWorkerGroup(
        pool, create_colocated_worker_cls({f"role{i}": RayClassWithInitArgs(cls=worker_cls) for i in range(roles)})
    )
    spawned = fused.spawn(prefix_set=[f"role{i}" for i in range(roles)])
    assert all(g.m(1) == [1] * pool.world_size for g in spawned.values())
    colocated_s = time.perf_counter() - start
    fused.shutdown()
    return {
        "start_separate_groups_s": separate_s,
        "start_colocated_s": colocated_s,
        "colocated_start_ratio": colocated_s / separate_s,
        "colocated_roles": roles,
    }


def bench_durable_call(quick: bool) -> dict[str, Any]:
    """The p50 of a mutating call (``add`` on a 4-rank GPUAccumulator group) through the
    controller (journal, store, acknowledgement; no HTTP) with the durable SQLite store
    against the in-memory one, with and without an Idempotency-Key (its answer is
    recorded too): two controllers side by side in one Ray cluster, calls interleaved."""
    import shutil
    import tempfile

    import ray

    from hybridflow.config import load_config
    from hybridflow.control.builder import PoolSet, units
    from hybridflow.control.contract import CallRequest
    from hybridflow.control.controller import GroupController
    from hybridflow.control.placement import GpuBudget, plan_deployment

    group = {"name": "gpu_accumulator", "worker": "single_controller.models.tutorial_workers:GPUAccumulator",
             "read_only": ["get_value"]}
    # On the checkout's disk, as .hybridflow/state.db would be.
    directory = tempfile.mkdtemp(prefix="bench-state-", dir=ROOT)
    n = 400 if quick else 2000
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)

    async def run() -> dict[str, Any]:
        controllers = {}
        for name, path in (("memory", None), ("sqlite", f"{directory}/state.db")):
            pool = {"process_on_nodes": [4], "name_prefix": name}  # placement groups of its own
            config = load_config({"use_gpu": False, "deployments": [{"name": name, "groups": [{**group, "pool": pool}]}],
                                  "state": {"path": path}})
            deployment = config.deployments[0]
            plan = plan_deployment(deployment, config, GpuBudget(0))
            controller = GroupController(deployment, plan, units(deployment, plan, PoolSet(plan)), state=config.state)
            await controller.open()
            await controller.start()
            controllers[name] = controller
        samples: dict[str, list[float]] = {f"{name}{keyed}": [] for name in controllers for keyed in ("", "_key")}
        calls = 0

        async def add(name: str, keyed: str) -> None:
            nonlocal calls
            calls += 1
            key = f"bench-{calls}" if keyed else None
            request = CallRequest("gpu_accumulator", "add", kwargs={"x": [1, 1, 1, 1]}, idempotency_key=key,
                                  fingerprint=key)
            start = time.perf_counter()
            result = await controllers[name].call(request)
            samples[f"{name}{keyed}"].append(time.perf_counter() - start)
            assert result.error is None, result.error

        async def one_of_each() -> None:  # interleaved, so machine noise hits every series alike
            for name in controllers:
                await add(name, "")
                await add(name, "_key")

        for _ in range(20):
            await one_of_each()
        for values in samples.values():
            values.clear()
        for _ in range(n):
            await one_of_each()
        for controller in controllers.values():
            controller.shutdown()
        return {series: p50(values) * 1e3 for series, values in samples.items()}

    try:
        p50s = asyncio.run(run())
    finally:
        ray.shutdown()
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "state_memory_add_p50_ms": p50s["memory"],
        "state_sqlite_add_p50_ms": p50s["sqlite"],
        "state_added_p50_ms": p50s["sqlite"] - p50s["memory"],
        "state_ratio": p50s["sqlite"] / p50s["memory"],
        "state_memory_add_key_p50_ms": p50s["memory_key"],
        "state_sqlite_add_key_p50_ms": p50s["sqlite_key"],
        "state_added_key_p50_ms": p50s["sqlite_key"] - p50s["memory_key"],
        "state_calls_per_series": n,
    }


# -- HTTP --------------------------------------------------------------------------


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


def cold_start(config: Path, ready_path: str) -> tuple[float, ServeProcess]:
    proc = ServeProcess(config=config)
    start = time.perf_counter()
    proc.start(timeout_s=600, ready_path=ready_path)
    return time.perf_counter() - start, proc


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


def cold_start_floor(config: Path) -> float:
    """Seconds for one script to start the processes the config's groups start, with the
    same imports (bench/floor_app.py's start_ranks), in a fresh interpreter."""
    args = yaml.safe_load(config.read_text())["applications"][0]["args"]
    code = ("import json, sys; from bench.floor_app import start_ranks; "
            "print(start_ranks(json.loads(sys.argv[1])))")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, json.dumps(rank_processes(args))], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=True)
    float(done.stdout.strip().splitlines()[-1])  # the script's own figure, after its imports
    return time.perf_counter() - started


def bench_http(quick: bool, library: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    noop_cold, noop_proc = cold_start(noop_only_config(), "/noop/ready")
    noop_proc.stop()
    out["cold_start_floor_s"] = cold_start_floor(bench_config())
    full_cold, proc = cold_start(bench_config(), "/readyz")
    out["cold_start_noop_s"] = noop_cold
    out["cold_start_service_s"] = full_cold
    out["cold_start_ratio"] = full_cold / noop_cold
    out["cold_start_floor_ratio"] = full_cold / out["cold_start_floor_s"]
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
            from bench.grpc_path import grpc_vs_http

            try:
                out.update(grpc_vs_http(proc.url, proc.grpc_address, n=20 if quick else 60, application="hybridflow"))
            except Exception as exc:  # the other figures stand; latest.json says why this one is missing
                out["grpc_error"] = f"{type(exc).__name__}: {exc}"
    finally:
        proc.stop()
    return out


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


TARGETS = {
    "add8_floor_ratio": ("HTTP add, 8 ranks / hand-written FastAPI app p50", 1.5, "max"),
    "grpc_over_http": ("mlp infer p50: gRPC / HTTP binary", 1.0, "max"),
    "weight_sync_vs_floor": ("weight sync tp4->tp2 / one ray.get of the full model", 1.0, "max"),
    "weight_sync_bytes_fraction_of_full": ("bytes per destination rank / full model (tp4->tp2)", 0.5, "max"),
    "rps_floor_ratio": ("add rps / hand-written app rps (32 clients)", 0.67, "min"),
    "cold_start_floor_ratio": ("cold start / one script starting the same processes", 1.3, "max"),
    "one_to_all_ratio": ("ONE_TO_ALL / raw fan-out p50", 1.15, "max"),
    "one_to_all_compiled_ratio": ("ONE_TO_ALL compiled / raw fan-out p50", 1.0, "max"),
    "http_add_ratio": ("HTTP add / (no-op route + library)", 1.3, "max"),
    "safetensors_ratio": ("safetensors bandwidth / no-op", 0.5, "min"),
    "oip_binary_ratio": ("OIP binary bandwidth / no-op", 0.5, "min"),
    "mlp_ratio": ("tp=4 MLP / single-process torch", 1.3, "max"),
    "rps_ratio": ("add rps / no-op rps (32 clients)", 0.5, "min"),
    "cold_start_ratio": ("cold start / no-op app", 3.0, "max"),
    "state_added_p50_ms": ("durable store: added ms per mutating call (p50)", 1.0, "max"),
    "batching_rps_ratio": ("mlp rps, 16 clients: batched / unbatched", 4.0, "min"),
    "batching_latency_ratio": ("mlp p50, 1 client: batched / (unbatched + wait)", 1.0, "max"),
}


#: Each figure's raw numbers, as the PNG and the JSON's targets show them beside the ratio.
RAW = {
    "add8_floor_ratio": "{add8_p50_ms:.1f} vs {floor_add8_p50_ms:.1f} ms",
    "grpc_over_http": "{grpc_mlp_p50_ms:.1f} vs {http_mlp_p50_ms:.1f} ms",
    "weight_sync_vs_floor": "{weight_sync_p50_s:.3f} vs {weight_sync_floor_full_get_p50_s:.3f} s",
    "weight_sync_bytes_fraction_of_full": "of {weight_sync_full_mib:.0f} MiB",
    "rps_floor_ratio": "{rps_add8_32:.0f} vs {rps_floor_32:.0f} requests/s",
    "cold_start_floor_ratio": "{cold_start_service_s:.0f} vs {cold_start_floor_s:.0f} s",
    "one_to_all_ratio": "{one_to_all_p50_ms:.2f} vs {fanout_raw_p50_ms:.2f} ms",
    "one_to_all_compiled_ratio": "{one_to_all_compiled_p50_ms:.2f} vs {fanout_raw_p50_ms:.2f} ms",
    "http_add_ratio": "{http_add_p50_ms:.1f} vs {http_noop_p50_ms:.1f} + {execute_all_add_p50_ms:.1f} ms",
    "safetensors_ratio": "{safetensors_bandwidth_MBps:.0f} vs {noop_bandwidth_MBps:.0f} MB/s",
    "oip_binary_ratio": "{oip_binary_bandwidth_MBps:.0f} vs {noop_bandwidth_MBps:.0f} MB/s",
    "mlp_ratio": "{mlp_tp4_s:.2f} vs {mlp_single_process_s:.2f} s",
    "rps_ratio": "{rps_add_32:.0f} vs {rps_noop_32:.0f} requests/s",
    "cold_start_ratio": "{cold_start_service_s:.0f} vs {cold_start_noop_s:.1f} s",
    "batching_rps_ratio": "{batching_rps:.1f} vs {batching_rps_unbatched:.1f} requests/s; "
                          "forward alone bounds it at {batching_forward_bound:.1f}x",
    "batching_latency_ratio": "{batching_single_p50_ms:.0f} vs {batching_single_p50_unbatched_ms:.0f} + "
                              "{batching_max_wait_ms:g} ms; paired +{batching_single_paired_added_ms:.1f} ms",
}


def raw_numbers(key: str, results: dict[str, Any]) -> str:
    try:
        return RAW[key].format_map(results)
    except (KeyError, ValueError, TypeError):
        return ""


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in TARGETS if k in results and k.endswith("_ratio")]  # ratios only: one axis
    fig, ax = plt.subplots(figsize=(12, 6))
    values = [results[k] for k in keys]
    colors = [
        "tab:green" if (results[k] <= TARGETS[k][1] if TARGETS[k][2] == "max" else results[k] >= TARGETS[k][1]) else "tab:red"
        for k in keys
    ]
    ax.barh([TARGETS[k][0] for k in keys], values, color=colors)
    for i, k in enumerate(keys):
        ax.plot([TARGETS[k][1]] * 2, [i - 0.4, i + 0.4], color="black", linewidth=2)
        ax.text(values[i], i, f" {values[i]:.2f}x  ({raw_numbers(k, results)})", va="center", fontsize=8)
    ax.set_xlim(0, max(values + [t[1] for t in TARGETS.values()]) * 1.6)
    ax.set_xlabel("ratio to floor (black bar: target; green: met)")
    ax.set_title(f"hybridflow-serve benchmarks ({results['machine']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer samples and smaller tensors")
    parser.add_argument("--skip-http", action="store_true", help="library figures only")
    options = parser.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # A compiled graph's read gives up after 10 s by default; a loaded 2-core machine can
    # stall a round that long, which is noise to measure, not a failure.
    os.environ.setdefault("RAY_CGRAPH_get_timeout", "120")
    results: dict[str, Any] = {
        "quick": options.quick,
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, torch {torch.__version__}",
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    started = time.perf_counter()
    results.update(bench_library(options.quick))
    results.update(bench_durable_call(options.quick))
    from bench.weight_sync import bench_weight_sync

    results.update(bench_weight_sync(options.quick))
    if not options.skip_http:
        results.update(bench_http(options.quick, results))
    results["bench_seconds"] = time.perf_counter() - started
    for key, (label, target, kind) in TARGETS.items():
        if key in results:
            met = results[key] <= target if kind == "max" else results[key] >= target
            results.setdefault("targets", {})[key] = {
                "label": label, "target": target, "value": results[key], "met": met, "raw": raw_numbers(key, results),
            }
    (RESULTS / "latest.json").write_text(json.dumps(results, indent=2))
    plot(results, RESULTS / "latest.png")
    write_benchmarks_page(results, ROOT / "docs" / "benchmarks.md")  # the page is generated, not edited
    for key, entry in results.get("targets", {}).items():
        print(f"{entry['label']:50s} {entry['value']:8.3f}  target {'<=' if TARGETS[key][2] == 'max' else '>='} "
              f"{entry['target']}  {'met' if entry['met'] else 'MISSED'}  ({entry['raw']})")
    print(json.dumps({k: v for k, v in results.items() if k != "targets"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The library's figures: dispatch against plain Ray calls, compiled graphs, the tp layer
against one process, colocated starts, tensor returns and the durable store's cost per
call (``bench.run`` puts them in latest.json)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from bench.cold_start import cpu_seconds
from bench.timing import interleaved, p50, timed
from tests.serve_process import ROOT

#: The batching figure's request: 16 clients, each sending [8, 2, 4096] FP32.
BATCH_CLIENTS, BATCH_SHAPE = 16, (8, 2, 4096)


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
        out.update(bench_transports(pool, Member, n))
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


async def alternating_rounds(calls: list[Callable[[], Awaitable[Any]]], n: int) -> list[list[float]]:
    """About ``n`` timings of each coroutine function, taken in five alternating rounds (so
    machine noise hits each alike), the first two calls of each round left out (they warm
    the path): one list of seconds per function."""
    timings: list[list[float]] = [[] for _ in calls]
    for _ in range(5):
        for call, samples in zip(calls, timings, strict=True):
            for i in range(n // 5 + 2):
                start = time.perf_counter()
                await call()
                if i >= 2:
                    samples.append(time.perf_counter() - start)
    return timings


def bench_transports(pool: Any, worker_cls: Any, n: int) -> dict[str, float | None]:
    """The controller's three transports to a group's ranks (``transport: tasks``,
    ``socket`` and ``compiled``), as it uses them from its event loop: a ONE_TO_ALL call's
    p50 over a Ray task per rank, over the group's socket channel (``SocketChannel``) and
    over its compiled graph (``GraphChannel``), in alternating rounds, and the cores the
    ranks keep busy while idle with each."""
    from hybridflow.control.rank_answers import rank_outcomes
    from single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

    group = RayWorkerGroup(pool, RayClassWithInitArgs(cls=worker_cls))
    try:
        pids = [info["pid"] for info in group.rank_info()]
        out: dict[str, float | None] = {"transport_tasks_idle_cores": idle_cores(pids)}
        sockets = group.socket_channel()
        out["transport_socket_idle_cores"] = idle_cores(pids)
        graph = group.graph_channel()

        async def call(caller: Any) -> Any:
            pending = caller.submit("m", (1,))
            return pending.collect([o.value for o in await rank_outcomes(pending.futures, None)])

        async def rounds() -> list[list[float]]:
            return await alternating_rounds([lambda: call(group), lambda: call(sockets), lambda: call(graph)], n)

        tasks_s, socket_s, compiled_s = asyncio.run(rounds())
        out["transport_compiled_idle_cores"] = idle_cores(pids)
        graph.teardown()
        sockets.teardown()
        out.update(transport_tasks_p50_ms=p50(tasks_s) * 1e3, transport_socket_p50_ms=p50(socket_s) * 1e3,
                   transport_compiled_p50_ms=p50(compiled_s) * 1e3,
                   transport_socket_over_tasks=p50(socket_s) / p50(tasks_s),
                   transport_compiled_over_tasks=p50(compiled_s) / p50(tasks_s))
        return out
    finally:
        group.shutdown()


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

    loop_s, thread_s = asyncio.run(alternating_rounds([on_loop, in_thread], n))
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

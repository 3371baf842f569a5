"""The weight sync's collective path on one GPU node, without Ray: GB/s beside the card's
device-to-device copy.

    python examples/weight_sync_gpu.py                          # 4096 x 11008, tp4 -> tp2
    python examples/weight_sync_gpu.py --hidden 1024 --ffn 4096 --rounds 3
    python examples/weight_sync_gpu.py --device cpu --hidden 64 --ffn 128   # dry run on gloo

Source and destination ranks are processes (torch.multiprocessing), each holding its
shards of the MLP layer (gate, up, down; float32). Every round, the destination ranks
receive their overlapping slices into fresh staged shards over a process group of the
ranks involved, built the way ``single_controller.weights`` builds it (``open_group``,
``send_slices``, ``recv_slices``, the same planner), and check them against the values
they should hold.

NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"), so:

- with 2 or more GPUs, source ranks sit on the first half of the GPUs and destination
  ranks on the second half, and the NCCL path runs between processes;
- with 1 GPU, the script tries NCCL between two processes on it and reports what NCCL
  answers; then it moves the plan's slices through NCCL's send and receive within one
  process (a world of one, each slice sent to itself: NCCL's copy kernels on the card),
  and runs the library's send and receive code over a loopback group in one process
  (the transfer a device-to-device copy), which measures everything of the path but
  NCCL's wire: slicing, staging, the copies.

Prints one JSON document (also to ``--out``): GPUs found, NCCL version, the d2d copy's
GB/s (and GPU 0 to GPU 1's with two GPUs), each measured path's seconds and GB/s (bytes
the destination ranks received, all together, over the round's time), bytes per
destination rank against the full model's, and any error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from single_controller.weights.collective import (  # noqa: E402
    CollectiveRanks,
    TransferGroup,
    close_group,
    host_store,
    open_group,
    recv_slices,
    send_slices,
)
from single_controller.weights.layout import ParamSpec, RankWeights, WeightLayout, box_slices  # noqa: E402
from single_controller.weights.plan import ReshardPlan, plan_resharding  # noqa: E402
from single_controller.weights.transport import choose_transport  # noqa: E402

GB = 1e9


def layouts(hidden: int, ffn: int, src_tp: int, dst_tp: int, src_gpus: list[str], dst_gpus: list[str], device: str):
    params = (
        ParamSpec("gate_proj", (ffn, hidden), split_dim=0),
        ParamSpec("up_proj", (ffn, hidden), split_dim=0),
        ParamSpec("down_proj", (hidden, ffn), split_dim=1),
    )

    def one(tp: int, keys: list[str]) -> WeightLayout:
        return WeightLayout.of(
            RankWeights(rank=r, tp_rank=r, tp_size=tp, params=params, device=device, device_key=keys[r])
            for r in range(tp)
        )

    return one(src_tp, src_gpus), one(dst_tp, dst_gpus)


def values(box, device: torch.device) -> torch.Tensor:
    """The full tensors' values on ``box``, from the element's index alone: any rank can
    make any part, and a received slice can be checked exactly."""
    (r0, r1), (c0, c1) = box
    rows = torch.arange(r0, r1, device=device, dtype=torch.int64)[:, None]
    cols = torch.arange(c0, c1, device=device, dtype=torch.int64)[None, :]
    return ((rows * 7919 + cols * 104729) % 65521).to(torch.float32) / 65521


def shards(layout: WeightLayout, rank: int, device: torch.device, empty: bool = False) -> dict[str, torch.Tensor]:
    held = layout.ranks[rank]
    if empty:
        return {p.name: torch.empty(held.shard_shape(p.name), device=device) for p in held.params}
    return {p.name: values(held.box(p.name), device) for p in held.params}


def _barrier(store: Any, key: str, size: int) -> None:
    store.add(key, 1)
    while store.add(key, 0) < size:
        time.sleep(0.0005)


def rank_main(index: int, setup: dict[str, Any]) -> None:
    """One process: collective rank ``index`` (sources first, then destinations)."""
    plan: ReshardPlan = setup["plan"]
    src_layout, dst_layout = setup["layouts"]
    ranks = CollectiveRanks.of(plan)
    is_src = index < len(ranks.src)
    role_rank = plan.src_ranks[index] if is_src else index - len(ranks.src)
    device = torch.device(setup["devices"][index])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = TransferGroup("bench", setup["addr"], setup["port"], setup["backend"], setup["timeout_s"])
    store = torch.distributed.TCPStore(group.addr, group.port, is_master=False, timeout=timedelta(seconds=group.timeout_s))
    results = torch.distributed.PrefixStore("results/", store)
    try:
        pg = open_group(group, index, ranks.size)
        held = shards(src_layout, role_rank, device) if is_src else None
        for round_ in range(setup["rounds"] + 1):  # round 0 warms NCCL's communicators up
            _barrier(store, f"round{round_}", ranks.size)
            started = time.perf_counter()
            if is_src:
                send_slices(pg, plan, role_rank, held, ranks)
            else:
                staged = shards(dst_layout, role_rank, device, empty=True)
                recv_slices(pg, plan, role_rank, staged, ranks)
            elapsed = time.perf_counter() - started
            if not is_src:
                want = shards(dst_layout, role_rank, device)
                if not all(torch.equal(staged[k], want[k]) for k in want):
                    raise AssertionError(f"destination rank {role_rank} received wrong values in round {round_}")
            results.set(f"{round_}/{index}", str(elapsed))
        close_group(pg)
    except Exception:
        results.set(f"error/{index}", traceback.format_exc())
        raise


def run_processes(setup: dict[str, Any], size: int, timeout_s: float) -> dict[str, Any]:
    """Spawn the ranks, wait for them (killing them past ``timeout_s``), and read back each
    round's slowest rank."""
    store = host_store("127.0.0.1", timeout_s)
    setup = {**setup, "addr": "127.0.0.1", "port": store.port, "timeout_s": timeout_s}
    results = torch.distributed.PrefixStore("results/", store)
    context = mp.start_processes(rank_main, args=(setup,), nprocs=size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s + 60
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks still running after {timeout_s + 60:.0f} s")
    except Exception as exc:
        for process in context.processes:
            if process.is_alive():
                process.kill()
        errors = [results.get(f"error/{i}").decode() for i in range(size) if results.check([f"error/{i}"])]
        # the end of each rank's own traceback (NCCL's reason is there), not all of it
        return {"error": type(exc).__name__, "rank_errors": ["\n".join(e.strip().splitlines()[-4:]) for e in errors]}
    rounds = [max(float(results.get(f"{r}/{i}")) for i in range(size)) for r in range(1, setup["rounds"] + 1)]
    return {"round_seconds": rounds, "seconds_p50": statistics.median(rounds)}


class _Done:
    def wait(self) -> bool:
        return True


class LoopbackGroup:
    """A process group in one process: a send leaves its tensor, the matching receive
    copies it (on one GPU, a device-to-device copy). For the single-GPU measurement."""

    def __init__(self) -> None:
        self.sent: dict[int, torch.Tensor] = {}

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> _Done:
        self.sent[tag] = tensors[0]
        return _Done()

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> _Done:
        tensors[0].copy_(self.sent.pop(tag))
        return _Done()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def loopback(
    plan: ReshardPlan, src_layout: WeightLayout, dst_layout: WeightLayout, rounds: int, device: torch.device
) -> dict[str, Any]:
    ranks = CollectiveRanks.of(plan)
    held = {r: shards(src_layout, r, device) for r in plan.src_ranks}
    times = []
    for round_ in range(rounds + 1):
        _sync(device)
        started = time.perf_counter()
        pg = LoopbackGroup()
        for r in plan.src_ranks:
            send_slices(pg, plan, r, held[r], ranks)
        staged = [shards(dst_layout, d, device, empty=True) for d in range(plan.dst_world)]
        for d in range(plan.dst_world):
            recv_slices(pg, plan, d, staged[d], ranks)
        _sync(device)
        if round_:
            times.append(time.perf_counter() - started)
    for d in range(plan.dst_world):
        want = shards(dst_layout, d, device)
        if not all(torch.equal(staged[d][k], want[k]) for k in want):
            raise AssertionError(f"loopback: destination rank {d} received wrong values")
    return {"round_seconds": times, "seconds_p50": statistics.median(times)}


def nccl_self_loop(
    plan: ReshardPlan, src_layout: WeightLayout, dst_layout: WeightLayout, rounds: int
) -> dict[str, Any]:
    """The plan's slices through NCCL's own send and receive on one GPU: one process, a
    world of one, each slice sent to itself (NCCL pairs a rank's send and receive to
    itself inside one group call). NCCL's copy kernels, without a second process."""
    import torch.distributed as dist

    from single_controller.rendezvous import free_port

    device = torch.device("cuda", 0)
    try:
        if not dist.is_initialized():
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        held = {r: shards(src_layout, r, device) for r in plan.src_ranks}
        times = []
        for round_ in range(rounds + 1):
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            staged = [shards(dst_layout, d, device, empty=True) for d in range(plan.dst_world)]
            ops, copies = [], []
            for t in plan.transfers():
                piece = held[t.src_rank][t.param][box_slices(t.src_slice)].contiguous()
                buffer = torch.empty_like(piece)
                ops += [dist.P2POp(dist.isend, piece, 0), dist.P2POp(dist.irecv, buffer, 0)]
                copies.append((staged[t.dst_rank][t.param][box_slices(t.dst_slice)], buffer))
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            for target, buffer in copies:
                target.copy_(buffer)
            torch.cuda.synchronize(device)
            if round_:
                times.append(time.perf_counter() - started)
        for d in range(plan.dst_world):
            want = shards(dst_layout, d, device)
            if not all(torch.equal(staged[d][k], want[k]) for k in want):
                raise AssertionError(f"NCCL self-loop: destination rank {d} received wrong values")
        return {"round_seconds": times, "seconds_p50": statistics.median(times)}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _self_loop_main(plan: ReshardPlan, src_layout: WeightLayout, dst_layout: WeightLayout, rounds: int, out: Any) -> None:
    out.put(nccl_self_loop(plan, src_layout, dst_layout, rounds))


def nccl_self_loop_bounded(
    plan: ReshardPlan, src_layout: WeightLayout, dst_layout: WeightLayout, rounds: int, timeout_s: float
) -> dict[str, Any]:
    """:func:`nccl_self_loop` in a process of its own, killed past ``timeout_s`` (a
    communicator that waits for a peer that never comes would otherwise hang here)."""
    context = mp.get_context("spawn")
    out = context.Queue()
    process = context.Process(target=_self_loop_main, args=(plan, src_layout, dst_layout, rounds, out))
    process.start()
    try:
        return out.get(timeout=timeout_s)
    except Exception:
        return {"error": f"no answer in {timeout_s:.0f} s (killed)"}
    finally:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()


def copy_gbps(nbytes: int, src: torch.device, dst: torch.device, rounds: int = 10) -> float:
    """Bytes per second of ``dst_buffer.copy_(src_buffer)`` (each byte read once, written once)."""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device=src).fill_(1.0)
    b = torch.empty_like(a, device=dst)
    b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times) / GB


def _nccl_version() -> str:
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--src-tp", type=int, default=4)
    parser.add_argument("--dst-tp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a process group waits for its ranks")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "gpus": gpus,
        "gpu_name": torch.cuda.get_device_name(0) if gpus else None,
        "nccl_version": _nccl_version() if gpus else None,
        "layer": f"{args.hidden}x{args.ffn} tp{args.src_tp}->tp{args.dst_tp}",
    }
    if args.device == "cuda" and not gpus:
        report["error"] = "no GPU visible (torch.cuda.device_count() == 0); --device cpu runs the gloo dry run"
        print(json.dumps(report, indent=2))
        return 1
    size = args.src_tp + args.dst_tp
    if gpus >= 2:  # sources on the first half of the GPUs, destinations on the second
        half = gpus // 2
        src_dev = [f"cuda:{r % half}" for r in range(args.src_tp)]
        dst_dev = [f"cuda:{half + r % (gpus - half)}" for r in range(args.dst_tp)]
    else:  # one GPU (or the CPU dry run): every rank on it
        only = "cuda:0" if gpus else "cpu"
        src_dev, dst_dev = [only] * args.src_tp, [only] * args.dst_tp
    kind = "cuda" if gpus else "cpu"
    # a GPU's key names it to the planner ("" on CPU, where nothing is shared)
    src_keys, dst_keys = ([d if gpus else "" for d in devs] for devs in (src_dev, dst_dev))
    src_layout, dst_layout = layouts(args.hidden, args.ffn, args.src_tp, args.dst_tp, src_keys, dst_keys, kind)
    plan = plan_resharding(src_layout, dst_layout)
    moved = sum(plan.bytes_per_dst_rank())
    report.update(
        full_model_bytes=plan.full_bytes,
        bytes_per_dst_rank=plan.bytes_per_dst_rank(),
        bytes_moved=moved,
        slices_per_dst_rank=plan.slices_per_dst_rank(),
    )
    if gpus:
        report["d2d_copy_gbps"] = copy_gbps(moved, torch.device("cuda", 0), torch.device("cuda", 0))
        if gpus >= 2:
            report["gpu0_to_gpu1_copy_gbps"] = copy_gbps(moved, torch.device("cuda", 0), torch.device("cuda", 1))
    setup = {"plan": plan, "layouts": (src_layout, dst_layout), "rounds": args.rounds, "devices": src_dev + dst_dev}
    if gpus == 1:
        route_problem = None
        try:
            choose_transport(src_layout, dst_layout, plan, "collective")
        except ValueError as exc:
            route_problem = str(exc)
        report["planner_on_one_gpu"] = route_problem
        # two processes on the one GPU, tp1 -> tp1: what NCCL itself answers
        one_src, one_dst = layouts(args.hidden, args.ffn, 1, 1, ["cuda:0"], ["cuda:0"], "cuda")
        tiny = plan_resharding(one_src, one_dst)
        attempt = {"plan": tiny, "layouts": (one_src, one_dst), "rounds": 1, "devices": ["cuda:0", "cuda:0"]}
        report["nccl_two_processes_one_gpu"] = run_processes({**attempt, "backend": "nccl"}, 2, min(args.timeout, 60.0))
        self_loop = nccl_self_loop_bounded(plan, src_layout, dst_layout, args.rounds, args.timeout)
        self_loop["what"] = "the plan's slices through NCCL send/recv to itself, one process on the one GPU"
        if "seconds_p50" in self_loop:
            self_loop["gbps"] = moved / self_loop["seconds_p50"] / GB
            self_loop["fraction_of_d2d_copy"] = self_loop["gbps"] / report["d2d_copy_gbps"]
        report["nccl_self_loop_one_gpu"] = self_loop
        path = loopback(plan, src_layout, dst_layout, args.rounds, torch.device("cuda", 0))
        path["what"] = "send_slices/recv_slices in one process over a loopback group: the NCCL path without NCCL's wire"
        report["loopback_one_gpu"] = path
    else:
        path = run_processes({**setup, "backend": "nccl" if gpus else "gloo"}, size, args.timeout)
        path["what"] = f"{'NCCL' if gpus else 'gloo'} between {size} processes" + (
            f", sources on {sorted(set(src_dev))}, destinations on {sorted(set(dst_dev))}" if gpus else ""
        )
        report["collective"] = path
    if "seconds_p50" in path:
        path["gbps"] = moved / path["seconds_p50"] / GB
        if "d2d_copy_gbps" in report:
            path["fraction_of_d2d_copy"] = path["gbps"] / report["d2d_copy_gbps"]
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if "seconds_p50" in path else 1


if __name__ == "__main__":
    raise SystemExit(main())

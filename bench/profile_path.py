"""Where the served path spends its CPU: py-spy samples the ingress replica (which hosts
the controllers in the shipped layout) while clients send one kind of call, and the
samples are summed by the code they were in.

    python -m bench.profile_path [--target add|infer|echo] [--seconds 20] [--clients 4] [--top 40]
                                 [--all-threads]

``add``: the floor's call (bench/floor_app.py), an 8-rank ONE_TO_ALL add on the
``accumulators`` deployment. ``infer``: a binary OIP request ([8, 2, 4096] FP32) to the
unbatched ``mlp`` model as ``bench.gpu`` serves it (tp=1, on a GPU where there is one).
``echo``: the same body to the ``echo`` model (rank 0 of ``test_actor`` sends it back), the
path of an inference without its forward, so many more requests fit in the same seconds.

Only the thread that holds the GIL is sampled (py-spy's ``--gil``): a thread blocked in
native code (Ray's core worker loop, a thread waiting on a lock) reads as busy to py-spy
otherwise, and would hide what the Python code of the path costs; ``--all-threads``
samples every thread.

Prints, for the replica's busy samples (idle waits on the event loop left out), the share
of each part of the path (Serve's replica code, Starlette and FastAPI, the service's
modules by package, Ray's core) and the functions with the largest own and cumulative
time; writes the raw samples to bench/results/profile_<target>.txt.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from tests.serve_process import ROOT, ServeProcess

RESULTS = ROOT / "bench" / "results"
#: The call the floor app answers (bench/floor_app.py): an 8-rank ONE_TO_ALL add.
ADD = "/v1/groups/gpu_accumulator_decorator/add"
INFER = "/v2/models/mlp_unbatched/infer"
ECHO = "/v2/models/echo/infer"

#: Parts of the path, by the file a frame is in (first match wins).
PARTS = [
    ("hybridflow/http/", "hybridflow.http (routes, bodies, answers)"),
    ("hybridflow_client/wire/", "hybridflow_client.wire (tensor codecs)"),
    ("hybridflow/wire/", "hybridflow.wire (torch tensors and batches of decoded values)"),
    ("hybridflow/control/", "hybridflow.control (controller, journal, metrics)"),
    ("hybridflow/state/", "hybridflow.state (store, codec)"),
    ("hybridflow/serve/", "hybridflow.serve (deployments)"),
    ("single_controller/", "single_controller (dispatch, collect)"),
    ("ray/serve/", "Ray Serve (replica, router, direct ingress)"),
    ("starlette/", "Starlette and FastAPI"),
    ("fastapi/", "Starlette and FastAPI"),
    ("uvicorn/", "uvicorn"),
    ("pydantic", "pydantic"),
    ("ray/", "Ray core (task submission, object refs)"),
    ("asyncio/", "asyncio"),
]
#: Frames that mean the thread was waiting, not working.
IDLE = ("select (selectors.py", "epoll", "_run_once (asyncio", "wait (threading.py", "_worker (concurrent")


def ingress_pids(proc: ServeProcess) -> list[int]:
    """The ingress replica's process of this ``serve run`` (by Ray's process title)."""
    return [pid for pid, argv in proc.processes().items()
            if b"ServeReplica" in b" ".join(argv) and b":ingress" in b" ".join(argv)]


async def load(url: str, path: str, body: bytes, headers: dict[str, str], clients: int, seconds: float) -> int:
    done = 0
    deadline = time.monotonic() + seconds

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal done
        while time.monotonic() < deadline:
            (await client.post(path, content=body, headers=headers)).raise_for_status()
            done += 1

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    return done


def target(name: str) -> tuple[ServeProcess, str, bytes, dict[str, str]]:
    """The service to start and the request to send for ``name``."""
    if name == "add":
        return ServeProcess(deployments=["accumulators"]), ADD, b'{"kwargs": {"x": 1}}', {
            "Content-Type": "application/json"}
    import torch

    from bench.gpu import gpu_serve_config
    from bench.http_figures import BATCH_SHAPE, oip_body

    body, headers = oip_body("x", torch.rand(*BATCH_SHAPE), binary_output=True)
    if name == "echo":
        return ServeProcess(deployments=["test_actor"]), ECHO, body, headers
    return ServeProcess(config=gpu_serve_config()), INFER, body, headers


def py_spy_command(py_spy: str, pid: int, seconds: float, raw: Path, all_threads: bool = False) -> list[str]:
    """py-spy sampling ``pid`` for ``seconds`` into ``raw`` (one line per stack), without
    stopping it; only the GIL's holder unless ``all_threads``."""
    command = [py_spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "250",
               "--format", "raw", "--output", str(raw), "--nonblocking"]
    return command if all_threads else [*command, "--gil"]


def part_of(frame: str) -> str:
    for marker, name in PARTS:
        if marker in frame:
            return name
    return "other"


def summarize(raw: Path, top: int) -> str:
    """Shares by part (innermost frame) and the top functions, from py-spy's raw output
    (one line per stack: ``frame;frame;... count``, outermost first)."""
    own: Counter[str] = Counter()
    cumulative: Counter[str] = Counter()
    parts: Counter[str] = Counter()
    busy = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if any(marker in frames[-1] for marker in IDLE):
            continue
        n = int(count)
        busy += n
        own[frames[-1]] += n
        parts[part_of(frames[-1])] += n
        for frame in set(frames):
            cumulative[frame] += n
    if not busy:
        return "no busy samples"
    lines = [f"busy samples: {busy}", "", "share of busy time by part (innermost frame):"]
    lines += [f"  {100 * n / busy:5.1f}%  {name}" for name, n in parts.most_common()]
    lines += ["", f"top {top} by own time:"]
    lines += [f"  {100 * n / busy:5.1f}%  {frame}" for frame, n in own.most_common(top)]
    ours = [(f, n) for f, n in cumulative.most_common() if "hybridflow/" in f or "single_controller/" in f]
    lines += ["", f"top {top} of the service's own functions by cumulative time:"]
    lines += [f"  {100 * n / busy:5.1f}%  {frame}" for frame, n in ours[:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=("add", "infer", "echo"), default="add")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--all-threads", action="store_true", help="sample every thread, not only the GIL's holder")
    options = parser.parse_args(argv)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    proc, path, body, headers = target(options.target)
    proc.start()
    try:
        pids = ingress_pids(proc)
        if not pids:
            raise RuntimeError("no ingress replica process found")
        asyncio.run(load(proc.url, path, body, headers, options.clients, 3.0))  # warm
        raw = Path(tempfile.mkdtemp()) / "samples.txt"
        spy = subprocess.Popen(py_spy_command(py_spy, pids[0], options.seconds, raw, options.all_threads),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        calls = asyncio.run(load(proc.url, path, body, headers, options.clients, options.seconds - 2))
        spy.wait(timeout=options.seconds + 60)
        report = summarize(raw, options.top)
        RESULTS.mkdir(exist_ok=True)
        shutil.copy(raw, RESULTS / f"profile_{options.target}.txt")
        print(f"{calls} calls of {path} from {options.clients} clients in {options.seconds - 2:g} s")
        print(report)
    finally:
        proc.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

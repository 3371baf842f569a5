"""A closed-loop load generator that is cheap enough not to be what it measures: a fixed
number of concurrent clients split over client processes, each client sending one request
after another on its own keep-alive connection.

    python -m bench.load_generator http://127.0.0.1:8000 /v1/groups/gpu_accumulator/add \\
        --json '{"kwargs": {"x": [1, 1, 1, 1]}}' --concurrency 32 [--processes 2] [--window 10]
    python -m bench.load_generator URL /v2/models/mlp/infer --body-file body.bin \\
        --header 'Inference-Header-Content-Length: 190' --header 'Content-Type: application/octet-stream'

A client process runs an event loop (uvloop where installed) of raw HTTP/1.1 connections:
the request's bytes are built once, and each answer is parsed by httptools (the parser
uvicorn uses) without keeping its body, so a process spends a few tens of microseconds per
request. The clients warm up for ``warmup_s``, then the window counts the requests that
complete within it, their latencies, the errors, and each client process's own CPU
seconds over the window (``time.process_time``), so that a CPU figure of the machine can
leave the generator out. A client process is ``python -m bench.load_generator --client``:
its command line names it, which is how ``bench.cold_start.role_of`` tells it apart.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

#: How many bytes of an error's answer a result keeps, to say what went wrong.
ERROR_TEXT = 200


def default_processes() -> int:
    """Client processes by default: enough to saturate a floor on this machine (half the
    cores, at least 2 and at most 8) without the clients taking the cores they measure."""
    return max(2, min(8, (os.cpu_count() or 2) // 2))


@dataclass(frozen=True)
class Load:
    """What to send, to where, how hard and for how long."""

    url: str
    path: str
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)
    concurrency: int = 16
    processes: int = field(default_factory=default_processes)
    warmup_s: float = 2.0
    window_s: float = 10.0
    timeout_s: float = 300.0
    #: Whether the requests in flight at the window's end are awaited (no backlog is left
    #: for what is measured next) or dropped (the target stops next).
    drain: bool = True

    @classmethod
    def of_json(cls, url: str, path: str, document: Any, **options: Any) -> Load:
        body = json.dumps(document).encode()
        return cls(url, path, body, {"Content-Type": "application/json"}, **options)

    def split(self) -> list[int]:
        """Clients per process: the concurrency spread as evenly as it goes, never a
        process without a client."""
        if self.concurrency < 1 or self.processes < 1:
            raise ValueError(f"concurrency and processes must be at least 1, got {self.concurrency}, {self.processes}")
        processes = min(self.processes, self.concurrency)
        share, extra = divmod(self.concurrency, processes)
        return [share + (1 if i < extra else 0) for i in range(processes)]

    def request_bytes(self) -> bytes:
        """The request as it goes on the wire, built once."""
        parts = urlsplit(self.url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"url must be http://host:port, got {self.url!r}")
        lines = [f"POST {self.path} HTTP/1.1", f"Host: {parts.netloc}", f"Content-Length: {len(self.body)}"]
        lines += [f"{name}: {value}" for name, value in self.headers.items()
                  if name.lower() not in ("host", "content-length")]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + self.body


@dataclass
class LoadResult:
    """The window's figures: requests that completed in it and what they took."""

    requests: int
    errors: int
    window_s: float
    rps: float
    p50_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    concurrency: int
    processes: int
    clients_per_process: list[int]
    requests_per_process: list[int]
    #: Each client process's CPU seconds over the window.
    client_cpu_s: list[float]
    #: Errors over the whole run, the warm-up's included, and every answer it got.
    errors_total: int = 0
    answered_total: int = 0
    error_samples: list[str] = field(default_factory=list)
    #: ``time.time()`` at the window's start and end.
    window_start: float = 0.0
    window_end: float = 0.0

    @property
    def client_cpu_total_s(self) -> float:
        return sum(self.client_cpu_s)

    def figures(self) -> dict[str, Any]:
        out = asdict(self)
        out["client_cpu_total_s"] = self.client_cpu_total_s
        return out


def percentile(sorted_samples: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of sorted samples, by linear interpolation."""
    if not sorted_samples:
        raise ValueError("no samples")
    at = (len(sorted_samples) - 1) * q
    low = int(at)
    high = min(low + 1, len(sorted_samples) - 1)
    return sorted_samples[low] + (sorted_samples[high] - sorted_samples[low]) * (at - low)


def summarize(load: Load, parts: list[dict[str, Any]], window_start: float, window_end: float) -> LoadResult:
    """One result from the client processes' reports."""
    latencies = sorted(x for part in parts for x in part["latencies"])
    errors = sum(part["errors"] for part in parts)
    window = window_end - window_start
    samples = [text for part in parts for text in part["error_samples"]][:5]
    return LoadResult(
        requests=len(latencies),
        errors=errors,
        window_s=window,
        rps=len(latencies) / window,
        p50_ms=percentile(latencies, 0.5) * 1e3 if latencies else None,
        p99_ms=percentile(latencies, 0.99) * 1e3 if latencies else None,
        mean_ms=statistics.fmean(latencies) * 1e3 if latencies else None,
        concurrency=load.concurrency,
        processes=len(parts),
        clients_per_process=[part["clients"] for part in parts],
        requests_per_process=[len(part["latencies"]) for part in parts],
        client_cpu_s=[part["cpu_s"] for part in parts],
        errors_total=sum(part["errors_total"] for part in parts),
        answered_total=sum(part["answered_total"] for part in parts),
        error_samples=samples,
        window_start=window_start,
        window_end=window_end,
    )


def tell(child: subprocess.Popen, line: str) -> None:
    child.stdin.write(line + "\n")
    child.stdin.flush()


def expect(child: subprocess.Popen, word: str) -> None:
    """Wait for a client process's next line, which must be ``word``."""
    line = child.stdout.readline()
    if line.strip() != word:
        child.kill()
        child.wait()
        raise RuntimeError(f"a client process did not say {word!r} (exit {child.returncode}): {line.strip()!r}")


def run_load(load: Load, at_start: Callable[[], Any] | None = None,
             at_end: Callable[[], Any] | None = None) -> LoadResult:
    """Run ``load``: start the client processes, let them connect, then warm up and count
    the window. ``at_start`` and ``at_end`` are called in this process at the window's
    start and end (a CPU reading of the machine, say)."""
    spec = {"url": load.url, "request": base64.b64encode(load.request_bytes()).decode(),
            "timeout_s": load.timeout_s, "drain": load.drain}
    children = []
    reports = tempfile.TemporaryDirectory(prefix="load-generator-")
    try:
        for i, clients in enumerate(load.split()):
            child = subprocess.Popen([sys.executable, "-m", "bench.load_generator", "--client"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            children.append(child)
            tell(child, json.dumps({**spec, "clients": clients, "report": f"{reports.name}/{i}.json"}))
        for child in children:  # each says when its connections are open
            expect(child, "ready")
        started = time.time()
        for child in children:
            tell(child, "go")
        for child in children:  # each client has had its first answer: the server is warm
            expect(child, "warm")
        window_start = max(started + load.warmup_s, time.time() + 0.2)
        window_end = window_start + load.window_s
        for child in children:
            tell(child, json.dumps({"start": window_start, "end": window_end}))
        time.sleep(max(0.0, window_start - time.time()))
        if at_start is not None:
            at_start()
        time.sleep(max(0.0, window_end - time.time()))
        if at_end is not None:
            at_end()
        parts = []
        for i, child in enumerate(children):
            child.communicate(timeout=load.timeout_s + 60)
            if child.returncode:
                raise RuntimeError(f"a client process failed with exit {child.returncode}")
            with open(f"{reports.name}/{i}.json") as handle:
                parts.append(json.load(handle))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        reports.cleanup()
    return summarize(load, parts, window_start, window_end)


# -- a client process ----------------------------------------------------------------------


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection, one request at a time; the answer's body is
    counted, not kept (an error's first bytes are, to say what went wrong)."""

    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.answer: asyncio.Future | None = None
        self.text = bytearray()
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception as exc:  # a malformed answer fails the request it answers
            self._fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(exc or ConnectionError("the server closed the connection"))

    def _fail(self, exc: BaseException) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(exc)

    # httptools' callbacks
    def on_body(self, body: bytes) -> None:
        if len(self.text) < ERROR_TEXT:
            self.text += body[: ERROR_TEXT - len(self.text)]

    def on_message_complete(self) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_result((self.parser.get_status_code(), self.parser.should_keep_alive()))

    async def send(self, request: bytes) -> tuple[int, bytes]:
        self.text = bytearray()
        self.answer = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        status, keep_alive = await self.answer
        if not keep_alive:
            self.transport.close()
            self.closed = True
        return status, bytes(self.text)


async def _client_process(spec: dict[str, Any], read_line: Callable[[], str]) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    parts = urlsplit(spec["url"])
    host, port = parts.hostname, parts.port or 80
    request = base64.b64decode(spec["request"])

    async def connect() -> _Connection:
        _, connection = await loop.create_connection(_Connection, host, port)
        return connection

    connections = [await connect() for _ in range(spec["clients"])]
    print("ready", flush=True)
    await loop.run_in_executor(None, read_line)  # "go"
    # The window in this process's clock (perf_counter), once the parent sends it.
    window = {"start": math.inf, "end": math.inf}
    latencies: list[float] = []
    counts = {"errors": 0, "errors_total": 0, "answered_total": 0}
    samples: list[str] = []
    warm = asyncio.Event()
    first_answers = {"left": len(connections)}

    def answered() -> None:
        counts["answered_total"] += 1

    def error(text: str, done: float) -> None:
        counts["errors_total"] += 1
        if window["start"] <= done <= window["end"]:
            counts["errors"] += 1
        if len(samples) < 5:
            samples.append(text[:ERROR_TEXT])

    async def client(connection: _Connection) -> None:
        first = True
        while time.perf_counter() < window["end"]:
            began = time.perf_counter()
            try:
                if connection.closed:
                    connection = await connect()
                status, text = await asyncio.wait_for(connection.send(request), spec["timeout_s"])
            except Exception as exc:  # a failed request is counted, and the client goes on
                error(f"{type(exc).__name__}: {exc}", time.perf_counter())
                connection.closed = True
                if connection.transport is not None:
                    connection.transport.close()
                await asyncio.sleep(0.01)
            else:
                done = time.perf_counter()
                answered()
                if not 200 <= status < 300:
                    error(f"{status}: {text.decode(errors='replace')}", done)
                elif window["start"] <= done <= window["end"]:
                    latencies.append(done - began)
            if first:
                first = False
                first_answers["left"] -= 1
                if not first_answers["left"]:
                    warm.set()

    tasks = [asyncio.ensure_future(client(c)) for c in connections]
    await warm.wait()
    print("warm", flush=True)
    times = json.loads(await loop.run_in_executor(None, read_line))
    offset = time.perf_counter() - time.time()
    window["start"], window["end"] = times["start"] + offset, times["end"] + offset
    await asyncio.sleep(max(0.0, window["start"] - time.perf_counter()))
    cpu_start = time.process_time()
    await asyncio.sleep(max(0.0, window["end"] - time.perf_counter()))
    cpu_end = time.process_time()
    if not spec["drain"]:
        for task in tasks:
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for connection in connections:
        if connection.transport is not None:
            connection.transport.close()
    return {"clients": spec["clients"], "latencies": latencies, "errors": counts["errors"],
            "errors_total": counts["errors_total"], "answered_total": counts["answered_total"],
            "error_samples": samples, "cpu_s": cpu_end - cpu_start}


def client_main() -> int:
    """A client process: its spec on the first line of standard input, ``go`` on the
    second, the window on the third; it answers ``ready`` once connected and ``warm`` once
    each client has had an answer, and writes its report to the spec's ``report`` file."""
    spec = json.loads(sys.stdin.readline())
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    report = run(_client_process(spec, sys.stdin.readline))
    # into a file: a report larger than a pipe's buffer came through standard output cut short
    with open(spec["report"], "w") as handle:
        json.dump(report, handle)
    return 0
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--client"]:
        return client_main()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="http://host:port")
    parser.add_argument("path", help="the route, e.g. /v2/models/mlp/infer")
    body = parser.add_mutually_exclusive_group()
    body.add_argument("--json", help="a JSON body (Content-Type: application/json)")
    body.add_argument("--body-file", help="the body's bytes from this file")
    parser.add_argument("--header", action="append", default=[], help="'Name: value', repeatable")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--processes", type=int, default=default_processes())
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--window", type=float, default=10.0)
    options = parser.parse_args(argv)
    headers = dict(h.split(":", 1) for h in options.header)
    headers = {k.strip(): v.strip() for k, v in headers.items()}
    if options.json is not None:
        content, headers = options.json.encode(), {"Content-Type": "application/json", **headers}
    elif options.body_file is not None:
        with open(options.body_file, "rb") as handle:
            content = handle.read()
    else:
        content = b""
    load = Load(options.url, options.path, content, headers, options.concurrency, options.processes,
                options.warmup, options.window)
    print(json.dumps(run_load(load).figures(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

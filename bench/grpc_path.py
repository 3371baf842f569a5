"""The `mlp` model's inference over gRPC against the HTTP binary path, on a running service,
and where the difference lies.

Both clients are tritonclient's at their defaults but for binary outputs over HTTP (the
binary tensor data extension both ways, as the gRPC path's raw contents are): the same
[8, 2, 4096] FP32 input, the answers checked equal, then timed in alternating rounds so
that machine noise hits both alike. Both paths enter at the service's front (HAProxy as
`make serve` runs it, else Serve's proxies), reach the ingress replica (the FastAPI route,
or the gRPC servicer, which parses the request off the event loop) and then the same
controller and batcher (a lone request waits the model's batching delay either way).

The breakdown takes the forward out: `echo` with the same tensor in and out, once through
the front and once straight to the ingress replica's own HTTP and gRPC ports (Serve's
direct ingress, which the front forwards to), so the front's share of each path is the
difference.

    python -m bench.grpc_path                                  # starts serve_config.yaml
    python -m bench.grpc_path --url http://127.0.0.1:8000 --grpc 127.0.0.1:9000
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from bench.timing import timed

MLP_SHAPE = (8, 2, 4096)


class PairedP50s(NamedTuple):
    grpc_ms: float
    http_ms: float
    same_answer: bool
    samples: int  # per path


def paired_p50s(
    url: str,
    grpc_address: str,
    model: str,
    shape: tuple[int, ...],
    n: int,
    rounds: int = 5,
    token: str | None = None,
    warmup: int = 5,
    application: str | None = None,
) -> PairedP50s:
    """The gRPC and HTTP p50s (ms) of ``n`` inferences of ``model`` (input ``x``, output
    ``y``) on a random FP32 tensor of ``shape``, and whether both paths answered alike."""
    import tritonclient.grpc as tritongrpc
    import tritonclient.http as tritonhttp

    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    headers = {"authorization": f"Bearer {token}"} if token else None
    grpc_headers = {**(headers or {}), **({"application": application} if application else {})} or None
    over_http = tritonhttp.InferenceServerClient(url.removeprefix("http://").removeprefix("https://"))
    over_grpc = tritongrpc.InferenceServerClient(grpc_address)
    http_input = tritonhttp.InferInput("x", list(shape), "FP32")
    http_input.set_data_from_numpy(x, binary_data=True)
    http_output = [tritonhttp.InferRequestedOutput("y", binary_data=True)]
    grpc_input = tritongrpc.InferInput("x", list(shape), "FP32")
    grpc_input.set_data_from_numpy(x)

    def http_call() -> np.ndarray:
        return over_http.infer(model, [http_input], outputs=http_output, headers=headers).as_numpy("y")

    def grpc_call() -> np.ndarray:
        return over_grpc.infer(model, [grpc_input], headers=grpc_headers).as_numpy("y")

    try:
        same = bool(np.array_equal(http_call(), grpc_call()))
        for _ in range(warmup):
            http_call()
            grpc_call()
        http_s: list[float] = []
        grpc_s: list[float] = []
        for _ in range(rounds):
            grpc_s += timed(grpc_call, max(1, n // rounds), warmup=0)
            http_s += timed(http_call, max(1, n // rounds), warmup=0)
    finally:
        over_grpc.close()
        over_http.close()
    return PairedP50s(statistics.median(grpc_s) * 1e3, statistics.median(http_s) * 1e3, same, len(grpc_s))


def grpc_vs_http(
    url: str,
    grpc_address: str,
    n: int = 50,
    rounds: int = 5,
    shape: tuple[int, ...] = MLP_SHAPE,
    token: str | None = None,
    warmup: int = 5,
    application: str | None = None,
) -> dict[str, Any]:
    """p50 of ``n`` `mlp` inferences over each path (``url``: the service's HTTP address,
    ``grpc_address``: ``host:port`` of its gRPC port; ``token``: the bearer token when the
    service has one; ``application``: the Serve application's name, which Serve's gRPC
    routing needs where a config has several). ``grpc_over_http`` is the ratio of the p50s
    (below 1: gRPC faster)."""
    mlp = paired_p50s(url, grpc_address, "mlp", shape, n, rounds, token, warmup, application)
    return {
        "grpc_mlp_p50_ms": mlp.grpc_ms,
        "http_mlp_p50_ms": mlp.http_ms,
        "grpc_over_http": mlp.grpc_ms / mlp.http_ms,
        "shape": list(shape),
        "samples": mlp.samples,
        "same_answer": mlp.same_answer,
    }


def direct_ingress(replica_log: str) -> tuple[str, str] | None:
    """(HTTP URL, gRPC ``host:port``) of an ingress replica's own servers (Serve's direct
    ingress), read from the replica's Serve log, or None where it started none."""
    found = {protocol: port for port, protocol in
             re.findall(r"Allocated port (\d+) for RequestProtocol\.(HTTP|GRPC)", replica_log)}
    if "HTTP" not in found or "GRPC" not in found:
        return None
    return f"http://127.0.0.1:{found['HTTP']}", f"127.0.0.1:{found['GRPC']}"


def front_breakdown(url: str, grpc_address: str, direct: tuple[str, str], n: int = 50,
                    shape: tuple[int, ...] = MLP_SHAPE, application: str | None = None) -> dict[str, Any]:
    """`echo` of a ``shape`` tensor over gRPC and HTTP, through the service's front
    (``url``, ``grpc_address``) and straight to the ingress replica (``direct``: its HTTP
    URL and gRPC address): ``<path>_echo[_direct]_p50_ms``, ``echo[_direct]_grpc_over_http``,
    and ``<path>_front_added_ms``, what the front adds to each path."""
    out: dict[str, Any] = {}
    for suffix, (http_url, grpc_at) in (("", (url, grpc_address)), ("_direct", direct)):
        echo = paired_p50s(http_url, grpc_at, "echo", shape, n, application=application)
        out[f"grpc_echo{suffix}_p50_ms"] = echo.grpc_ms
        out[f"http_echo{suffix}_p50_ms"] = echo.http_ms
        out[f"echo{suffix}_grpc_over_http"] = echo.grpc_ms / echo.http_ms
    for path in ("grpc", "http"):
        out[f"{path}_front_added_ms"] = out[f"{path}_echo_p50_ms"] - out[f"{path}_echo_direct_p50_ms"]
    return out


def ingress_replica_log(log_dir: Path, application: str) -> str:
    """The Serve log of ``application``'s ingress replica under a session's ``logs/serve``
    (the first one, where there are several), or ``""``."""
    logs = sorted(log_dir.glob(f"replica_{application}_ingress_*.log"))
    return logs[0].read_text(errors="replace") if logs else ""


def service_figures(url: str, grpc_address: str, session_dir: Path, n: int, application: str) -> dict[str, Any]:
    """:func:`grpc_vs_http`, and :func:`front_breakdown` where the ingress replica of
    ``application`` (its Serve log under ``session_dir``) has ports of its own."""
    out = grpc_vs_http(url, grpc_address, n, application=application)
    direct = direct_ingress(ingress_replica_log(session_dir / "logs" / "serve", application))
    if direct is not None:
        out.update(front_breakdown(url, grpc_address, direct, n, application=application))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="a running service's HTTP address (default: start serve_config.yaml)")
    parser.add_argument("--grpc", help="its gRPC address, host:port (with --url)")
    parser.add_argument("--token", default=None)
    parser.add_argument("-n", type=int, default=50)
    args = parser.parse_args(argv)
    if args.url:
        result = grpc_vs_http(args.url, args.grpc or "127.0.0.1:9000", args.n, token=args.token)
    else:
        from tests.serve_process import ServeProcess

        service = ServeProcess().start()
        try:
            result = service_figures(service.url, service.grpc_address, service.session_dir(), args.n, "hybridflow")
        finally:
            service.kill()
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The `mlp` model's inference over gRPC against the HTTP binary path, on a running service.

Both clients are tritonclient's at their defaults but for binary outputs over HTTP (the
binary tensor data extension both ways, as the gRPC path's raw contents are): the same
[8, 2, 4096] FP32 input, the answers checked equal, then timed in alternating rounds so
that machine noise hits both alike. The gRPC path crosses Serve's gRPC proxy (the request
forwarded as bytes, parsed in the ingress replica); the HTTP path Serve's HTTP proxy and
the FastAPI route. Both reach the same controller and batcher (a lone request waits the
model's batching delay either way).

    python -m bench.grpc_path                                  # starts serve_config.yaml
    python -m bench.grpc_path --url http://127.0.0.1:8000 --grpc 127.0.0.1:9000
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import numpy as np

from bench.timing import timed

MLP_SHAPE = (8, 2, 4096)


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
    ``grpc_address``: ``host:port`` of its gRPC proxy; ``token``: the bearer token when the
    service has one; ``application``: the Serve application's name, which Serve's gRPC
    routing needs where a config has several). ``grpc_over_http`` is the ratio of the p50s
    (below 1: gRPC faster)."""
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
        return over_http.infer("mlp", [http_input], outputs=http_output, headers=headers).as_numpy("y")

    def grpc_call() -> np.ndarray:
        return over_grpc.infer("mlp", [grpc_input], headers=grpc_headers).as_numpy("y")

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
    grpc_p50, http_p50 = statistics.median(grpc_s) * 1e3, statistics.median(http_s) * 1e3
    return {
        "grpc_mlp_p50_ms": grpc_p50,
        "http_mlp_p50_ms": http_p50,
        "grpc_over_http": grpc_p50 / http_p50,
        "shape": list(shape),
        "samples": len(grpc_s),
        "same_answer": same,
    }


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
            result = grpc_vs_http(service.url, service.grpc_address, args.n)
        finally:
            service.kill()
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

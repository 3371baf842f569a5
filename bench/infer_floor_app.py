"""The hand-written floor for the service's inference: one process, FastAPI under uvicorn,
over one Ray actor that holds a Llama MLP of the served layer's size (``hidden_size`` 4096,
``intermediate_size`` 11008, SiLU, FP32: the served ``mlp`` at tp=1), answering
``POST /v2/models/mlp/infer`` with the Open Inference Protocol's binary body. The body is
taken apart by hand (the JSON header, then the raw bytes as a numpy array), sent to the
actor once per request, and the answer goes back as a binary body. What a user who wants
speed writes instead of the service.

    python -m bench.infer_floor_app --port 8124 --mode plain      # await actor.forward.remote(x)
    python -m bench.infer_floor_app --port 8124 --mode compiled   # a Ray compiled graph

``compiled`` calls the actor through ``dag.experimental_compile(enable_asyncio=True)`` with
room for more requests in flight than the bench sends (``_max_inflight_executions``). The
actor takes the GPU where there is one (``num_gpus=1``), else it runs on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

HIDDEN, FFN = 4096, 11008
#: Requests a compiled graph holds in flight: above the bench's largest concurrency (64).
MAX_INFLIGHT = 256


class FloorMLP:
    """A Llama MLP, ``down(silu(gate(x)) * up(x))``, on this process's device (the GPU
    where there is one)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        make = lambda n_in, n_out: torch.nn.Linear(n_in, n_out, bias=False, device=self.device)  # noqa: E731
        self.gate, self.up, self.down = make(hidden, ffn), make(hidden, ffn), make(ffn, hidden)

    def forward(self, x: np.ndarray) -> np.ndarray:
        with torch.no_grad():  # grad mode is per thread: a compiled graph calls from a thread of its own
            h = torch.from_numpy(x).to(self.device)
            y = self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))
        return y.cpu().numpy()


def floor_actor_class() -> Any:
    """:class:`FloorMLP` as a Ray actor class, holding a GPU where there is one."""
    import ray

    return ray.remote(num_gpus=1 if torch.cuda.is_available() else 0)(FloorMLP)


class BadRequest(ValueError):
    pass


def parse_binary_request(body: bytes, header_length: str | None) -> np.ndarray:
    """The one FP32 input of a binary OIP request, as a numpy array (a view of ``body``)."""
    if header_length is None or not header_length.isdigit() or int(header_length) > len(body):
        raise BadRequest("send the JSON header's length in Inference-Header-Content-Length")
    size = int(header_length)
    header = json.loads(body[:size])
    (entry,) = header["inputs"]
    if entry.get("datatype") != "FP32":
        raise BadRequest("the input must be FP32")
    shape = [int(n) for n in entry["shape"]]
    raw = memoryview(body)[size:]
    if len(raw) != int(np.prod(shape)) * 4 or shape[-1] != HIDDEN:
        raise BadRequest(f"the input must be [..., {HIDDEN}] FP32 and its bytes must follow the header")
    return np.frombuffer(raw, dtype=np.float32).reshape(shape)


def binary_response(y: np.ndarray) -> tuple[bytes, int]:
    """The answer's body (JSON header, then ``y``'s bytes) and the header's length."""
    raw = np.ascontiguousarray(y, dtype=np.float32).tobytes()
    header = json.dumps({"model_name": "mlp", "outputs": [{
        "name": "y", "datatype": "FP32", "shape": list(y.shape), "parameters": {"binary_data_size": len(raw)}}]
    }).encode()
    return header + raw, len(header)


def build_app(mode: str) -> FastAPI:
    import contextlib

    import ray

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    actor = floor_actor_class().remote(HIDDEN, FFN)
    ray.get(actor.__ray_ready__.remote())
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):  # a compiled graph for asyncio is compiled on the server's loop
        if mode == "compiled":
            from ray.dag import InputNode

            with InputNode() as x:
                dag = actor.forward.bind(x)
            state["graph"] = dag.experimental_compile(enable_asyncio=True, _max_inflight_executions=MAX_INFLIGHT)
        yield
        if "graph" in state:
            state["graph"].teardown()

    app = FastAPI(lifespan=lifespan)

    @app.get("/ready")
    async def ready() -> dict[str, bool]:
        return {"ok": True}

    @app.post("/v2/models/mlp/infer")
    async def infer(request: Request) -> Response:
        body = await request.body()
        try:
            x = parse_binary_request(body, request.headers.get("inference-header-content-length"))
        except (BadRequest, ValueError, KeyError, TypeError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        if mode == "compiled":
            y = await (await state["graph"].execute_async(x))
        else:
            y = await actor.forward.remote(x)
        answer, header_length = binary_response(y)
        return Response(answer, media_type="application/octet-stream",
                        headers={"Inference-Header-Content-Length": str(header_length)})

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", choices=("plain", "compiled"), default="plain")
    options = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import uvicorn

    uvicorn.run(build_app(options.mode), host="127.0.0.1", port=options.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

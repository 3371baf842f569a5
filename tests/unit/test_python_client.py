"""clients.python_client and clients.cli against a tiny FastAPI fake of the service's HTTP
contract (no Ray): the fake only answers the way the contract says, so these tests check
the clients' encoding, decoding and error handling.

The blocking client and the CLI talk to the fake through uvicorn on 127.0.0.1; the async
client through httpx.ASGITransport.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from clients import cli
from clients.python_client import AsyncSingleControllerClient, ServiceError, SingleControllerClient
from wire.errors import WireError
from wire.json_tensors import decode_json_value, encode_json_value
from wire.oip_messages import build_infer_response, parse_infer_request
from wire.safetensors_call import decode_safetensors, encode_safetensors, pack_output, unpack_call

SAFETENSORS = "application/x-safetensors"
TOKEN = "s3cret"

GROUPS = [
    {"name": "accumulator", "world_size": 1, "resource_pool": "replica", "worker_class": "Accumulator",
     "status": "ready", "methods": [{"name": "add", "dispatch_mode": "EXECUTE_ALL", "execute_mode": "ALL",
                                     "registered": False}]},
    {"name": "gpu_accumulator", "world_size": 4, "resource_pool": "pool [4]", "worker_class": "GPUAccumulator",
     "status": "ready", "methods": [{"name": "add", "dispatch_mode": "EXECUTE_ALL", "execute_mode": "ALL",
                                     "registered": False}]},
    {"name": "mlp", "world_size": 4, "resource_pool": "pool [4]", "worker_class": "MLPLayerWorker",
     "status": "ready", "methods": [{"name": "get_weights", "dispatch_mode": "ONE_TO_ALL", "execute_mode": "ALL",
                                     "registered": True}]},
]


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def make_fake_service() -> tuple[FastAPI, dict[str, Any]]:
    """The fake, and a dict where it records what the last request carried."""
    app = FastAPI()
    state: dict[str, Any] = {"ready": True, "token": None, "seen": {}, "jobs": {}}

    def authorised(request: Request) -> bool:
        return state["token"] is None or request.headers.get("authorization") == f"Bearer {state['token']}"

    @app.get("/healthz")
    async def healthz():
        return {"status": "live"}

    @app.get("/readyz")
    async def readyz():
        return {"status": "ready"} if state["ready"] else error(503, "not ready: mlp")

    @app.get("/v1/groups")
    async def groups(request: Request):
        if not authorised(request):
            return error(401, "missing or wrong bearer token")
        return {"groups": GROUPS}

    @app.get("/v1/groups/{group}")
    async def group(group: str):
        for item in GROUPS:
            if item["name"] == group:
                return {**item, "ranks": [{"rank": r, "local_rank": r} for r in range(item["world_size"])]}
        return error(404, f"unknown group {group!r}")

    def run(group: str, method: str, args: list, kwargs: dict) -> Any:
        if group == "gpu_accumulator" and method == "add":
            (x,) = kwargs.values() if kwargs else args
            if len(x) != 4:
                raise ValueError(f"add: x has {len(x)} items, the group has 4 ranks")
            return [torch.tensor([float(rank)]) + x[rank] for rank in range(4)]
        if group == "accumulator" and method == "add":
            return None
        if group == "test_actor" and method == "foo_rank_zero":
            return 2 + kwargs["x"] + kwargs["y"]
        if group == "mlp" and method == "get_weights":
            return [{"gate_up_proj.weight": torch.full((2, 2), float(r)), "down_proj.weight": torch.ones(2, 1)}
                    for r in range(4)]
        if method == "echo":
            return {"args": args, "kwargs": kwargs}
        if method == "slow":
            time.sleep(0.3)
            return "done"
        raise LookupError(f"group {group!r} has no method {method!r}")

    @app.post("/v1/groups/{group}/{method}")
    async def call(group: str, method: str, request: Request):
        if not authorised(request):
            return error(401, "missing or wrong bearer token")
        body = await request.body()
        content_type = request.headers.get("content-type", "")
        state["seen"] = {"headers": dict(request.headers), "content_type": content_type}
        if group == "busy":
            return error(503, "group 'busy' is rebuilding; retry shortly", {"Retry-After": "5"})
        if group == "broken":
            return Response(b"Internal Server Error", status_code=500, media_type="text/plain")
        try:
            if content_type.startswith(SAFETENSORS):
                named = decode_safetensors(body)
                state["seen"]["names"] = sorted(named)
                args, kwargs = [], unpack_call(named)
            else:
                payload = json.loads(body)
                state["seen"]["json"] = payload
                args = decode_json_value(payload.get("args", []), "args")
                kwargs = decode_json_value(payload.get("kwargs", {}), "kwargs")
        except (WireError, ValueError) as exc:
            return error(400, str(exc))
        state["seen"]["args"], state["seen"]["kwargs"] = args, kwargs
        try:
            output = run(group, method, args, kwargs)
        except LookupError as exc:
            return error(404, str(exc))
        except ValueError as exc:
            return error(422, str(exc))
        if SAFETENSORS in request.headers.get("accept", ""):
            try:
                return Response(encode_safetensors(pack_output(output)), media_type=SAFETENSORS)
            except WireError as exc:
                return error(406, str(exc))
        return {"group": group, "method": method, "dispatch_mode": "EXECUTE_ALL", "execute_mode": "ALL",
                "world_size": 4, "output": encode_json_value(output)}

    @app.get("/v2")
    async def server_metadata():
        return {"name": "fake", "version": "0", "extensions": ["binary_tensor_data"]}

    @app.get("/v2/models/{model}")
    async def model_metadata(model: str):
        if model != "double":
            return error(404, f"unknown model {model!r}")
        spec = {"datatype": "FP32", "shape": [-1, 3]}
        return {"name": model, "versions": ["1"], "platform": "fake",
                "inputs": [{"name": "x", **spec}], "outputs": [{"name": "y", **spec}, {"name": "z", **spec}]}

    @app.post("/v2/models/{model}/infer")
    async def infer(model: str, request: Request):
        if model != "double":
            return error(404, f"unknown model {model!r}")
        length = request.headers.get("inference-header-content-length")
        try:
            inference, inputs = parse_infer_request(await request.body(), int(length) if length else None)
        except WireError as exc:
            return error(400, str(exc))
        state["seen"] = {"inference": inference, "header_length": length}
        outputs = {"y": inputs["x"] * 2, "z": inputs["x"] + 1}
        requested = inference.get("outputs")
        if requested:
            outputs = {o["name"]: outputs[o["name"]] for o in requested}
            binary = {o["name"] for o in requested if (o.get("parameters") or {}).get("binary_data")}
        else:
            binary = bool((inference.get("parameters") or {}).get("binary_data_output"))
        body, header_length = build_infer_response(model, "1", outputs, binary, id=inference.get("id"))
        if header_length is None:
            return Response(body, media_type="application/json")
        return Response(body, media_type="application/octet-stream",
                        headers={"Inference-Header-Content-Length": str(header_length)})

    # Jobs: run at once; the first status poll says running, half done.
    def job_status(job: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in job.items() if k != "output"}

    @app.post("/v1/jobs/{group}/{method}")
    async def submit_job(group: str, method: str, request: Request):
        payload = json.loads(await request.body())
        output = run(group, method, decode_json_value(payload["args"]), decode_json_value(payload["kwargs"]))
        job = {"id": f"job-{len(state['jobs'])}", "group": group, "method": method, "status": "running",
               "progress": 0.5, "split": int(request.query_params["split"]), "output": output}
        state["jobs"][job["id"]] = job
        return JSONResponse(job_status(job), status_code=202, headers={"Location": f"/v1/jobs/{job['id']}"})

    @app.get("/v1/jobs/{job_id}")
    async def job(job_id: str):
        job = state["jobs"][job_id]
        shown = job_status(job)
        job.update(status="succeeded", progress=1.0)
        return shown

    @app.get("/v1/jobs/{job_id}/result")
    async def job_result(job_id: str, request: Request):
        job = state["jobs"][job_id]
        if SAFETENSORS in request.headers.get("accept", ""):
            return Response(encode_safetensors(pack_output(job["output"])), media_type=SAFETENSORS)
        return {"group": job["group"], "method": job["method"], "dispatch_mode": "EXECUTE_ALL",
                "execute_mode": "ALL", "world_size": 4, "output": encode_json_value(job["output"])}

    @app.delete("/v1/jobs/{job_id}")
    async def cancel_job(job_id: str):
        state["jobs"][job_id]["status"] = "cancelled"
        return job_status(state["jobs"][job_id])

    return app, state


@pytest.fixture(scope="module")
def fake():
    """The fake served by uvicorn on a free 127.0.0.1 port: (url, state)."""
    app, state = make_fake_service()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "fake service did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture
def client(fake):
    url, state = fake
    state.update(ready=True, token=None)
    with SingleControllerClient(url, timeout=30) as c:
        yield c


def values(output: list) -> list[float]:
    return [t.item() for t in output]


# -- blocking client ------------------------------------------------------------------------


def test_health_and_readiness(client, fake):
    _, state = fake
    assert client.health() == {"status": "live"} and client.healthy()
    assert client.ready() and client.wait_ready(timeout=1)
    state["ready"] = False
    assert not client.ready()
    started = time.monotonic()
    assert not client.wait_ready(timeout=0.3, interval=0.1)
    assert time.monotonic() - started < 5


def test_wait_ready_counts_an_unreachable_service_as_not_ready():
    with SingleControllerClient("http://127.0.0.1:9", timeout=1) as c:
        assert not c.wait_ready(timeout=0.2, interval=0.1)


def test_groups_and_group(client):
    assert [g["name"] for g in client.groups()] == ["accumulator", "gpu_accumulator", "mlp"]
    assert [r["rank"] for r in client.group("gpu_accumulator")["ranks"]] == [0, 1, 2, 3]
    with pytest.raises(ServiceError) as caught:
        client.group("nope")
    assert caught.value.status_code == 404 and caught.value.message == "unknown group 'nope'"
    assert caught.value.retry_after is None


def test_json_call_like_the_tutorial(client, fake):
    _, state = fake
    output = client.call("gpu_accumulator", "add", x=[1, 1, 1, 1])
    assert values(output) == [1, 2, 3, 4] and all(isinstance(t, torch.Tensor) for t in output)
    assert state["seen"]["json"] == {"args": [], "kwargs": {"x": [1, 1, 1, 1]}}
    answer = client.call("gpu_accumulator", "add", x=[2, 2, 2, 2], full=True)
    assert answer["group"] == "gpu_accumulator" and answer["method"] == "add"
    assert answer["dispatch_mode"] == "EXECUTE_ALL" and answer["world_size"] == 4
    assert values(answer["output"]) == [2, 3, 4, 5]
    assert client.call("test_actor", "foo_rank_zero", x=1, y=2) == 5


def test_positional_arguments(client, fake):
    _, state = fake
    assert client.call("accumulator", "add", 10) is None
    assert state["seen"]["json"] == {"args": [10], "kwargs": {}}


def test_tensors_travel_as_tensor_objects(client, fake):
    _, state = fake
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    flags = torch.tensor([True, False])
    output = client.call("any", "echo", [x], flags=flags, config={"hidden": 64})
    sent = state["seen"]["json"]
    assert sent["args"] == [[{"datatype": "FP32", "shape": [2, 3], "data": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]}]]
    assert sent["kwargs"]["flags"] == {"datatype": "BOOL", "shape": [2], "data": [True, False]}
    assert torch.equal(output["args"][0][0], x) and torch.equal(output["kwargs"]["flags"], flags)
    assert output["kwargs"]["config"] == {"hidden": 64}


def test_binary_call_sends_safetensors_and_reads_safetensors(client, fake):
    _, state = fake
    output = client.call("gpu_accumulator", "add", x=[1, 1, 1, 1], binary=True)
    assert values(output) == [1, 2, 3, 4]
    assert state["seen"]["content_type"] == SAFETENSORS
    assert state["seen"]["headers"]["accept"] == SAFETENSORS
    assert state["seen"]["names"] == ["x.0", "x.1", "x.2", "x.3"]
    answer = client.call("gpu_accumulator", "add", x=[torch.tensor([1.0])] * 4, binary=True, full=True)
    assert answer["dispatch_mode"] is None and values(answer["output"]) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="keyword arguments only"):
        client.call("accumulator", "add", 10, binary=True)


def test_binary_output_keeps_dotted_keys(client):
    weights = client.call("mlp", "get_weights", binary_output=True)
    assert len(weights) == 4
    assert set(weights[2]) == {"gate_up_proj.weight", "down_proj.weight"}
    assert torch.equal(weights[2]["gate_up_proj.weight"], torch.full((2, 2), 2.0))
    as_json = client.call("mlp", "get_weights")
    assert torch.equal(as_json[3]["gate_up_proj.weight"], torch.full((2, 2), 3.0))


def test_binary_call_with_an_output_safetensors_cannot_carry(client):
    with pytest.raises(ServiceError) as caught:
        client.call("accumulator", "add", x=1, binary=True)
    assert caught.value.status_code == 406


def test_errors_carry_status_message_and_retry_after(client):
    with pytest.raises(ServiceError) as caught:
        client.call("busy", "add")
    assert caught.value.status_code == 503 and caught.value.retry_after == 5.0
    assert "rebuilding" in caught.value.message and "retry after 5 s" in str(caught.value)
    with pytest.raises(ServiceError) as caught:
        client.call("gpu_accumulator", "add", x=[1, 1, 1])
    assert caught.value.status_code == 422 and "4 ranks" in caught.value.message
    with pytest.raises(ServiceError) as caught:
        client.call("broken", "add")
    assert caught.value.status_code == 500 and caught.value.message == "Internal Server Error"


def test_bearer_token_and_idempotency_key(fake):
    url, state = fake
    state["token"] = TOKEN
    try:
        with SingleControllerClient(url) as anonymous, pytest.raises(ServiceError) as caught:
            anonymous.groups()
        assert caught.value.status_code == 401
        with SingleControllerClient(url, token=TOKEN) as c:
            assert len(c.groups()) == 3
            c.call("accumulator", "add", 10, idempotency_key="key-1")
            assert state["seen"]["headers"]["authorization"] == f"Bearer {TOKEN}"
            assert state["seen"]["headers"]["idempotency-key"] == "key-1"
            c.call("accumulator", "add", 10)
            assert "idempotency-key" not in state["seen"]["headers"]
    finally:
        state["token"] = None


def test_group_proxy(client):
    group = client.group_proxy("gpu_accumulator")
    assert values(group.add(x=[3, 3, 3, 3])) == [3, 4, 5, 6]
    assert client.group_proxy("test_actor").foo_rank_zero(x=1, y=2) == 5
    assert "gpu_accumulator" in repr(group)


def test_infer_binary_and_json(client, fake):
    _, state = fake
    x = torch.randn(5, 3)
    y = client.infer("double", x)
    assert torch.equal(y, x * 2)
    sent = state["seen"]["inference"]
    assert sent["inputs"][0]["parameters"] == {"binary_data_size": 60}
    assert sent["outputs"] == [{"name": "y", "parameters": {"binary_data": True}}]
    assert torch.allclose(client.infer("double", x.numpy(), binary=False), x * 2)
    result = client.infer_tensors("double", {"x": x}, request_id="r-9")
    assert result.model_name == "double" and result.id == "r-9" and result.model_version == "1"
    assert set(result.outputs) == {"y", "z"} and torch.equal(result.outputs["z"], x + 1)
    assert all("parameters" in o for o in result.raw["outputs"])  # binary_data_output asked for binary
    assert client.model_metadata("double")["inputs"][0]["shape"] == [-1, 3]
    assert "binary_tensor_data" in client.server_metadata()["extensions"]
    with pytest.raises(ServiceError) as caught:
        client.infer("nope", x)
    assert caught.value.status_code == 404


# -- async client ---------------------------------------------------------------------------


def test_async_client_over_asgi():
    app, state = make_fake_service()

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with AsyncSingleControllerClient("http://fake", token=TOKEN, transport=transport) as c:
            assert await c.healthy() and await c.ready()
            assert (await c.health())["status"] == "live"
            assert len(await c.groups()) == 3
            assert (await c.group("mlp"))["world_size"] == 4
            output = await c.call("gpu_accumulator", "add", x=[1, 1, 1, 1])
            assert values(output) == [1, 2, 3, 4]
            binary = await c.call("gpu_accumulator", "add", x=[2, 2, 2, 2], binary=True, idempotency_key="k")
            assert values(binary) == [2, 3, 4, 5]
            assert state["seen"]["headers"]["idempotency-key"] == "k"
            assert state["seen"]["headers"]["authorization"] == f"Bearer {TOKEN}"
            assert await c.group_proxy("test_actor").foo_rank_zero(x=1, y=2) == 5
            x = torch.randn(2, 3)
            assert torch.equal(await c.infer("double", x), x * 2)
            assert set((await c.infer_tensors("double", {"x": x})).outputs) == {"y", "z"}
            assert (await c.model_metadata("double"))["name"] == "double"
            assert (await c.server_metadata())["name"] == "fake"
            with pytest.raises(ServiceError) as caught:
                await c.call("busy", "add")
            assert caught.value.retry_after == 5.0
            state["ready"] = False
            assert not await c.ready()
            assert not await c.wait_ready(timeout=0.2, interval=0.05)

    asyncio.run(scenario())


def test_both_clients_have_the_same_methods():
    def public(cls: type) -> set[str]:
        return {name for name in dir(cls) if not name.startswith("_")}

    assert public(SingleControllerClient) - {"close"} == public(AsyncSingleControllerClient) - {"aclose"}
    assert {"submit_job", "job", "wait_job", "job_result", "cancel_job"} <= public(AsyncSingleControllerClient)


def test_jobs_with_the_blocking_client(client):
    job = client.submit_job("gpu_accumulator", "add", kwargs={"x": [1, 1, 1, 1]}, split=2)
    assert job["split"] == 2 and job["status"] == "running"
    seen: list[float] = []
    final = client.wait_job(job["id"], on_progress=lambda status: seen.append(status["progress"]), interval=0.01)
    assert final["status"] == "succeeded" and seen == [0.5, 1.0]
    assert values(client.job_result(job["id"])) == [1, 2, 3, 4]
    assert values(client.job_result(job["id"], binary=True, full=True)["output"]) == [1, 2, 3, 4]
    assert client.cancel_job(job["id"])["status"] == "cancelled"


def test_jobs_with_the_async_client():
    app, _ = make_fake_service()

    async def scenario() -> None:
        async with AsyncSingleControllerClient("http://fake", transport=httpx.ASGITransport(app=app)) as c:
            job = await c.submit_job("gpu_accumulator", "add", kwargs={"x": [2, 2, 2, 2]}, split=4)
            assert (await c.job(job["id"]))["progress"] == 0.5
            final = await c.wait_job(job["id"], interval=0.01)
            assert final["status"] == "succeeded" and final["split"] == 4
            assert values(await c.job_result(job["id"], binary=True)) == [2, 3, 4, 5]
            answer = await c.job_result(job["id"], full=True)
            assert answer["world_size"] == 4 and values(answer["output"]) == [2, 3, 4, 5]
            assert (await c.cancel_job(job["id"]))["status"] == "cancelled"

    asyncio.run(scenario())


# -- command line ---------------------------------------------------------------------------


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_health_groups_and_group(fake, capsys):
    url, state = fake
    state.update(ready=True, token=None)
    code, out, _ = run_cli(capsys, "--url", url, "health")
    assert code == 0 and "live: yes" in out and "ready: yes" in out
    state["ready"] = False
    code, out, _ = run_cli(capsys, "health", "--url", url)  # --url after the command works too
    assert code == 1 and "ready: no" in out
    state["ready"] = True
    code, out, _ = run_cli(capsys, "groups", "--url", url)
    assert code == 0 and "gpu_accumulator" in out and "add(EXECUTE_ALL)" in out
    code, out, _ = run_cli(capsys, "groups", "--json", "--url", url)
    assert [g["name"] for g in json.loads(out)] == ["accumulator", "gpu_accumulator", "mlp"]
    code, out, _ = run_cli(capsys, "group", "mlp", "--url", url)
    assert code == 0 and json.loads(out)["world_size"] == 4


def test_cli_call(fake, capsys):
    url, state = fake
    state.update(ready=True, token=None)
    code, out, err = run_cli(capsys, "call", "gpu_accumulator", "add", "--kwargs", '{"x": [1, 1, 1, 1]}', "--url", url)
    assert code == 0, err
    assert out.strip() == "[tensor([1.]), tensor([2.]), tensor([3.]), tensor([4.])]"
    assert "EXECUTE_ALL" in err and "world size 4" in err
    code, out, err = run_cli(
        capsys, "call", "gpu_accumulator", "add", "--kwargs", '{"x": [1, 1, 1, 1]}', "--binary", "--json", "--url", url
    )
    assert code == 0, err
    assert [item["data"] for item in json.loads(out)] == [[1.0], [2.0], [3.0], [4.0]]
    assert state["seen"]["content_type"] == SAFETENSORS
    code, out, _ = run_cli(capsys, "call", "accumulator", "add", "--args", "[10]", "--url", url,
                           "--idempotency-key", "abc")
    assert code == 0 and out.strip() == "None"
    assert state["seen"]["headers"]["idempotency-key"] == "abc"
    code, out, _ = run_cli(capsys, "call", "any", "slow", "--url", url)
    assert code == 0 and out.strip() == "'done'"


def test_cli_errors(fake, capsys):
    url, _ = fake
    code, _, err = run_cli(capsys, "call", "busy", "add", "--url", url)
    assert code == 1 and "HTTP 503" in err and "retry after 5 s" in err
    code, _, err = run_cli(capsys, "call", "accumulator", "add", "--args", "[1]", "--binary", "--url", url)
    assert code == 2 and "keyword arguments only" in err
    code, _, err = run_cli(capsys, "call", "accumulator", "add", "--kwargs", "[1]", "--url", url)
    assert code == 2 and "JSON object" in err
    with pytest.raises(SystemExit) as caught:
        cli.main(["call", "accumulator", "add", "--kwargs", "{oops"])
    assert caught.value.code == 2
    code, _, err = run_cli(capsys, "--url", "http://127.0.0.1:9", "--timeout", "2", "health")
    assert code == 3 and "cannot reach" in err


def test_cli_infer(fake, capsys):
    url, state = fake
    code, out, err = run_cli(capsys, "infer", "double", "--shape", "4,3", "--random", "--url", url)
    assert code == 0, err
    assert "y: FP32 [4, 3]" in out and "z: FP32 [4, 3]" in out and "mean" in out
    assert state["seen"]["inference"]["inputs"][0]["parameters"]["binary_data_size"] == 48
    code, out, err = run_cli(capsys, "infer", "double", "--output", "y", "--json-data", "--url", url)
    assert code == 0, err
    assert "y: FP32 [1, 3]" in out and "first values: [2.0, 2.0, 2.0]" in out  # shape from metadata, ones
    assert "data" in state["seen"]["inference"]["inputs"][0]


def test_progress_wrapper_returns_and_raises():
    assert cli.wait_with_progress("quick", lambda: 42) == 42
    assert cli.wait_with_progress("slow", lambda: time.sleep(0.25) or "ok", enabled=True) == "ok"

    def fail() -> None:
        raise ServiceError(500, "boom")

    with pytest.raises(ServiceError, match="boom"):
        cli.wait_with_progress("failing", fail, enabled=False)

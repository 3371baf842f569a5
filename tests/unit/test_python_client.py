"""clients.python_client and clients.cli against the service's real FastAPI app
(``hybridflow.http.app.create_app``) over a stub backend in place of the controllers (no Ray):
the HTTP contract is the service's own, only what the groups answer is made up here.

The blocking client and the CLI talk to it through uvicorn on 127.0.0.1; the async client
through httpx.ASGITransport. A thin ASGI wrapper records what each request carried.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
import torch

from hybridflow.control.contract import (
    CallRequest,
    CallResult,
    ControllerError,
    ErrorKind,
    GroupSummary,
    InferResult,
    MethodSummary,
)
from hybridflow.http.app import create_app
from hybridflow.http.settings import IngressSettings, ModelRoute
from hybridflow_client import cli
from hybridflow_client.python_client import AsyncSingleControllerClient, ServiceError, SingleControllerClient
from hybridflow_client.wire.oip_messages import parse_infer_request
from hybridflow_client.wire.safetensors_body import decode_safetensors
from tests.unit.served_app import served

SAFETENSORS = "application/x-safetensors"
TOKEN = "s3cret"
WORLD_SIZES = {"accumulator": 1, "gpu_accumulator": 4, "mlp": 4, "test_actor": 4, "any": 4, "busy": 4, "broken": 4}
METHODS = {"accumulator": [("add", "EXECUTE_ALL")], "gpu_accumulator": [("add", "EXECUTE_ALL")],
           "mlp": [("get_weights", "ONE_TO_ALL")]}


def summary(name: str) -> GroupSummary:
    return GroupSummary(
        name=name, deployment="stub", world_size=WORLD_SIZES[name], resource_pool=f"pool [{WORLD_SIZES[name]}]",
        worker_class=name.title(), status="ready", last_error=None, rebuilds=0, replayed_calls=0, journal_length=0,
        methods=[MethodSummary(m, mode, "ALL", mode != "EXECUTE_ALL", False) for m, mode in METHODS[name]],
    )


class StubBackend:
    """What the controllers would answer, made up; ``state`` records the calls it got."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    async def call(self, request: CallRequest) -> CallResult:
        self.state["call"] = request
        modes = {"dispatch_mode": "EXECUTE_ALL", "execute_mode": "ALL", "world_size": WORLD_SIZES[request.group]}
        if request.group == "busy":
            return CallResult(error=ControllerError(ErrorKind.UNAVAILABLE, "group 'busy' is rebuilding; retry shortly",
                                                    5.0), **modes)
        if request.group == "broken":
            raise RuntimeError("the controller broke")
        args, kwargs, method = request.args, request.kwargs, request.method
        if request.group == "gpu_accumulator" and method == "add":
            (x,) = kwargs.values() if kwargs else args
            if len(x) != 4:
                return CallResult(error=ControllerError(ErrorKind.BAD_ARGUMENTS, f"add: x has {len(x)} items, "
                                                        "the group has 4 ranks"), **modes)
            return CallResult([torch.tensor([float(rank)]) + x[rank] for rank in range(4)], **modes)
        if request.group == "accumulator" and method == "add":
            return CallResult(None, **modes)
        if request.group == "test_actor" and method == "foo_rank_zero":
            return CallResult(2 + kwargs["x"] + kwargs["y"], **modes)
        if request.group == "mlp" and method == "get_weights":
            return CallResult([{"gate_up_proj.weight": torch.full((2, 2), float(r)), "down_proj.weight": torch.ones(2, 1)}
                               for r in range(4)], **modes)
        if method == "echo":
            return CallResult({"args": args, "kwargs": kwargs}, **modes)
        if method == "score":  # a PROTO method: verl's DataProto in, DataProto out
            data = kwargs["data"]
            data.meta_info["scored"] = True
            return CallResult(data, **modes)
        if method == "slow":
            await asyncio.sleep(0.3)
            return CallResult("done", **modes)
        return CallResult(error=ControllerError(ErrorKind.UNKNOWN_METHOD, f"group {request.group!r} has no method "
                                                f"{method!r}"))

    async def describe(self) -> list[GroupSummary]:
        return [summary(name) for name in METHODS]

    async def describe_group(self, group: str) -> GroupSummary | ControllerError:
        if group not in WORLD_SIZES:
            return ControllerError(ErrorKind.UNKNOWN_GROUP, f"unknown group {group!r}")
        found = summary(group)
        found.ranks = [{"rank": r, "local_rank": r} for r in range(WORLD_SIZES[group])]
        return found

    async def ready(self) -> dict[str, bool]:
        return {"mlp": self.state["ready"], "gpu_accumulator": True}

    async def model_metadata(self, model: str) -> dict[str, Any] | ControllerError:
        spec = {"datatype": "FP32", "shape": [-1, 3]}
        return {"name": model, "versions": ["1"], "platform": "stub",
                "inputs": [{"name": "x", **spec}], "outputs": [{"name": "y", **spec}, {"name": "z", **spec}]}

    async def model_ready(self, model: str) -> bool:
        return True

    async def infer(self, model: str, inputs: dict[str, Any]) -> InferResult:
        x = inputs["x"]
        return InferResult(outputs={"y": x * 2, "z": x + 1})


class StubJobs:
    """Jobs run at once; the first status poll says running, half done."""

    def __init__(self, backend: StubBackend) -> None:
        self.backend = backend
        self.state = backend.state

    async def submit(self, controller: str, request: CallRequest, split: int) -> dict[str, Any] | ControllerError:
        result = await self.backend.call(request)
        job = {"id": f"job-{len(self.state['jobs'])}", "group": request.group, "method": request.method,
               "status": "running", "progress": 0.5, "split": split, "error": None, "error_kind": None,
               "cancel_requested": False, "submitted_at": time.time(), "elapsed_s": 0.0}
        self.state["jobs"][job["id"]] = (job, result)
        return dict(job)

    async def status(self, job_id: str) -> dict[str, Any] | None:
        job, _ = self.state["jobs"][job_id]
        shown = dict(job)
        job.update(status="succeeded", progress=1.0)
        return shown

    async def result(self, job_id: str) -> dict[str, Any] | None:
        job, result = self.state["jobs"][job_id]
        return {"job": dict(job), "outcome": result}

    async def cancel(self, job_id: str) -> dict[str, Any] | None:
        job, _ = self.state["jobs"][job_id]
        job["status"] = "cancelled"
        return dict(job)

    async def list_jobs(self) -> list[dict[str, Any]]:
        return [job for job, _ in self.state["jobs"].values()]


def make_service() -> tuple[Any, dict[str, Any]]:
    """The real app over the stub, wrapped to record each request's headers and body."""
    state: dict[str, Any] = {"ready": True, "seen": {}, "jobs": {}, "token": None}
    apps = {
        token: create_app(stub := StubBackend(state), IngressSettings(
            auth_token=token,
            groups={name: "stub" for name in WORLD_SIZES},
            models={"double": ModelRoute(deployment="stub", group="any", outputs=["y", "z"])},
        ), StubJobs(stub))
        for token in (None, TOKEN)
    }

    async def recording(scope, receive, send):
        if scope["type"] != "http":
            return await apps[None](scope, receive, send)
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        state["seen"] = {"headers": headers, "content_type": headers.get("content-type", ""), "body": body}
        if headers.get("content-type", "").startswith(SAFETENSORS):
            state["seen"]["names"] = sorted(decode_safetensors(body))
        elif scope["path"].endswith("/infer"):
            length = headers.get("inference-header-content-length")
            state["seen"]["inference"] = parse_infer_request(body, length)[0]
        elif body:
            state["seen"]["json"] = json.loads(body)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await apps[state["token"]](scope, replay, send)

    return recording, state


@pytest.fixture(scope="module")
def fake():
    """The app served by uvicorn on a free 127.0.0.1 port: (url, state)."""
    app, state = make_service()
    with served(app) as url:
        yield url, state


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
    assert client.health()["status"] == "live" and client.healthy()
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


def test_a_dataproto_goes_as_safetensors_and_comes_back(client, fake):
    import numpy as np

    from single_controller.protocol import DataProto

    _, state = fake
    data = DataProto.from_dict({"x": torch.arange(6.0).reshape(3, 2)}, {"uid": np.array(["a", "b", "c"])},
                               meta_info={"step": 1})
    out = client.call("any", "score", data=data)
    assert state["seen"]["content_type"] == SAFETENSORS and state["seen"]["names"] == ["data@x"]
    assert state["seen"]["headers"]["accept"] == SAFETENSORS
    assert isinstance(out, DataProto) and torch.equal(out.batch["x"], data.batch["x"])
    assert out.non_tensor_batch["uid"].tolist() == ["a", "b", "c"] and out.meta_info == {"step": 1, "scored": True}


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
    # JSON like every error, without the traceback
    assert caught.value.status_code == 500 and caught.value.message.startswith("internal error (RuntimeError)")
    assert "the controller broke" not in caught.value.message


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
    app, state = make_service()

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
            assert (await c.server_metadata())["name"] == "hybridflow-single-controller"
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
    app, _ = make_service()

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

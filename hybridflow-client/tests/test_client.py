"""The clients and the CLI without a service: an ``httpx.MockTransport`` answers what the
service would (its answers written out here) and records what each request carried."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from typing import Any

import httpx
import numpy as np
import pytest
import safetensors.numpy
from helpers import as_numpy, returned_type

from hybridflow_client import cli
from hybridflow_client.python_client import AsyncSingleControllerClient, ServiceError, SingleControllerClient

SAFETENSORS = "application/x-safetensors"
GROUPS = [
    {"name": "gpu_accumulator", "world_size": 4, "status": "ready", "resource_pool": "pool [4]",
     "methods": [{"name": "add", "dispatch_mode": "EXECUTE_ALL"}]},
    {"name": "test_actor", "world_size": 4, "status": "ready", "resource_pool": "pool [4]",
     "methods": [{"name": "foo", "dispatch_mode": "EXECUTE_ALL"}]},
]


def tensor(value: float) -> dict[str, Any]:
    return {"datatype": "FP32", "shape": [1], "data": [value]}


class FakeService:
    """Answers a few of the service's routes; ``seen`` is the last request."""

    def __init__(self) -> None:
        self.seen: httpx.Request | None = None
        self.ready = True
        self.job_polls = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen = request
        path, method = request.url.path, request.method
        if path == "/healthz":
            return httpx.Response(200, json={"status": "live"})
        if path == "/readyz":
            return httpx.Response(200 if self.ready else 503, json={"ready": self.ready})
        if path == "/v1/groups":
            return httpx.Response(200, json={"groups": GROUPS})
        if path == "/v1/groups/busy/add":
            return httpx.Response(503, json={"error": "group 'busy' is rebuilding"}, headers={"Retry-After": "5"})
        if path == "/v1/groups/gpu_accumulator/add":
            return self.add(request)
        if path == "/v1/groups/test_actor/foo_rank_zero":
            return httpx.Response(200, json={"group": "test_actor", "method": "foo_rank_zero", "output": 5})
        if path == "/v2/models/double":
            return httpx.Response(200, json={"name": "double", "inputs": [{"name": "x", "datatype": "FP32",
                                                                           "shape": [-1, 3]}]})
        if path == "/v2/models/double/infer":
            return self.double(request)
        if path.startswith("/v1/jobs"):
            return self.jobs(method, path)
        return httpx.Response(404, json={"error": f"no route {path}"})

    def add(self, request: httpx.Request) -> httpx.Response:
        """The tutorial's add on 4 ranks whose values start at their rank."""
        if request.headers["content-type"] == SAFETENSORS:
            x = safetensors.numpy.load(request.content)
            values = [float(x[f"x.{rank}"]) for rank in range(len(x))]
        else:
            values = json.loads(request.content)["kwargs"]["x"]
        if len(values) != 4:
            return httpx.Response(422, json={"error": f"add: x has {len(values)} items, the group has 4 ranks"})
        outputs = [rank + value for rank, value in enumerate(values)]
        if request.headers["accept"] == SAFETENSORS:
            body = safetensors.numpy.save({f"output.{r}": np.float32([v]) for r, v in enumerate(outputs)})
            return httpx.Response(200, content=body, headers={"Content-Type": SAFETENSORS})
        return httpx.Response(200, json={"group": "gpu_accumulator", "method": "add", "dispatch_mode": "EXECUTE_ALL",
                                         "execute_mode": "ALL", "world_size": 4,
                                         "output": [tensor(v) for v in outputs]})

    def double(self, request: httpx.Request) -> httpx.Response:
        """y = 2x, binary when the request was."""
        length = request.headers.get("inference-header-content-length")
        header = json.loads(request.content[: int(length)] if length else request.content)
        (entry,) = header["inputs"]
        if length:
            x = np.frombuffer(request.content[int(length):], dtype="<f4").reshape(entry["shape"])
        else:
            x = np.array(entry["data"], dtype=np.float32).reshape(entry["shape"])
        y = {"name": "y", "datatype": "FP32", "shape": entry["shape"]}
        if not length:
            answer = json.dumps({"model_name": "double", "outputs": [{**y, "data": (2 * x).ravel().tolist()}]})
            return httpx.Response(200, content=answer.encode(), headers={"Content-Type": "application/json"})
        answer = json.dumps({"model_name": "double", "model_version": "1", "id": header.get("id"),
                             "outputs": [{**y, "parameters": {"binary_data_size": x.nbytes}}]}).encode()
        return httpx.Response(200, content=answer + (2 * x).astype("<f4").tobytes(),
                              headers={"Content-Type": "application/octet-stream",
                                       "Inference-Header-Content-Length": str(len(answer))})

    def jobs(self, method: str, path: str) -> httpx.Response:
        status = {"id": "job-1", "group": "gpu_accumulator", "method": "add", "progress": 0.5, "status": "running",
                  "elapsed_s": 0.25}
        if method == "POST":
            return httpx.Response(202, json=status)
        if path.endswith("/result"):
            return httpx.Response(200, json={"group": "gpu_accumulator", "method": "add", "output": [tensor(1.0)]})
        self.job_polls += 1
        if self.job_polls > 1:
            status.update(progress=1.0, status="succeeded")
        return httpx.Response(200, json=status)


@pytest.fixture
def fake() -> FakeService:
    return FakeService()


@pytest.fixture
def client(fake):
    with SingleControllerClient("http://fake", token="s3cret", transport=httpx.MockTransport(fake)) as c:
        yield c


def values(output: list) -> list[float]:
    return [float(as_numpy(t).item()) for t in output]


def test_health_groups_and_errors(client, fake):
    assert client.health() == {"status": "live"} and client.healthy() and client.ready()
    fake.ready = False
    assert not client.ready() and not client.wait_ready(timeout=0.2, interval=0.05)
    assert [g["name"] for g in client.groups()] == ["gpu_accumulator", "test_actor"]
    assert fake.seen.headers["authorization"] == "Bearer s3cret"
    with pytest.raises(ServiceError) as caught:
        client.group("nope")
    assert caught.value.status_code == 404 and caught.value.message == "no route /v1/groups/nope"
    with pytest.raises(ServiceError) as caught:
        client.call("busy", "add", x=[1])
    assert caught.value.retry_after == 5.0
    assert str(caught.value) == "HTTP 503: group 'busy' is rebuilding (retry after 5 s)"


def test_an_unreachable_service_is_not_ready():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with SingleControllerClient("http://fake", transport=httpx.MockTransport(refuse)) as c:
        assert not c.wait_ready(timeout=0.1, interval=0.05)
        with pytest.raises(httpx.ConnectError):
            c.groups()


def test_calls_json_and_binary(client, fake, mode):
    output = client.call("gpu_accumulator", "add", x=[1, 1, 1, 1])
    assert values(output) == [1, 2, 3, 4] and all(isinstance(t, returned_type(mode)) for t in output)
    assert fake.seen.content == b'{"args":[],"kwargs":{"x":[1,1,1,1]}}'
    answer = client.call("gpu_accumulator", "add", x=[np.float32(2)] * 4, binary=True, full=True,
                         idempotency_key="k-1")
    assert answer["dispatch_mode"] is None and values(answer["output"]) == [2, 3, 4, 5]
    assert fake.seen.headers["content-type"] == SAFETENSORS and fake.seen.headers["idempotency-key"] == "k-1"
    with pytest.raises(ServiceError, match="4 ranks"):
        client.call("gpu_accumulator", "add", x=[1, 1])
    with pytest.raises(ValueError, match="keyword arguments only"):
        client.call("gpu_accumulator", "add", 1, binary=True)
    assert client.group_proxy("test_actor").foo_rank_zero(x=1, y=2) == 5


def test_infer_binary_and_json(client, fake, mode):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    y = client.infer("double", x, request_id="r-1")
    assert isinstance(y, returned_type(mode)) and np.array_equal(as_numpy(y), 2 * x)
    assert fake.seen.headers["content-type"] == "application/octet-stream"
    assert np.array_equal(as_numpy(client.infer("double", x, binary=False)), 2 * x)
    result = client.infer_tensors("double", {"x": x.tolist()}, request_id="r-2")
    assert result.model_name == "double" and result.model_version == "1" and result.id == "r-2"
    with pytest.raises(ServiceError, match="no output 'z'"):
        client.infer("double", x, output_name="z")


def test_jobs(client, fake):
    job = client.submit_job("gpu_accumulator", "add", kwargs={"x": [1, 1, 1, 1]}, split=2)
    assert job["id"] == "job-1" and fake.seen.url.params["split"] == "2"
    seen: list[float] = []
    final = client.wait_job("job-1", on_progress=lambda status: seen.append(status["progress"]), interval=0.01)
    assert final["status"] == "succeeded" and seen == [0.5, 1.0]
    assert values(client.job_result("job-1")) == [1.0]


def test_async_client(fake, mode):
    async def scenario() -> None:
        async with AsyncSingleControllerClient("http://fake", transport=httpx.MockTransport(fake)) as c:
            assert await c.ready() and len(await c.groups()) == 2
            assert values(await c.call("gpu_accumulator", "add", x=[1, 1, 1, 1], binary=True)) == [1, 2, 3, 4]
            x = np.ones((1, 3), np.float32)
            assert np.array_equal(as_numpy(await c.infer("double", x)), 2 * x)
            assert await c.group_proxy("test_actor").foo_rank_zero(x=1, y=2) == 5

    asyncio.run(scenario())


def test_both_clients_have_the_same_methods():
    def public(cls: type) -> set[str]:
        return {name for name in dir(cls) if not name.startswith("_")}

    assert public(SingleControllerClient) - {"close"} == public(AsyncSingleControllerClient) - {"aclose"}


# -- CLI -----------------------------------------------------------------------------------


def run_cli(fake: FakeService, capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["--url", "http://fake", *argv], transport=httpx.MockTransport(fake))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_commands(fake, capsys, numpy_only):
    code, out, _ = run_cli(fake, capsys, "health")
    assert code == 0 and out == "live: yes\nready: yes\n"
    code, out, _ = run_cli(fake, capsys, "groups")
    assert code == 0
    assert out.splitlines()[1].split() == ["gpu_accumulator", "4", "ready", "pool", "[4]", "add(EXECUTE_ALL)"]
    code, out, err = run_cli(fake, capsys, "call", "gpu_accumulator", "add", "--kwargs", '{"x": [1, 1, 1, 1]}', "--json")
    assert code == 0 and [o["data"] for o in json.loads(out)] == [[1.0], [2.0], [3.0], [4.0]]
    assert "EXECUTE_ALL/ALL, world size 4" in err
    code, out, _ = run_cli(fake, capsys, "call", "gpu_accumulator", "add", "--kwargs", '{"x": [1, 1, 1, 1]}',
                           "--binary")
    assert code == 0 and out.startswith("[array([1.], dtype=float32)")
    code, out, _ = run_cli(fake, capsys, "infer", "double", "--output", "y")
    assert code == 0 and "y: FP32 [1, 3] mean 2 std 0 min 2 max 2" in out and "first values: [2.0, 2.0, 2.0]" in out
    code, out, _ = run_cli(fake, capsys, "job", "gpu_accumulator", "add", "--kwargs", '{"x": [1, 1, 1, 1]}',
                           "--no-progress")
    assert code == 0 and out.strip() == "[array([1.], dtype=float32)]"


def test_cli_exit_statuses(fake, capsys, numpy_only):
    code, _, err = run_cli(fake, capsys, "call", "busy", "add")
    assert code == 1 and "HTTP 503" in err and "retry after 5 s" in err
    code, _, err = run_cli(fake, capsys, "call", "gpu_accumulator", "add", "--args", "[1]", "--binary")
    assert code == 2 and "keyword arguments only" in err
    code, _, err = run_cli(fake, capsys, "infer", "double", "--datatype", "BF16")
    assert code == 2 and "BF16 input needs torch" in err
    with pytest.raises(SystemExit) as caught:
        cli.main(["call", "g", "m", "--kwargs", "{oops"])
    assert caught.value.code == 2
    assert cli.main(["--url", "http://127.0.0.1:9", "--timeout", "2", "groups"]) == 3
    assert "cannot reach" in capsys.readouterr().err


def test_progress_wrapper_returns_and_raises():
    assert cli.wait_with_progress("quick", lambda: 42) == 42

    def fail() -> None:
        raise ServiceError(500, "boom")

    with pytest.raises(ServiceError, match="boom"):
        cli.wait_with_progress("failing", fail, enabled=False)


# -- installing alone ------------------------------------------------------------------------

#: Top-level modules a client process must never import (the service's and its stack's).
SERVER_ONLY = ["wire", "app", "deployments", "single_controller", "hybridflow", "ray", "fastapi", "starlette",
               "uvicorn", "megatron", "tensordict", "omegaconf", "verl", "torch"]

GUARDED = textwrap.dedent(
    """
    import importlib.abc, sys

    BLOCKED = set(sys.argv[1].split(","))

    class Blocked(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"the client imported {name!r}")
            return None

    sys.meta_path.insert(0, Blocked())
    import httpx, numpy as np
    from hybridflow_client import SingleControllerClient, cli

    def answer(request):
        return httpx.Response(200, json={"output": [{"datatype": "FP32", "shape": [1], "data": [2.0]}]})

    with SingleControllerClient("http://fake", transport=httpx.MockTransport(answer)) as client:
        (y,) = client.call("g", "m", x=np.ones(1, np.float32), binary=False)
    assert isinstance(y, np.ndarray) and y.tolist() == [2.0]
    assert cli.build_parser().parse_args(["groups"]).command == "groups"
    print(sorted(name for name in sys.modules if name.split(".")[0] in BLOCKED))
    """
)


def test_the_client_imports_and_works_without_the_server_or_torch():
    result = subprocess.run([sys.executable, "-c", GUARDED, ",".join(SERVER_ONLY)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"

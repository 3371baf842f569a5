"""Against a running service: the shipped ``serve_config.yaml`` (``serve run
serve_config.yaml``), named by ``HYBRIDFLOW_URL`` (every test here skips when it is unset;
``HYBRIDFLOW_TOKEN`` is the bearer token, if the service wants one).

Only calls that change nothing are made (the test actor's methods and its two transport
models, listings and metadata), so the tests may run against a service in use. The
numbers are the tutorial's: TestActor(x=2) on 4 ranks answers ``foo(y=3)`` with
``[5, 5, 5, 5]``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from helpers import as_numpy, returned_type

from hybridflow_client import AsyncSingleControllerClient, ServiceError, SingleControllerClient, WireDataProto

TUTORIAL_GROUPS = {"accumulator", "gpu_accumulator", "gpu_accumulator_a", "gpu_accumulator_merge",
                   "gpu_accumulator_decorator", "test_actor", "mlp"}


@pytest.fixture(scope="module")
def client(service_url, service_token):
    with SingleControllerClient(service_url, token=service_token, timeout=120) as c:
        if not c.wait_ready(timeout=120):
            pytest.fail(f"{service_url} did not become ready within 120 s")
        yield c


def test_health_and_the_groups(client):
    assert client.healthy() and client.ready() and client.health()["status"] == "live"
    groups = {g["name"]: g for g in client.groups()}
    assert set(groups) >= TUTORIAL_GROUPS
    assert groups["test_actor"]["world_size"] == 4 and groups["gpu_accumulator_merge"]["world_size"] == 8
    methods = {m["name"]: m for m in groups["test_actor"]["methods"]}
    assert methods["foo"]["dispatch_mode"] == "EXECUTE_ALL"
    assert (methods["foo_rank_zero"]["dispatch_mode"], methods["foo_rank_zero"]["execute_mode"]) == ("ALL_TO_ALL",
                                                                                                   "RANK_ZERO")
    assert [r["rank"] for r in client.group("test_actor")["ranks"]] == [0, 1, 2, 3]


def test_the_test_actor_answers_the_tutorials_numbers(client):
    assert client.call("test_actor", "foo", y=3) == [5, 5, 5, 5]
    assert client.call("test_actor", "foo_custom", x=[1, 2], y=[5, 6]) == [8, 10, 8, 10]
    answer = client.call("test_actor", "foo_rank_zero", x=1, y=2, full=True)
    assert answer["output"] == 5 and answer["execute_mode"] == "RANK_ZERO" and answer["world_size"] == 4
    assert client.group_proxy("test_actor").foo(y=3) == [5, 5, 5, 5]


def test_tensors_in_json_and_safetensors_calls(client, mode):
    out = client.call("test_actor", "foo", y=np.array([0.5], np.float32))
    assert len(out) == 4 and all(isinstance(t, returned_type(mode)) for t in out)
    assert [as_numpy(t).tolist() for t in out] == [[2.5]] * 4
    out = client.call("test_actor", "foo", y=np.array([3.0], np.float32), binary=True)
    assert [as_numpy(t).tolist() for t in out] == [[5.0]] * 4
    x = np.random.default_rng(0).random((3, 5, 7), dtype=np.float32)
    assert np.array_equal(as_numpy(client.call("test_actor", "echo", x=x)), x)
    assert np.array_equal(as_numpy(client.call("test_actor", "echo", x=x, binary=True)), x)
    total = as_numpy(client.call("test_actor", "checksum", x=x, binary=True))
    assert total.dtype == np.float64 and total.tolist() == pytest.approx([x.astype(np.float64).sum()], rel=1e-12)


def test_the_transport_models_over_oip(client, mode):
    x = np.random.default_rng(1).random((2, 3, 4), dtype=np.float32)
    for binary in (True, False):
        echoed = client.infer("echo", x, binary=binary)
        assert isinstance(echoed, returned_type(mode)) and np.array_equal(as_numpy(echoed), x)
        summed = as_numpy(client.infer("checksum", x, binary=binary))
        assert summed.dtype == np.float64 and summed.shape == (1,)
        assert summed[0] == pytest.approx(float(x.astype(np.float64).sum()), rel=1e-12)
    # README's curl example: [1, 2, 3.5] sums to 6.5, as JSON both ways
    result = client.infer_tensors("checksum", {"x": np.array([[[1, 2, 3.5]]], np.float32)},
                                  binary_inputs=False, binary_outputs=False)
    assert (result.model_name, result.model_version) == ("checksum", "1")
    assert result.raw["outputs"] == [{"name": "y", "datatype": "FP64", "shape": [1], "data": [6.5]}]
    assert client.model_metadata("checksum")["outputs"] == [{"name": "y", "datatype": "FP64", "shape": [1]}]
    assert "binary_tensor_data" in client.server_metadata()["extensions"]


def test_a_dataproto_without_verl(client, mode):
    data = WireDataProto.from_dict(
        {"x": np.arange(16, dtype=np.float32).reshape(8, 2)}, {"uid": np.arange(8)}, {"stage": "rollout"}
    )
    out = client.call("test_actor", "score", data=data)
    assert isinstance(out, WireDataProto) and len(out) == 8
    assert np.array_equal(as_numpy(out.batch["y"]), data.batch["x"] * 2)
    assert out.non_tensor_batch["uid"].tolist() == list(range(8))
    assert out.non_tensor_batch["rank"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert out.meta_info == {"stage": "rollout", "world_size": 4}


def test_errors(client):
    for call in (lambda: client.call("nope", "add"), lambda: client.call("test_actor", "nope"),
                 lambda: client.infer("nope", np.ones((1, 1, 1), np.float32)), lambda: client.group("nope")):
        with pytest.raises(ServiceError) as caught:
            call()
        assert caught.value.status_code == 404 and caught.value.message
    with pytest.raises(ServiceError) as caught:
        client.call("test_actor", "foo", y={"datatype": "FP32", "shape": [2], "data": [1.0]})
    assert caught.value.status_code == 422


def test_the_async_client(service_url, service_token):
    async def scenario() -> None:
        async with AsyncSingleControllerClient(service_url, token=service_token, timeout=120) as c:
            assert await c.ready() and {g["name"] for g in await c.groups()} >= TUTORIAL_GROUPS
            assert await c.call("test_actor", "foo_rank_zero", x=1, y=2) == 5
            x = np.ones((1, 2, 3), np.float32)
            assert np.array_equal(as_numpy(await c.infer("echo", x)), x)

    asyncio.run(scenario())


# -- the CLI, as a user runs it --------------------------------------------------------------


def cli(service_url: str, service_token: str | None, *argv: str, module: bool = False) -> subprocess.CompletedProcess:
    script = shutil.which("hybridflow", path=os.path.dirname(sys.executable))
    command = [sys.executable, "-m", "hybridflow_client.cli"] if module or script is None else [script]
    env = {**os.environ, "HYBRIDFLOW_URL": service_url}
    if service_token:
        env["HYBRIDFLOW_TOKEN"] = service_token
    return subprocess.run([*command, *argv, "--no-progress"], capture_output=True, text=True, timeout=300, env=env)


def test_the_cli(service_url, service_token):
    done = cli(service_url, service_token, "health")
    assert done.returncode == 0 and done.stdout == "live: yes\nready: yes\n", done.stderr
    done = cli(service_url, service_token, "groups")
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line for line in done.stdout.splitlines()[1:]}
    assert set(rows) >= TUTORIAL_GROUPS and "foo(EXECUTE_ALL)" in rows["test_actor"]
    done = cli(service_url, service_token, "call", "test_actor", "foo", "--kwargs", '{"y": 3}')
    assert done.returncode == 0 and done.stdout.strip() == "[5, 5, 5, 5]", done.stderr
    assert "EXECUTE_ALL" in done.stderr and "world size 4" in done.stderr
    done = cli(service_url, service_token, "call", "test_actor", "foo", "--kwargs", '{"y": 3}', "--binary", "--json",
               module=True)
    assert done.returncode == 0, done.stderr
    assert [(o["datatype"], o["data"]) for o in json.loads(done.stdout)] == [("INT64", [5])] * 4
    done = cli(service_url, service_token, "infer", "checksum", "--shape", "1,1,3")
    assert done.returncode == 0 and "y: FP64 [1]" in done.stdout and "first values: [3.0]" in done.stdout, done.stderr
    done = cli(service_url, service_token, "call", "nope", "add")
    assert done.returncode == 1 and "HTTP 404" in done.stderr

"""End to end: `serve run serve_config.yaml` started as a user would, driven with httpx.

The first test replays the tutorial's calls in its order on the service's groups as it
finds them: each answer is the group's state before plus the call's effect (a fresh
start's numbers are test_readme_answers.py's and the Ray layer's tutorial test's); later
tests use groups the tutorial does not mutate, or read the state before they change it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.mlp_reference import SMALL, assert_close, from_json, reference_mlp, to_json

httpx = pytest.importorskip("httpx")
safetensors_torch = pytest.importorskip("safetensors.torch")


def call(http, group, method, **body):
    response = http.post(f"/v1/groups/{group}/{method}", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def tensor_values(output):
    values = []
    for item in output:
        assert item["datatype"] == "FP32" and item["shape"] == [1], item
        values.append(item["data"][0])
    return values


def test_tutorial_in_order_over_http(http):
    # Chapter 1: the plain accumulator
    value = call(http, "accumulator", "get_value")["output"]
    assert call(http, "accumulator", "add", args=[10])["output"] is None
    assert call(http, "accumulator", "get_value")["output"] == value + 10
    # Chapter 2: each rank holds its rank plus what was added to it
    before = {group: tensor_values(call(http, group, "get_value")["output"])
              for group in ("gpu_accumulator", "gpu_accumulator_a", "gpu_accumulator_merge")}
    answer = call(http, "gpu_accumulator", "add", kwargs={"x": [1, 1, 1, 1]})
    assert answer["group"] == "gpu_accumulator" and answer["method"] == "add"
    assert answer["world_size"] == 4 and answer["dispatch_mode"] == "EXECUTE_ALL"
    assert tensor_values(answer["output"]) == [v + 1 for v in before["gpu_accumulator"]]
    added = call(http, "gpu_accumulator_a", "add", kwargs={"x": [2] * 4})["output"]
    assert tensor_values(added) == [v + 2 for v in before["gpu_accumulator_a"]]
    merged = call(http, "gpu_accumulator_merge", "add", kwargs={"x": [3] * 8})
    assert tensor_values(merged["output"]) == [v + 3 for v in before["gpu_accumulator_merge"]]
    sizes = {g["name"]: g["world_size"] for g in http.get("/v1/groups").json()["groups"]}
    assert (sizes["gpu_accumulator"], sizes["gpu_accumulator_a"], sizes["gpu_accumulator_merge"]) == (4, 4, 8)
    # Chapter 3: the decorated add sends its one value to all 8 ranks
    base = tensor_values(call(http, "gpu_accumulator_decorator", "get_value")["output"])
    decorated = call(http, "gpu_accumulator_decorator", "add", kwargs={"x": 10})
    assert decorated["dispatch_mode"] == "ONE_TO_ALL"
    assert tensor_values(decorated["output"]) == [v + 10 for v in base]
    custom = call(http, "test_actor", "foo_custom", kwargs={"x": [1, 2], "y": [5, 6]})
    assert custom["output"] == [8, 10, 8, 10]
    assert custom["dispatch_mode"].startswith("custom:")
    rank_zero = call(http, "test_actor", "foo_rank_zero", kwargs={"x": 1, "y": 2})
    assert rank_zero["output"] == 5 and rank_zero["execute_mode"] == "RANK_ZERO"
    assert call(http, "test_actor", "foo", kwargs={"y": 3})["output"] == [5, 5, 5, 5]


def test_tensor_objects_in_requests(http):
    one = {"datatype": "FP32", "shape": [1], "data": [0.5]}
    out = call(http, "test_actor", "foo", kwargs={"y": one})["output"]
    assert [o["data"] for o in out] == [[2.5]] * 4


def test_group_listing_and_details(http):
    groups = {g["name"]: g for g in http.get("/v1/groups").json()["groups"]}
    assert set(groups) >= {
        "accumulator", "gpu_accumulator", "gpu_accumulator_a", "gpu_accumulator_merge",
        "gpu_accumulator_decorator", "test_actor", "mlp",
    }
    methods = {m["name"]: m for m in groups["test_actor"]["methods"]}
    assert methods["foo_rank_zero"]["dispatch_mode"] == "ALL_TO_ALL"
    assert methods["foo_rank_zero"]["execute_mode"] == "RANK_ZERO"
    assert methods["foo"]["dispatch_mode"] == "EXECUTE_ALL"
    mlp_methods = {m["name"]: m["dispatch_mode"] for m in groups["mlp"]["methods"]}
    assert mlp_methods == {"init_model": "ONE_TO_ALL", "get_weights": "ONE_TO_ALL", "run_layer": "MEGATRON_COMPUTE",
                           "train_step": "ONE_TO_ALL"}
    merged = http.get("/v1/groups/gpu_accumulator_merge").json()
    assert [r["local_rank"] for r in merged["ranks"]] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert all(r["node_id"] for r in merged["ranks"])
    mlp = http.get("/v1/groups/mlp").json()
    assert [r["tp_rank"] for r in mlp["ranks"]] == [0, 1, 2, 3]
    assert {r["dp_rank"] for r in mlp["ranks"]} == {0} and {r["pp_rank"] for r in mlp["ranks"]} == {0}
    assert (mlp["tp_size"], mlp["dp_size"], mlp["pp_size"]) == (4, 1, 1)


def test_safetensors_request_and_answer(http):
    body = safetensors_torch.save({"y": torch.tensor([3.0])})
    response = http.post(
        "/v1/groups/test_actor/foo",
        content=body,
        headers={"Content-Type": "application/x-safetensors", "Accept": "application/x-safetensors"},
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/x-safetensors")
    out = safetensors_torch.load(response.content)
    assert sorted(out) == [f"output.{r}" for r in range(4)]
    assert all(out[f"output.{r}"].tolist() == [5.0] for r in range(4))


@pytest.fixture(scope="module")
def small_layer(http):
    call(http, "mlp", "init_model", kwargs={"config": SMALL})
    weights = call(http, "mlp", "get_weights")["output"]
    assert len(weights) == 4
    assert from_json(weights[0]["gate_up_proj.weight"]).shape == (2 * 128 // 4, 64)
    assert from_json(weights[0]["down_proj.weight"]).shape == (64, 128 // 4)
    return weights


def test_mlp_layer_through_json(http, small_layer):
    x = torch.rand(8, 2, 64)
    answer = call(http, "mlp", "run_layer", args=[[to_json(x)]])
    assert answer["dispatch_mode"] == "MEGATRON_COMPUTE" and len(answer["output"]) == 1
    y = from_json(answer["output"][0])
    assert y.shape == (8, 2, 64)
    assert_close(y, reference_mlp(small_layer, x))


def test_mlp_layer_through_safetensors(http, small_layer):
    x = torch.rand(4, 3, 64)
    response = http.post(
        "/v1/groups/mlp/run_layer",
        content=safetensors_torch.save({"x.0": x}),
        headers={"Content-Type": "application/x-safetensors", "Accept": "application/x-safetensors"},
    )
    assert response.status_code == 200, response.text
    y = safetensors_torch.load(response.content)["output.0"]
    assert_close(y, reference_mlp(small_layer, x))


def test_mlp_layer_through_oip_json(http, small_layer):
    x = torch.rand(5, 2, 64)
    meta = http.get("/v2/models/mlp").json()
    assert meta["inputs"][0]["name"] == "x" and meta["inputs"][0]["shape"] == [-1, -1, 64]
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [5, 2, 64], "data": x.flatten().tolist()}]}
    response = http.post("/v2/models/mlp/infer", json=body)
    assert response.status_code == 200, response.text
    (out,) = response.json()["outputs"]
    assert out["name"] == "y" and out["shape"] == [5, 2, 64]
    assert_close(from_json(out), reference_mlp(small_layer, x))


def test_tritonclient_against_v2(service, small_layer):
    tritonclient = pytest.importorskip("tritonclient.http")
    client = tritonclient.InferenceServerClient(service.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("mlp")
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    x = np.random.rand(6, 2, 64).astype(np.float32)
    inp = tritonclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)  # binary by default
    result = client.infer("mlp", [inp], outputs=[tritonclient.InferRequestedOutput("y")])
    y = result.as_numpy("y")
    assert y.shape == (6, 2, 64)
    assert_close(torch.from_numpy(y.copy()), reference_mlp(small_layer, torch.from_numpy(x)))
    # defaults: no requested outputs at all
    y2 = client.infer("mlp", [inp]).as_numpy("y")
    assert np.allclose(y, y2)


def test_transport_models_echo_and_checksum_over_binary_routes(service, http):
    """A tensor in by safetensors and by OIP binary: echoed back bit for bit, and summed
    on rank 0 (the upload-bandwidth route of bench/)."""
    tritonclient = pytest.importorskip("tritonclient.http")
    x = torch.rand(3, 5, 7)
    expected = float(x.to(torch.float64).sum())
    response = http.post(
        "/v1/groups/test_actor/checksum",
        content=safetensors_torch.save({"x": x}),
        headers={"Content-Type": "application/x-safetensors", "Accept": "application/x-safetensors"},
    )
    assert response.status_code == 200, response.text
    (total,) = safetensors_torch.load(response.content).values()
    assert total.dtype == torch.float64 and total.tolist() == pytest.approx([expected], rel=1e-12)
    client = tritonclient.InferenceServerClient(service.url.removeprefix("http://"))
    inp = tritonclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x.numpy())
    echoed = client.infer("echo", [inp], outputs=[tritonclient.InferRequestedOutput("y")]).as_numpy("y")
    assert np.array_equal(echoed, x.numpy())
    summed = client.infer("checksum", [inp]).as_numpy("y")
    assert summed.dtype == np.float64 and summed.shape == (1,) and summed[0] == pytest.approx(expected, rel=1e-12)
    assert http.get("/v2/models/checksum").json()["outputs"] == [{"name": "y", "datatype": "FP64", "shape": [1]}]


def test_errors_are_json_with_status(http):
    before = tensor_values(call(http, "gpu_accumulator", "get_value")["output"])
    cases = [
        (http.post("/v1/groups/nope/add", json={}), 404),
        (http.post("/v1/groups/test_actor/nope", json={}), 404),
        (http.post("/v1/groups/test_actor/__init__", json={}), 404),
        (http.post("/v1/groups/test_actor/execute_all_sync", json={}), 404),
        (http.post("/v1/groups/test_actor/_configure_from_env", json={}), 404),
        (http.post("/v1/groups/gpu_accumulator/add", json={"kwargs": {"x": [1, 1, 1]}}), 422),
        (http.post("/v1/groups/test_actor/foo", content=b"{not json", headers={"Content-Type": "application/json"}), 400),
        (http.post("/v1/groups/test_actor/foo", content=b"\x80\x04K\x01.", headers={"Content-Type": "application/python-pickle"}), 415),
        (http.post("/v1/groups/test_actor/foo", content=b"garbage", headers={"Content-Type": "application/x-safetensors"}), 400),
        (http.post("/v1/groups/test_actor/foo", content=b'{"kwargs": {"y": NaN}}', headers={"Content-Type": "application/json"}), 400),
        (http.post("/v1/groups/test_actor/foo", json={"kwargs": {"y": {"datatype": "FP32", "shape": [2], "data": [1.0]}}}), 422),
        (http.get("/v1/groups/nope"), 404),
        (http.get("/no/such/route"), 404),
        (http.get("/v2/models/nope"), 404),
    ]
    for response, status in cases:
        assert response.status_code == status, (response.request.url, response.text)
        assert isinstance(response.json()["error"], str) and response.json()["error"]
    # the failed add changed nothing
    assert tensor_values(call(http, "gpu_accumulator", "get_value")["output"]) == before


def test_health_and_openapi(http):
    assert http.get("/healthz").status_code == 200
    assert http.get("/readyz").status_code == 200
    assert http.get("/v2/health/live").status_code == 200
    assert http.get("/v2/health/ready").status_code == 200
    spec = http.get("/openapi.json").json()
    paths = spec["paths"]
    for path in ("/healthz", "/readyz", "/v1/groups", "/v1/groups/{group}", "/v1/groups/{group}/{method}",
                 "/v2", "/v2/models/{model}", "/v2/models/{model}/infer"):
        assert path in paths, path
    body = paths["/v1/groups/{group}/{method}"]["post"]["requestBody"]["content"]
    assert "application/json" in body and "application/x-safetensors" in body


def test_a_dataproto_crosses_the_service_both_ways(service):
    """verl's batch type through a served PROTO method: the Python client sends it as
    safetensors (tensors) plus JSON (non-tensor columns, meta_info) and gets one back,
    equal to what the method answers in the library (rows split over 4 ranks, joined)."""
    from hybridflow_client import SingleControllerClient
    from single_controller.protocol import DataProto

    prompts = np.empty(8, dtype=object)
    for i in range(8):
        prompts[i] = f"prompt {i}" if i % 3 else ["tokens", i]
    data = DataProto.from_dict(
        tensors={"x": torch.arange(16.0).reshape(8, 2)},
        non_tensors={"prompt": prompts, "uid": np.arange(8)},
        meta_info={"temperature": 0.7, "stage": {"name": "rollout", "step": 3}},
    )
    with SingleControllerClient(service.url) as client:
        out = client.call("test_actor", "score", data=data)
    assert isinstance(out, DataProto) and len(out) == 8
    assert torch.equal(out.batch["y"], data.batch["x"] * 2)
    assert out.non_tensor_batch["prompt"].tolist() == prompts.tolist()
    assert out.non_tensor_batch["uid"].tolist() == list(range(8))
    assert out.non_tensor_batch["rank"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert out.meta_info == {**data.meta_info, "world_size": 4}

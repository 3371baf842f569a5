"""A group whose worker declares a mesh, served from YAML alone (a worker package in a
temporary directory on PYTHONPATH): its mesh-dispatched methods
called over HTTP with a DataProto body and with TensorDict bodies holding a jagged tensor
(JSON and safetensors, both ways), a mutating one journaled, the mesh's dp size and
collecting ranks in GET /v1/groups/{group}, and the ``_query_*`` methods a group asks its
ranks out of a caller's reach. The group (``doubler``: 4 ranks, mesh "actor" dp=2 x tp=2,
tp rank 0 answering for its dp rank) is served by the small service (tests/e2e/conftest.py)."""

from __future__ import annotations

import httpx
import pytest
import torch

from hybridflow_client.wire.safetensors_call import decode_output_body, encode_call_body
from single_controller.protocol import DataProto

pytestmark = pytest.mark.own_cluster  # the small service: serve run in a cluster of its own

ROWS = [[1, 2, 3], [4], [5, 6, 7, 8], [9, 10]]
X = [1.5, -2.0, 3.0, 4.25]
TAGS = ["a", ["b", 1], None, {"c": True}]


@pytest.fixture(scope="module")
def http(small_service):
    with httpx.Client(base_url=small_service.url, timeout=120) as client:
        yield client


def tensor(datatype: str, data: list) -> dict:
    return {"datatype": datatype, "shape": [len(data)], "data": data}


def tensordict_body() -> dict:
    """The documented JSON form, written by hand: a jagged ``ids`` as its values and
    offsets, a dense ``x``, a column of Python objects and batch metadata."""
    offsets = [0]
    for row in ROWS:
        offsets.append(offsets[-1] + len(row))
    ids = {"values": tensor("INT64", [v for row in ROWS for v in row]), "offsets": tensor("INT64", offsets),
           "ragged_dim": 1}
    return {"__tensordict__": {"batch_size": [4], "tensors": {"ids": ids, "x": tensor("FP32", X)},
                               "objects": {"tags": TAGS}, "metadata": {"scale": 3}}}


def rows_of(entry: dict) -> list[list[int]]:
    values, offsets = entry["values"]["data"], entry["offsets"]["data"]
    return [values[start:end] for start, end in zip(offsets, offsets[1:], strict=False)]


def test_the_group_shows_its_mesh_and_lists_its_methods(http):
    group = http.get("/v1/groups/doubler").json()
    assert group["status"] == "ready" and group["world_size"] == 4
    assert group["meshes"] == {"actor": {"dp_size": 2, "collect_ranks": [0, 2]}}
    methods = {m["name"]: m for m in group["methods"]}
    assert sorted(methods) == ["double", "learn", "rows_seen"]
    assert methods["double"]["dispatch_mode"] == "ND_COMPUTE_PROTO(actor)" and methods["double"]["read_only"]


def test_a_dataproto_body_is_split_by_the_mesh_and_collected_from_its_collecting_ranks(http):
    data = DataProto.from_dict({"x": torch.tensor(X)}, {"tag": ["r0", "r1", "r2", "r3"]}, meta_info={"step": 7})
    answer = http.post("/v1/groups/doubler/double", content=encode_call_body({"data": data}),
                       headers={"Content-Type": "application/x-safetensors"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["dispatch_mode"] == "ND_COMPUTE_PROTO(actor)"
    out = body["output"]["__dataproto__"]
    assert out["rows"] == 4 and out["meta_info"] == {"step": 7}
    assert out["batch"]["x"]["data"] == [2 * v for v in X]
    assert out["batch"]["who"]["data"] == [0, 0, 2, 2]  # dp 0 from rank 0, dp 1 from rank 2
    assert out["non_tensor_batch"]["tag"]["data"] == ["r0", "r1", "r2", "r3"]


def test_a_json_tensordict_with_a_jagged_tensor_comes_back_doubled(http):
    answer = http.post("/v1/groups/doubler/double", json={"kwargs": {"data": tensordict_body()}})
    assert answer.status_code == 200, answer.text
    out = answer.json()["output"]["__tensordict__"]
    assert out["batch_size"] == [4]
    assert rows_of(out["tensors"]["ids"]) == [[2 * v for v in row] for row in ROWS]
    assert out["tensors"]["ids"]["ragged_dim"] == 1
    assert out["tensors"]["x"]["data"] == [2 * v for v in X]
    assert out["tensors"]["who"]["data"] == [0, 0, 2, 2]
    assert out["objects"] == {"tags": TAGS} and out["metadata"] == {"scale": 6}


def test_a_safetensors_tensordict_comes_back_as_safetensors(http):
    from single_controller import tensordict_utils as tu

    ids = torch.nested.as_nested_tensor([torch.tensor(row) for row in ROWS], layout=torch.jagged)
    data = tu.get_tensordict({"ids": ids, "x": torch.tensor(X), "tags": TAGS}, {"scale": 5})
    answer = http.post("/v1/groups/doubler/double", content=encode_call_body({"data": data}),
                       headers={"Content-Type": "application/x-safetensors", "Accept": "application/x-safetensors"})
    assert answer.status_code == 200, answer.text
    out = decode_output_body(answer.content)
    assert [row.tolist() for row in out.get("ids").unbind(0)] == [[2 * v for v in row] for row in ROWS]
    assert out.get("x").tolist() == [2 * v for v in X] and out.get("who").tolist() == [0, 0, 2, 2]
    assert tu.get(out, "tags") == TAGS and tu.get(out, "scale") == 10


def test_a_mutating_call_with_a_tensordict_is_journaled(http):
    journal = http.get("/v1/groups/doubler").json()["journal_length"]
    answer = http.post("/v1/groups/doubler/learn", json={"kwargs": {"data": tensordict_body()}})
    assert answer.status_code == 200, answer.text
    assert http.get("/v1/groups/doubler").json()["journal_length"] == journal + 1
    seen = http.post("/v1/groups/doubler/rows_seen", json={}).json()["output"]
    assert seen == [2, 2, 2, 2]  # every rank got its dp rank's two rows


def test_a_hostile_tensordict_is_a_json_4xx_and_changes_nothing(http):
    journal = http.get("/v1/groups/doubler").json()["journal_length"]
    body = tensordict_body()
    body["__tensordict__"]["tensors"]["ids"]["offsets"]["data"] = [0, 3, 2, 8, 10]
    answer = http.post("/v1/groups/doubler/learn", json={"kwargs": {"data": body}})
    assert answer.status_code == 422 and "offsets decrease" in answer.json()["error"]
    assert http.get("/v1/groups/doubler").json()["journal_length"] == journal


@pytest.mark.parametrize("method", ["_query_dispatch_info", "_query_collect_info", "_query_meshes",
                                    "_register_dispatch_collect_info"])
def test_the_methods_a_group_asks_its_ranks_are_not_callable_over_http(http, method):
    answer = http.post(f"/v1/groups/doubler/{method}", json={"args": ["actor"]})
    assert answer.status_code == 404 and "no callable method" in answer.json()["error"]

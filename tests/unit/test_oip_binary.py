"""The OIP binary tensor data extension in hybridflow_client.wire.oip_messages, checked against tritonclient's
own request builder and response parser (no server), plus the pydantic OIP models."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hybridflow.http.oip_models import InferRequest, InferResponse, ModelMetadata, ServerMetadata
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.oip_messages import (
    build_infer_request,
    build_infer_response,
    parse_infer_request,
    parse_infer_response,
)

tritonhttp = pytest.importorskip("tritonclient.http")
ml_dtypes = pytest.importorskip("ml_dtypes")
InferenceServerClient = tritonhttp.InferenceServerClient

NUMPY_CASES = {
    "BOOL": np.array([[True, False], [False, True]]),
    "UINT8": np.array([0, 7, 255], dtype=np.uint8),
    "INT8": np.array([-128, 0, 127], dtype=np.int8),
    "INT16": np.array([-300, 2], dtype=np.int16),
    "INT32": np.arange(12, dtype=np.int32).reshape(3, 4),
    "INT64": np.array([-(2**62), 2**62], dtype=np.int64),
    "FP16": np.array([0.5, -2.0, 65504.0], dtype=np.float16),
    "FP32": np.linspace(-1, 1, 24, dtype=np.float32).reshape(2, 3, 4),
    "FP64": np.array([1e-300, -1e300], dtype=np.float64),
    "BF16": np.array([1.5, -0.25, 3.0], dtype=ml_dtypes.bfloat16),
}


def to_torch(array: np.ndarray) -> torch.Tensor:
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype is torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def triton_input(name: str, array: np.ndarray, datatype: str, binary: bool = True):
    item = tritonhttp.InferInput(name, list(array.shape), datatype)
    item.set_data_from_numpy(array, binary_data=binary)
    return item


# -- requests as tritonclient builds them ----------------------------------------------------


@pytest.mark.parametrize("datatype", list(NUMPY_CASES))
def test_tritonclient_binary_request_parses(datatype):
    array = NUMPY_CASES[datatype]
    body, json_size = InferenceServerClient.generate_request_body([triton_input("x", array, datatype)])
    assert json_size is not None
    request, inputs = parse_infer_request(body, json_size)
    assert request["inputs"][0]["parameters"]["binary_data_size"] == array.nbytes
    assert request["parameters"] == {"binary_data_output": True}
    assert list(inputs) == ["x"]
    assert inputs["x"].shape == array.shape
    assert np.array_equal(to_numpy(inputs["x"]), array)


@pytest.mark.parametrize("datatype", list(NUMPY_CASES))
def test_a_writable_request_body_is_viewed_in_place_where_aligned_and_copied_otherwise(datatype):
    array = NUMPY_CASES[datatype]
    body, json_size = InferenceServerClient.generate_request_body([triton_input("x", array, datatype)])
    header, data = body[:json_size], body[json_size:]
    for pad in range(8):  # JSON may end in spaces: every offset of the binary data
        padded = header + b" " * pad
        writable = bytearray(padded + data)  # what the ingress reads a request into
        start = np.frombuffer(writable, dtype=np.uint8).ctypes.data
        _, inputs = parse_infer_request(writable, len(padded))
        assert np.array_equal(to_numpy(inputs["x"]), array)
        viewed = inputs["x"].data_ptr() == start + len(padded)
        assert viewed == ((start + len(padded)) % array.itemsize == 0)  # misaligned bytes are copied
        _, copied = parse_infer_request(bytes(padded + data), len(padded))  # read-only: always a copy
        assert copied["x"].data_ptr() not in range(start, start + len(writable))
        assert np.array_equal(to_numpy(copied["x"]), array)


def test_tritonclient_mixed_json_and_binary_inputs_keep_their_order():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([1, 2, 3], dtype=np.int64)
    c = np.array([[True], [False]])
    d = np.arange(4, dtype=np.int16)
    inputs = [
        triton_input("a", a, "FP32"),
        triton_input("b", b, "INT64", binary=False),
        triton_input("c", c, "BOOL"),
        triton_input("d", d, "INT16"),
    ]
    outputs = [tritonhttp.InferRequestedOutput("y", binary_data=True), tritonhttp.InferRequestedOutput("z", binary_data=False)]
    body, json_size = InferenceServerClient.generate_request_body(inputs, outputs=outputs, request_id="r1")
    request, tensors = parse_infer_request(body, json_size)
    assert request["id"] == "r1"
    assert [o["name"] for o in request["outputs"]] == ["y", "z"]
    assert request["outputs"][0]["parameters"]["binary_data"] is True
    assert list(tensors) == ["a", "b", "c", "d"]
    for name, array in zip("abcd", (a, b, c, d), strict=True):
        assert np.array_equal(tensors[name].numpy(), array), name


def test_tritonclient_json_only_request_parses_without_header_length():
    x = np.array([[0.25, -1.0]], dtype=np.float32)
    body, json_size = InferenceServerClient.generate_request_body([triton_input("x", x, "FP32", binary=False)])
    assert json_size is None
    _, tensors = parse_infer_request(body, None)
    assert np.array_equal(tensors["x"].numpy(), x)


def test_empty_tensor_binary_round_trip():
    empty = np.zeros((0, 4), dtype=np.float32)
    body, json_size = InferenceServerClient.generate_request_body([triton_input("x", empty, "FP32")])
    _, tensors = parse_infer_request(body, json_size)
    assert tensors["x"].shape == (0, 4)


# -- responses as tritonclient parses them ------------------------------------------------


@pytest.mark.parametrize("datatype", list(NUMPY_CASES))
def test_binary_response_parses_in_tritonclient(datatype):
    array = NUMPY_CASES[datatype]
    body, header_length = build_infer_response("mlp", "1", {"y": to_torch(array)}, binary=True, id="7")
    assert header_length is not None
    result = InferenceServerClient.parse_response_body(body, header_length=header_length)
    assert result.get_response()["model_name"] == "mlp" and result.get_response()["id"] == "7"
    got = result.as_numpy("y")
    assert got.dtype == array.dtype and got.shape == array.shape
    assert np.array_equal(got, array)


@pytest.mark.parametrize("datatype", [d for d in NUMPY_CASES if d != "BF16"])
def test_json_response_parses_in_tritonclient(datatype):
    array = NUMPY_CASES[datatype]
    body, header_length = build_infer_response("m", "1", {"y": to_torch(array)}, binary=False)
    assert header_length is None
    result = InferenceServerClient.parse_response_body(body)
    assert np.array_equal(result.as_numpy("y"), array)


def test_mixed_response_only_named_outputs_are_binary():
    outputs = {"a": torch.arange(3, dtype=torch.int32), "b": torch.ones(2, 2), "c": torch.tensor([True, False])}
    body, header_length = build_infer_response("m", None, outputs, binary={"b", "missing"})
    header = json.loads(body[:header_length])
    assert "model_version" not in header
    assert [("data" in o, "parameters" in o) for o in header["outputs"]] == [(True, False), (False, True), (True, False)]
    assert header["outputs"][1]["parameters"] == {"binary_data_size": 16}
    assert len(body) == header_length + 16
    result = InferenceServerClient.parse_response_body(body, header_length=header_length)
    for name, tensor in outputs.items():
        assert np.array_equal(result.as_numpy(name), tensor.numpy())


def test_non_finite_json_outputs_survive_tritonclient():
    y = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])
    body, _ = build_infer_response("m", "1", {"y": y}, binary=False)
    got = InferenceServerClient.parse_response_body(body).as_numpy("y")
    assert got[0] == 1 and np.isnan(got[1]) and got[2] == np.inf and got[3] == -np.inf
    _, tensors = parse_infer_response(body, None)
    assert torch.equal(torch.isnan(tensors["y"]), torch.isnan(y))


def test_our_request_builder_matches_the_parser():
    x = torch.randn(8, 2, 64)
    flags = torch.tensor([True, False, True])
    body, header_length = build_infer_request({"x": x, "flags": flags}, binary={"x"}, outputs=["y"], id="q")
    request, inputs = parse_infer_request(body, header_length)
    assert request["outputs"] == [{"name": "y", "parameters": {"binary_data": True}}]
    assert torch.equal(inputs["x"], x) and torch.equal(inputs["flags"], flags)
    body, header_length = build_infer_request({"x": x}, binary=False, binary_outputs=False)
    assert header_length is None and "parameters" not in json.loads(body)


def test_our_response_parser_reads_what_we_build():
    outputs = {"y": torch.randn(3, 5).to(torch.bfloat16), "n": torch.tensor([1, 2])}
    body, header_length = build_infer_response("m", "1", outputs, binary={"y"})
    response, tensors = parse_infer_response(body, header_length)
    assert response["model_name"] == "m"
    assert torch.equal(tensors["y"], outputs["y"]) and torch.equal(tensors["n"], outputs["n"])


# -- malformed requests -------------------------------------------------------------------


def binary_body(header: dict, payload: bytes) -> tuple[bytes, int]:
    raw = json.dumps(header).encode()
    return raw + payload, len(raw)


def one_input(size: int, shape=(2,), datatype="FP32") -> dict:
    return {"inputs": [{"name": "x", "datatype": datatype, "shape": list(shape), "parameters": {"binary_data_size": size}}]}


@pytest.mark.parametrize(
    ("body_and_length", "message"),
    [
        ((b'{"inputs": []}', None), "non-empty 'inputs'"),
        ((b"[1, 2]", None), "must be a JSON object"),
        ((b"{not json", None), "not valid JSON"),
        ((b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [NaN]}]}', None), "not valid JSON"),
        ((b"{}", 3), "does not fit a body of 2 bytes"),
        ((b"{}", -1), "does not fit"),
        (binary_body(one_input(8), b"\0" * 8), None),  # well-formed: the control case
        (binary_body(one_input(4), b"\0" * 4), "binary_data_size is 4 bytes but shape [2] of FP32 needs 8"),
        (binary_body(one_input(8), b"\0" * 4), "4 bytes short"),
        (binary_body(one_input(8), b"\0" * 12), "4 bytes after the JSON header"),
        (binary_body(one_input(8, datatype="FP8"), b"\0" * 8), "unknown datatype 'FP8'"),
        (binary_body(one_input(8, datatype="BYTES"), b"\0" * 8), "BYTES"),
        (binary_body(one_input(8, shape=(-2,)), b"\0" * 8), "negative dimension"),
        (binary_body(one_input(2, datatype="BOOL"), b"\x00\x02"), "BOOL bytes must be 0 or 1"),
        (binary_body({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": -8}}]}, b""), "non-negative integer"),
        (binary_body({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0], "parameters": {"binary_data_size": 4}}]}, b"\0" * 4), "both 'data' and"),
        (binary_body({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]}, b""), "neither 'data' nor"),
        (binary_body({"inputs": [{"datatype": "FP32", "shape": [1], "data": [1.0]}]}, b""), "needs a non-empty string 'name'"),
        (binary_body({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}] * 2}, b""), "given twice"),
        (binary_body({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1.0]}]}, b""), "data has 1 values but shape [2] needs 2"),
        (binary_body({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "parameters": {"shared_memory_region": "r"}}]}, b""), "shared-memory"),
        (binary_body({"id": 5, "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}]}, b""), "'id' must be a string"),
        (binary_body({"outputs": ["y"], "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}]}, b""), "'outputs' must be a list of objects"),
    ],
)
def test_malformed_requests_raise_codec_errors(body_and_length, message):
    body, length = body_and_length
    if message is None:
        parse_infer_request(body, length)
        return
    with pytest.raises(WireError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_infer_request(body, length)


def test_binary_data_without_header_length_is_an_error():
    header = json.dumps(one_input(8)).encode()
    with pytest.raises(WireError, match="no Inference-Header-Content-Length"):
        parse_infer_request(header, None)


def test_truncated_tritonclient_body_is_an_error():
    x = np.arange(16, dtype=np.float32)
    body, json_size = InferenceServerClient.generate_request_body([triton_input("x", x, "FP32")])
    with pytest.raises(WireError, match="short"):
        parse_infer_request(body[:-1], json_size)
    with pytest.raises(WireError):
        parse_infer_request(body, json_size - 1)


# -- pydantic models ----------------------------------------------------------------------


def test_models_accept_what_tritonclient_sends():
    x = np.arange(4, dtype=np.float32)
    body, json_size = InferenceServerClient.generate_request_body(
        [triton_input("x", x, "FP32")], outputs=[tritonhttp.InferRequestedOutput("y")]
    )
    request = InferRequest.model_validate_json(body[:json_size])
    assert request.inputs[0].parameters.binary_data_size == 16
    assert request.outputs[0].parameters.binary_data is True
    response_body, header_length = build_infer_response("m", "1", {"y": torch.ones(2)}, binary=True)
    response = InferResponse.model_validate_json(response_body[:header_length])
    assert response.outputs[0].parameters.binary_data_size == 8


def test_models_validate_and_describe():
    with pytest.raises(ValueError, match="needs data"):
        InferRequest.model_validate({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32"}]})
    with pytest.raises(ValueError):
        InferRequest.model_validate({"inputs": [{"name": "x", "shape": [1], "datatype": "STRING", "data": ["a"]}]})
    with pytest.raises(ValueError):
        InferRequest.model_validate({"inputs": []})
    assert "binary_tensor_data" in ServerMetadata(name="s", version="1").extensions
    meta = ModelMetadata.model_validate(
        {"name": "mlp", "versions": ["1"], "platform": "pytorch", "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, -1, 64]}],
         "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, -1, 64]}]}
    )
    assert meta.inputs[0].shape == [-1, -1, 64]
    with pytest.raises(ValueError, match="-1 for any size"):
        ModelMetadata.model_validate(
            {"name": "m", "platform": "p", "inputs": [{"name": "x", "datatype": "FP32", "shape": [-2]}], "outputs": []}
        )
    schema = InferRequest.model_json_schema()
    assert schema["properties"]["inputs"]["description"]
    assert schema["$defs"]["InferInputTensor"]["properties"]["shape"]["description"]

"""The Open Inference Protocol's gRPC messages (hybridflow.oip_grpc.messages) against
tritonclient.grpc's own: requests as its client builds them, answers as its InferResult
reads them, and every malformed request refused with a message before a model runs."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

tritongrpc = pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2 as pb  # noqa: E402
from tritonclient.grpc._utils import _get_inference_request  # noqa: E402

from hybridflow.oip_grpc.messages import (  # noqa: E402
    chosen_outputs,
    decode_infer_request,
    encode_infer_response,
    model_metadata_response,
    parameters_of,
    raw_bytes,
)
from hybridflow_client.wire.errors import WireError  # noqa: E402
from hybridflow_client.wire.limits import WireLimits  # noqa: E402

NUMPY_OF = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}


def triton_request(
    inputs: dict[str, np.ndarray], outputs: list[str] | None = None, **kwargs
) -> pb.ModelInferRequest:
    """The ModelInferRequest tritonclient.grpc's infer() sends for these arrays."""
    items = []
    for name, array in inputs.items():
        item = tritongrpc.InferInput(name, list(array.shape), tritongrpc.np_to_triton_dtype(array.dtype))
        items.append(item.set_data_from_numpy(array))
    asked = None if outputs is None else [tritongrpc.InferRequestedOutput(name) for name in outputs]
    options = {
        "model_version": "",
        "request_id": "",
        "sequence_id": 0,
        "sequence_start": False,
        "sequence_end": False,
        "priority": 0,
        "timeout": None,
        "parameters": None,
        **kwargs,
    }
    return _get_inference_request(model_name="m", inputs=items, outputs=asked, **options)


def typed_request(datatype: str, shape: list[int], **contents) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype=datatype, shape=shape, contents=pb.InferTensorContents(**contents))
    return request


def refused(request: pb.ModelInferRequest, match: str, limits: WireLimits | None = None) -> None:
    with pytest.raises(WireError, match=match):
        decode_infer_request(request, limits=limits or WireLimits())


# -- requests as tritonclient sends them ------------------------------------------------------


@pytest.mark.parametrize("datatype", sorted(NUMPY_OF))
def test_tritonclient_raw_inputs_decode_to_equal_tensors(datatype):
    generator = np.random.default_rng(7)
    array = (generator.random((2, 3, 4)) * 100).astype(NUMPY_OF[datatype])
    call = decode_infer_request(triton_request({"x": array}, outputs=["y"], request_id="r-1"))
    assert call.model == "m" and call.id == "r-1" and call.outputs == ["y"]
    (tensor,) = call.inputs.values()
    assert tensor.shape == (2, 3, 4) and torch.equal(tensor, torch.from_numpy(array))
    assert tensor.numpy().flags.writeable  # a tensor of its own, not a view of the message's bytes


def test_tritonclient_bf16_input_decodes_bit_for_bit():
    array = np.array([[1.5, -2.25, 3e8]], dtype=ml_dtypes.bfloat16)
    (tensor,) = decode_infer_request(triton_request({"x": array})).inputs.values()
    assert tensor.dtype is torch.bfloat16
    assert torch.equal(tensor.view(torch.int16), torch.from_numpy(array.view(np.int16)))


def test_several_inputs_keep_their_order_and_their_own_bytes():
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.array([7, 8], dtype=np.int64)
    call = decode_infer_request(triton_request({"a": a, "b": b}))
    assert list(call.inputs) == ["a", "b"] and call.outputs == []
    assert torch.equal(call.inputs["a"], torch.from_numpy(a)) and torch.equal(
        call.inputs["b"], torch.from_numpy(b)
    )


@pytest.mark.parametrize(
    ("datatype", "field", "values", "expected"),
    [
        ("FP32", "fp32_contents", [1, 2, 3.5], torch.tensor([1, 2, 3.5])),
        ("FP64", "fp64_contents", [0.1, 0.2, 0.3], torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64)),
        ("INT8", "int_contents", [-128, 0, 127], torch.tensor([-128, 0, 127], dtype=torch.int8)),
        (
            "INT32",
            "int_contents",
            [-(2**31), 0, 2**31 - 1],
            torch.tensor([-(2**31), 0, 2**31 - 1], dtype=torch.int32),
        ),
        ("INT64", "int64_contents", [-(2**63), 1, 2**63 - 1], torch.tensor([-(2**63), 1, 2**63 - 1])),
        ("UINT8", "uint_contents", [0, 128, 255], torch.tensor([0, 128, 255], dtype=torch.uint8)),
        ("BOOL", "bool_contents", [True, False, True], torch.tensor([True, False, True])),
    ],
)
def test_typed_contents_decode(datatype, field, values, expected):
    (tensor,) = decode_infer_request(typed_request(datatype, [1, 3], **{field: values})).inputs.values()
    assert tensor.dtype == expected.dtype and torch.equal(tensor, expected.reshape(1, 3))


# -- what is refused, and why ---------------------------------------------------------------


def test_bytes_tensors_are_refused_by_name():
    refused(typed_request("BYTES", [1], bytes_contents=[b"abc"]), "BYTES .*not supported")
    request = pb.ModelInferRequest(model_name="m", raw_input_contents=[b"\x03\x00\x00\x00abc"])
    request.inputs.add(name="x", datatype="BYTES", shape=[1])
    refused(request, "BYTES .*not supported")


@pytest.mark.parametrize(
    ("request_", "match"),
    [
        (pb.ModelInferRequest(model_name="m"), "at least one input"),
        (typed_request("FP8", [1], fp32_contents=[1]), "unknown datatype 'FP8'"),
        (typed_request("FP32", [-1, 2], fp32_contents=[1, 2]), "negative dimension"),
        (typed_request("FP32", [1, 3], fp32_contents=[1, 2]), "has 2 values but shape \\[1, 3\\] needs 3"),
        (typed_request("FP32", [2], int_contents=[1, 2]), "whose values go in contents.fp32_contents"),
        (typed_request("INT8", [2], int_contents=[1, 300]), "value 300 is out of INT8's range"),
        (typed_request("UINT8", [1], uint_contents=[256]), "value 256 is out of UINT8's range"),
        (typed_request("FP16", [1], fp32_contents=[1.0]), "FP16 has no typed contents field"),
        (typed_request("FP32", [2]), "has no data"),
    ],
)
def test_malformed_requests_are_refused_with_a_reason(request_, match):
    refused(request_, match)


def test_raw_contents_must_match_the_inputs_in_count_and_size():
    request = triton_request({"x": np.zeros((2, 2), np.float32)})
    request.raw_input_contents[0] = b"\x00" * 15
    refused(request, "raw_input_contents\\[0\\] has 15 bytes but shape \\[2, 2\\] of FP32 needs 16")
    two = triton_request({"a": np.zeros(1, np.float32), "b": np.zeros(1, np.float32)})
    del two.raw_input_contents[1]
    refused(two, "raw_input_contents has 1 entries for 2 inputs")
    mixed = triton_request({"x": np.zeros(1, np.float32)})
    mixed.inputs[0].contents.fp32_contents.append(1.0)
    refused(mixed, "typed contents while the request sends raw_input_contents")
    boolean = triton_request({"x": np.array([True, False])})
    boolean.raw_input_contents[0] = b"\x01\x02"
    refused(boolean, "BOOL bytes must be 0 or 1")


def test_names_and_parameters_are_checked():
    twice = triton_request({"x": np.zeros(1, np.float32)})
    twice.inputs.add().CopyFrom(twice.inputs[0])
    twice.raw_input_contents.append(twice.raw_input_contents[0])
    refused(twice, "input 'x' is given twice")
    shared = triton_request({"x": np.zeros(1, np.float32)})
    shared.inputs[0].parameters["shared_memory_region"].string_param = "region"
    refused(shared, "shared-memory tensors are not supported")
    classified = triton_request({"x": np.zeros(1, np.float32)})
    classified.outputs.add(name="y").parameters["classification"].int64_param = 3
    refused(classified, "classification outputs are not supported")
    refused(triton_request({"x": np.zeros(1, np.float32)}, outputs=["y", "y"]), "output 'y' is given twice")


def test_limits_bound_inputs_dimensions_elements_and_typed_values():
    limits = WireLimits(max_tensors=2, max_ndim=3, max_tensor_elements=100, max_json_values=10)
    three = {name: np.zeros(1, np.float32) for name in "abc"}
    refused(triton_request(three), "3 inputs, over the limit of 2", limits)
    refused(typed_request("FP32", [1, 1, 1, 1], fp32_contents=[1]), "4 dimensions", limits)
    refused(typed_request("FP32", [2**62, 2**62, 0]), "more than")
    refused(typed_request("FP32", [11], fp32_contents=[0] * 11), "11 values, over the limit of 10", limits)


# -- outputs ----------------------------------------------------------------------------------


def test_chosen_outputs_are_the_named_ones_or_all():
    every = decode_infer_request(triton_request({"x": np.zeros(1, np.float32)}))
    assert chosen_outputs(every, ["y", "z"]) == ["y", "z"]
    named = decode_infer_request(triton_request({"x": np.zeros(1, np.float32)}, outputs=["z"]))
    assert chosen_outputs(named, ["y", "z"]) == ["z"]
    unknown = decode_infer_request(triton_request({"x": np.zeros(1, np.float32)}, outputs=["w"]))
    with pytest.raises(WireError, match="model 'm' has no output 'w'"):
        chosen_outputs(unknown, ["y"])


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.int64, torch.int8, torch.bool, torch.float16]
)
def test_answers_read_back_with_tritonclient(dtype):
    y = (torch.arange(24).reshape(2, 3, 4) % 5).to(dtype)
    response = encode_infer_response(
        "m", "r-9", {"y": y.transpose(0, 1), "z": torch.ones(1)}, ["y"], {"batch_size": 3}
    )
    result = tritongrpc.InferResult(response)
    assert np.array_equal(result.as_numpy("y"), y.transpose(0, 1).numpy())
    assert result.as_numpy("z") is None
    assert response.model_name == "m" and response.model_version == "1" and response.id == "r-9"
    assert parameters_of(response.parameters) == {"batch_size": 3}


def test_bf16_answer_is_its_raw_words_and_checksum_is_fp64():
    y = torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
    response = encode_infer_response("m", "", {"y": y}, ["y"])
    assert response.outputs[0].datatype == "BF16" and response.raw_output_contents[0] == raw_bytes(y)
    assert np.array_equal(np.frombuffer(response.raw_output_contents[0], "<i2"), y.view(torch.int16).numpy())
    checksum = tritongrpc.InferResult(
        encode_infer_response("checksum", "", {"y": torch.tensor([6.5], dtype=torch.float64)}, ["y"])
    )
    assert checksum.as_numpy("y").dtype == np.float64 and checksum.as_numpy("y").tolist() == [6.5]


def test_parameters_of_every_kind_round_trip():
    response = encode_infer_response(
        "m", "", {}, [], {"a": True, "b": -3, "c": 2**63, "d": 0.5, "e": "v", "f": [1]}
    )
    assert parameters_of(response.parameters) == {
        "a": True,
        "b": -3,
        "c": 2**63,
        "d": 0.5,
        "e": "v",
        "f": "[1]",
    }


def test_an_output_that_is_not_a_tensor_cannot_be_encoded():
    with pytest.raises(WireError, match="output 'y' is a str"):
        encode_infer_response("m", "", {"y": "text"}, ["y"])


def test_model_metadata_message():
    metadata = {
        "name": "echo",
        "versions": ["1"],
        "platform": "hybridflow_worker_group",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, -1, -1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, -1, -1]}],
    }
    response = model_metadata_response(metadata)
    assert response.name == "echo" and list(response.versions) == ["1"]
    assert [(t.name, t.datatype, list(t.shape)) for t in response.inputs] == [("x", "FP32", [-1, -1, -1])]
    assert [t.name for t in response.outputs] == ["y"]

"""The wire as the client uses it, without a service: the bytes it sends (checked against
the service's formats written out literally) and the answers it reads (bodies built here
the way the service builds them), in numpy mode and, where torch is installed, torch mode."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import safetensors
import safetensors.numpy
from helpers import TORCH, as_numpy, returned_type

from hybridflow_client import CodecError, WireDataProto
from hybridflow_client.wire.json_values import decode_json_value, encode_json_value
from hybridflow_client.wire.oip_messages import build_infer_request, parse_header_length, parse_infer_response
from hybridflow_client.wire.safetensors_body import read_safetensors
from hybridflow_client.wire.safetensors_call import decode_output_body, encode_call_body
from hybridflow_client.wire.strict_json import dumps_compact
from hybridflow_client.wire.tensor_objects import from_json
from hybridflow_client.wire.tensors import to_wire

ALL_DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]
DATATYPE = dict(
    zip(ALL_DTYPES, ["BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64"], strict=True)
)


def sample(dtype: str, shape: tuple[int, ...] = (2, 3)) -> np.ndarray:
    return (np.arange(math.prod(shape)).reshape(shape) % (2 if dtype == "bool" else 7) * 1.5).astype(dtype)


def bf16_body(name: str, words: np.ndarray) -> bytes:
    """A safetensors body with one BF16 tensor, as the service writes it."""
    spec = safetensors.TensorSpec(dtype="bfloat16", shape=list(words.shape), data_ptr=words.ctypes.data,
                                  data_len=words.nbytes)
    return bytes(safetensors.serialize({name: spec}, metadata=None))


# -- tensors -------------------------------------------------------------------------------


def test_numbers_and_lists_follow_torch_dtype_rules():
    assert (to_wire(True).datatype, to_wire(3).datatype, to_wire(2.5).datatype) == ("BOOL", "INT64", "FP32")
    assert to_wire(3).shape == [] and to_wire([[1, 2], [3, 4]]).shape == [2, 2]
    assert to_wire([1, 2.5]).datatype == "FP32" and to_wire([True, 2]).datatype == "INT64"
    assert to_wire([]).datatype == "FP32" and to_wire(np.float64(0.5)).datatype == "FP32"
    assert to_wire(np.array([1, 2], dtype=">i4")).array.dtype == np.dtype("int32")  # byte order made native
    for bad in ("text", [[1], [1, 2]], 2**63, np.array([1], dtype=np.uint16), {"a": 1}):
        with pytest.raises(CodecError):
            to_wire(bad)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_every_datatype_round_trips_through_a_json_tensor_object(dtype, mode):
    array = sample(dtype)
    obj = json.loads(dumps_compact(encode_json_value(array)))
    assert obj["datatype"] == DATATYPE[dtype] and obj["shape"] == [2, 3] and len(obj["data"]) == 6
    back = decode_json_value(obj)
    assert isinstance(back, returned_type(mode))
    assert as_numpy(back).dtype == array.dtype and np.array_equal(as_numpy(back), array)


def test_json_tensor_objects_spell_non_finite_floats(mode):
    array = np.array([np.nan, np.inf, -np.inf, 1.5], dtype=np.float32)
    assert dumps_compact(encode_json_value(array)) == (
        b'{"datatype":"FP32","shape":[4],"data":["NaN","Infinity","-Infinity",1.5]}'
    )
    back = as_numpy(decode_json_value({"datatype": "FP64", "shape": [2, 2], "data": [["NaN", 1], [2, "-Infinity"]]}))
    assert back.dtype == np.float64 and np.isnan(back[0, 0]) and back.tolist()[1] == [2.0, -math.inf]


def test_json_tensor_objects_are_checked():
    cases = [
        ({"datatype": "FP32", "shape": [2], "data": [1.0]}, "needs 2"),
        ({"datatype": "INT8", "shape": [1], "data": [300]}, "out of range"),
        ({"datatype": "INT32", "shape": [1], "data": [1.5]}, "integers"),
        ({"datatype": "BOOL", "shape": [1], "data": [1]}, "true or false"),
        ({"datatype": "FP16", "shape": [1], "data": [1e6]}, "out of range"),
        ({"datatype": "BYTES", "shape": [1], "data": ["a"]}, "BYTES"),
        ({"datatype": "FP33", "shape": [1], "data": [1]}, "unknown datatype"),
        ({"datatype": "FP32", "shape": [-1], "data": []}, "negative dimension"),
        ({"datatype": "FP32", "shape": [1], "data": ["nan"]}, "numbers"),
    ]
    for obj, message in cases:
        with pytest.raises(CodecError, match=message):
            from_json(obj)


def test_bf16_without_torch_comes_back_as_float32_and_rounds_to_nearest_even(numpy_only):
    back = decode_json_value({"datatype": "BF16", "shape": [3], "data": [1.5, "Infinity", -2.0]})
    assert back.dtype == np.float32 and back.tolist() == [1.5, math.inf, -2.0]
    assert from_json({"datatype": "BF16", "shape": [1], "data": [0.5]}).array.tolist() == [0x3F00]
    # 0.1 is 0x3DCCCCCD in float32: its lower half 0xCCCD is past the half way, so it rounds up
    assert from_json({"datatype": "BF16", "shape": [1], "data": [0.1]}).array.tolist() == [0x3DCD]
    # 1 + 2**-8 lies half way between two BF16 values: the even one (1.0) wins
    assert from_json({"datatype": "BF16", "shape": [2], "data": [1 + 2**-8, 1 + 3 * 2**-8]}).array.tolist() == [
        0x3F80, 0x3F82]
    with pytest.raises(CodecError, match="out of range for BF16"):
        from_json({"datatype": "BF16", "shape": [1], "data": [3.4e38]})
    with pytest.raises(CodecError, match="no wire datatype"):
        to_wire(np.zeros(2, dtype=np.uint16))


# -- JSON bodies ---------------------------------------------------------------------------


def test_call_json_is_the_services_format(mode):
    body = dumps_compact({"args": encode_json_value([10]), "kwargs": encode_json_value({"x": [1, 1, 1, 1]})})
    assert body == b'{"args":[10],"kwargs":{"x":[1,1,1,1]}}'
    value = {"t": np.arange(3, dtype=np.int16), "n": np.float32(0.5), "b": np.bool_(True), 1: (1, 2),
             "nan": float("nan"), "s": np.array(["a", "b"]), "o": np.array([1, None], dtype=object)}
    assert json.loads(dumps_compact(encode_json_value(value))) == {
        "t": {"datatype": "INT16", "shape": [3], "data": [0, 1, 2]}, "n": 0.5, "b": True, "1": [1, 2],
        "nan": "NaN", "s": ["a", "b"], "o": [1, None],
    }
    opaque = encode_json_value(object())
    assert opaque["type"] == "object" and opaque["repr"].startswith("<object object")


def test_json_answers_decode_at_any_depth(mode):
    output = [{"w": {"datatype": "FP32", "shape": [1], "data": [1.0]}, "n": 3}, None, "done"]
    decoded = decode_json_value(output)
    assert isinstance(decoded[0]["w"], returned_type(mode)) and decoded[0]["n"] == 3 and decoded[1:] == [None, "done"]


def test_a_dataproto_in_json_both_ways(numpy_only):
    uid = np.empty(2, dtype=object)
    uid[:] = ["a", ["tokens", 1]]
    data = WireDataProto.from_dict({"x": np.ones((2, 2), np.float32)}, {"uid": uid, "n": np.arange(2)}, {"step": 1})
    encoded = json.loads(dumps_compact(encode_json_value(data)))
    assert encoded == {"__dataproto__": {
        "rows": 2, "batch": {"x": {"datatype": "FP32", "shape": [2, 2], "data": [1.0] * 4}},
        "non_tensor_batch": {"uid": {"dtype": "object", "shape": [2], "data": ["a", ["tokens", 1]]},
                             "n": {"dtype": "<i8", "shape": [2], "data": [0, 1]}},
        "meta_info": {"step": 1},
    }}
    back = decode_json_value(encoded)
    assert isinstance(back, WireDataProto) and len(back) == 2 and back.meta_info == {"step": 1}
    assert back.non_tensor_batch["uid"].tolist() == ["a", ["tokens", 1]] and back.non_tensor_batch["n"].dtype == np.int64
    assert np.array_equal(back.batch["x"], np.ones((2, 2), np.float32))


# -- safetensors bodies --------------------------------------------------------------------


def test_a_binary_call_body_names_list_items_and_makes_numbers_tensors(numpy_only):
    body = encode_call_body({"x": [1, 1, 1, 1], "y": np.arange(6, dtype=np.float16).reshape(2, 3), "z": 0.5})
    loaded = safetensors.numpy.load(body)
    assert sorted(loaded) == ["x.0", "x.1", "x.2", "x.3", "y", "z"]
    assert loaded["x.2"].shape == () and loaded["x.2"].dtype == np.int64 and loaded["z"].dtype == np.float32
    assert np.array_equal(loaded["y"], np.arange(6, dtype=np.float16).reshape(2, 3))
    for bad, message in (({"x": []}, "empty list"), ({"not a name": 1}, "not a valid argument name"),
                         ({"x": "text"}, "str")):
        with pytest.raises(CodecError, match=message):
            encode_call_body(bad)


def test_a_dataproto_call_body_carries_its_document_in_the_metadata(numpy_only):
    data = WireDataProto.from_dict({"x": np.arange(4.0).reshape(2, 2)}, {"uid": ["a", "b"]}, {"step": 2})
    named, metadata = read_safetensors(encode_call_body({"data": data}))
    assert list(named) == ["data@x"] and named["data@x"].datatype == "FP64"
    assert metadata == {"data": '{"rows":2,"batch":["x"],"non_tensor_batch":{"uid":{"dtype":"object","shape":[2],'
                                '"data":["a","b"]}},"meta_info":{"step":2}}'}


def test_output_bodies_become_lists_and_dicts(mode):
    body = safetensors.numpy.save({
        "output.0.gate_up_proj%2Eweight": np.full((2, 2), 2.0, np.float32),
        "output.0.%312": np.zeros(1, np.int8),
        "output.0.%": np.ones(1, np.bool_),
        "output.1": np.arange(3, dtype=np.uint8),
    })
    out = decode_output_body(body)
    assert isinstance(out, list) and len(out) == 2 and list(out[0]) == ["", "12", "gate_up_proj.weight"]
    assert isinstance(out[1], returned_type(mode))
    assert as_numpy(out[0]["gate_up_proj.weight"]).tolist() == [[2.0, 2.0], [2.0, 2.0]]
    assert as_numpy(out[0][""]).dtype == np.bool_ and as_numpy(out[1]).tolist() == [0, 1, 2]
    assert as_numpy(decode_output_body(safetensors.numpy.save({"output": np.float64([6.5])}))).tolist() == [6.5]


def test_malformed_output_bodies_are_refused():
    cases = [
        (b"\x01", "fewer than"),
        (struct.pack("<Q", 99) + b"{}", "claims 99 bytes"),
        (safetensors.numpy.save({"output.0": np.ones(1), "output.2": np.ones(1)}), "no gap"),
        (safetensors.numpy.save({"output.0": np.ones(1), "output.a": np.ones(1)}), "mixes"),
        (safetensors.numpy.save({"other": np.ones(1)}), "not under"),
        (safetensors.numpy.save({"output.0": np.ones(1, np.uint32)}), "no wire datatype"),
    ]
    for body, message in cases:
        with pytest.raises(CodecError, match=message):
            decode_output_body(body)


def test_bf16_output_bodies(mode):
    words = np.array([0x3FC0, 0xC000], dtype=np.uint16)  # 1.5, -2.0
    out = decode_output_body(bf16_body("output", words))
    if mode == "torch":
        assert out.dtype is TORCH.bfloat16
    else:
        assert out.dtype == np.float32
    assert as_numpy(out).tolist() == [1.5, -2.0]
    sent = from_json({"datatype": "BF16", "shape": [2], "data": [1.5, -2.0]})
    assert encode_call_body({"x": sent}) == bf16_body("x", words)


def test_a_dataproto_answer_without_a_dataproto_class(numpy_only):
    document = {"rows": 2, "batch": ["y"], "non_tensor_batch": {"rank": {"dtype": "object", "shape": [2],
                                                                          "data": [0, 1]}},
                "meta_info": {"world_size": 4}}
    body = safetensors.numpy.save({"output@y": np.array([2.0, 4.0], np.float32)},
                                  metadata={"output": json.dumps(document)})
    out = decode_output_body(body)
    assert isinstance(out, WireDataProto) and out.batch["y"].tolist() == [2.0, 4.0]
    assert out.non_tensor_batch["rank"].tolist() == [0, 1] and out.meta_info == {"world_size": 4}


# -- OIP -----------------------------------------------------------------------------------


def test_a_binary_infer_request_is_laid_out_as_tritonclient_does(numpy_only):
    x = np.array([[1, 2, 3.5]], dtype=np.float32)
    body, length = build_infer_request({"x": x}, outputs=["y"], id="r-1")
    header = (b'{"id":"r-1","outputs":[{"name":"y","parameters":{"binary_data":true}}],"inputs":[{"name":"x",'
              b'"datatype":"FP32","shape":[1,3],"parameters":{"binary_data_size":12}}]}')
    assert length == len(header) and body == header + x.tobytes()
    body, length = build_infer_request({"x": x, "m": np.array([True, False])}, binary=False, binary_outputs=False)
    assert length is None and json.loads(body) == {"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1.0, 2.0, 3.5]},
        {"name": "m", "datatype": "BOOL", "shape": [2], "data": [True, False]},
    ]}
    assert json.loads(build_infer_request({"x": x})[0][: build_infer_request({"x": x})[1]])["parameters"] == {
        "binary_data_output": True
    }


def test_infer_responses_binary_and_json(mode):
    y = np.arange(6, dtype=np.float64).reshape(2, 3)
    header = json.dumps({"model_name": "m", "model_version": "1", "outputs": [
        {"name": "y", "datatype": "FP64", "shape": [2, 3], "parameters": {"binary_data_size": 48}},
        {"name": "m", "datatype": "BOOL", "shape": [2], "data": [True, False]},
        {"name": "b", "datatype": "BF16", "shape": [1], "parameters": {"binary_data_size": 2}},
    ]}).encode()
    payload, outputs = parse_infer_response(header + y.tobytes() + b"\xc0\x3f", str(len(header)))
    assert payload["model_name"] == "m" and list(outputs) == ["y", "m", "b"]
    assert isinstance(outputs["y"], returned_type(mode)) and np.array_equal(as_numpy(outputs["y"]), y)
    assert as_numpy(outputs["m"]).tolist() == [True, False] and as_numpy(outputs["b"]).tolist() == [1.5]
    with pytest.raises(CodecError, match="after the JSON header"):
        parse_infer_response(header + y.tobytes() + b"\xc0\x3f!", len(header))
    with pytest.raises(CodecError, match="short"):
        parse_infer_response(header + y.tobytes(), len(header))
    for bad in ("-1", "x", str(len(header) + 100)):
        with pytest.raises(CodecError):
            parse_header_length(bad, len(header))


@pytest.mark.skipif(TORCH is None, reason="torch is not installed")
def test_torch_tensors_go_out_as_the_same_bytes_as_numpy_arrays():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = TORCH.from_numpy(x.copy()).requires_grad_(True)
    assert build_infer_request({"x": t}) == build_infer_request({"x": x})
    assert encode_call_body({"x": [t, t]}) == encode_call_body({"x": [x, x]})
    assert encode_json_value(t.T) == encode_json_value(x.T)
    bf16 = TORCH.tensor([1.5, -2.0, 0.1], dtype=TORCH.bfloat16)
    assert to_wire(bf16).datatype == "BF16" and to_wire(bf16).array.tolist()[:2] == [0x3FC0, 0xC000]
    back = decode_output_body(encode_call_body({"output": bf16}))
    assert back.dtype is TORCH.bfloat16 and TORCH.equal(back, bf16)

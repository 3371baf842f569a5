"""hybridflow.wire.json_tensors and hybridflow.wire.safetensors_call: OIP JSON tensor objects, walking nested values, safetensors bodies
and the call/output naming conventions. No Ray, no server."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from hybridflow.wire.dtypes import DATATYPES
from hybridflow.wire.errors import WireError
from hybridflow.wire.json_tensors import (
    decode_json_value,
    encode_json_value,
    is_json_tensor,
    json_to_tensor,
    tensor_to_json,
)
from hybridflow.wire.safetensors_call import (
    decode_safetensors,
    encode_safetensors,
    pack_call,
    pack_output,
    unpack_call,
    unpack_output,
)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


# -- JSON tensor objects ------------------------------------------------------------------


def sample(datatype: str) -> torch.Tensor:
    dtype = DATATYPES[datatype]
    if dtype is torch.bool:
        return torch.tensor([[True, False, True], [False, False, True]])
    if dtype.is_floating_point:
        return torch.tensor([[0.5, -1.25, 3.0], [1e-3, 0.0, -7.5]], dtype=dtype)
    info = torch.iinfo(dtype)
    return torch.tensor([[info.min, 0, 1], [info.max, 7, info.max - 1]], dtype=dtype)


@pytest.mark.parametrize("datatype", list(DATATYPES))
def test_every_datatype_round_trips_through_json(datatype):
    tensor = sample(datatype)
    obj = tensor_to_json(tensor)
    assert obj["datatype"] == datatype and obj["shape"] == [2, 3] and len(obj["data"]) == 6
    back = json_to_tensor(json.loads(json.dumps(obj, allow_nan=False)))
    assert same(back, tensor)


def test_tensor_object_shape_and_data_layout():
    obj = tensor_to_json(torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert obj == {"datatype": "FP32", "shape": [2, 3], "data": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]}
    assert tensor_to_json(torch.tensor([1.0]), name="y") == {
        "name": "y", "datatype": "FP32", "shape": [1], "data": [1.0]
    }


def test_scalars_empty_and_noncontiguous_tensors():
    assert tensor_to_json(torch.tensor(3)) == {"datatype": "INT64", "shape": [], "data": [3]}
    assert same(json_to_tensor({"datatype": "INT64", "shape": [], "data": [3]}), torch.tensor(3))
    empty = torch.zeros(0, 4, dtype=torch.float16)
    assert same(json_to_tensor(tensor_to_json(empty)), empty)
    transposed = torch.arange(6.0).reshape(2, 3).t()
    assert tensor_to_json(transposed)["data"] == [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
    grad = torch.ones(2, requires_grad=True) * 2
    assert tensor_to_json(grad)["data"] == [2.0, 2.0]


def test_nested_data_is_flattened():
    obj = {"datatype": "INT32", "shape": [2, 2], "data": [[1, 2], [3, 4]]}
    assert same(json_to_tensor(obj), torch.tensor([[1, 2], [3, 4]], dtype=torch.int32))
    deep = {"datatype": "FP64", "shape": [2, 1, 2], "data": [[[1.0, 2.0]], [[3.0, 4.0]]]}
    assert json_to_tensor(deep).tolist() == [[[1.0, 2.0]], [[3.0, 4.0]]]


def test_non_finite_floats_are_spelled_as_strings_both_ways():
    tensor = torch.tensor([1.0, math.nan, math.inf, -math.inf])
    obj = tensor_to_json(tensor)
    assert obj["data"] == [1.0, "NaN", "Infinity", "-Infinity"]
    json.dumps(obj, allow_nan=False)  # valid JSON
    back = json_to_tensor(obj)
    assert back[0] == 1 and math.isnan(back[1]) and back[2] == math.inf and back[3] == -math.inf


def test_bf16_travels_as_floats_and_rounds_on_the_way_in():
    obj = tensor_to_json(torch.tensor([1.5, -2.0], dtype=torch.bfloat16))
    assert obj == {"datatype": "BF16", "shape": [2], "data": [1.5, -2.0]}
    assert json_to_tensor({"datatype": "BF16", "shape": [1], "data": [1.1]}).item() == pytest.approx(1.1, abs=0.01)


def test_integer_datatypes_accept_integral_floats():
    assert json_to_tensor({"datatype": "INT8", "shape": [2], "data": [3.0, -4]}).tolist() == [3, -4]


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [1, 2, 3]},
         "input 'x': data has 3 values but shape [2, 2] needs 4"),
        ({"datatype": "FP33", "shape": [1], "data": [1]}, "unknown datatype 'FP33'"),
        ({"datatype": "BYTES", "shape": [1], "data": ["a"]}, "BYTES"),
        ({"datatype": "FP32", "shape": [-1], "data": []}, "negative dimension"),
        ({"datatype": "FP32", "shape": [1.5], "data": [1]}, "shape must be a list of integers"),
        ({"datatype": "FP32", "shape": [True], "data": [1]}, "shape must be a list of integers"),
        ({"datatype": "FP32", "shape": "2", "data": [1, 2]}, "shape must be a list of integers"),
        ({"datatype": "FP32", "shape": [1], "data": 1.0}, "data must be a list"),
        ({"datatype": "FP32", "shape": [1]}, "missing 'data'"),
        ({"datatype": "INT8", "shape": [1], "data": [128]}, "out of range for INT8"),
        ({"datatype": "UINT8", "shape": [1], "data": [-1]}, "out of range for UINT8"),
        ({"datatype": "INT64", "shape": [1], "data": [2**63]}, "out of range for INT64"),
        ({"datatype": "INT32", "shape": [1], "data": [1.5]}, "must be integers"),
        ({"datatype": "INT32", "shape": [1], "data": [True]}, "must be integers"),
        ({"datatype": "INT32", "shape": [1], "data": ["1"]}, "must be integers"),
        ({"datatype": "FP16", "shape": [1], "data": [70000.0]}, "out of range for FP16"),
        ({"datatype": "FP32", "shape": [1], "data": [1e39]}, "out of range for FP32"),
        ({"datatype": "FP64", "shape": [1], "data": [10**400]}, "out of range for FP64"),
        ({"datatype": "FP32", "shape": [1], "data": [math.nan]}, "non-finite"),
        ({"datatype": "FP32", "shape": [2], "data": ["NaN", math.inf]}, "non-finite"),
        ({"datatype": "FP32", "shape": [1], "data": ["nan"]}, "must be numbers"),
        ({"datatype": "FP32", "shape": [1], "data": [None]}, "must be numbers"),
        ({"datatype": "FP32", "shape": [1], "data": [False]}, "must be numbers"),
        ({"datatype": "BOOL", "shape": [1], "data": [1]}, "BOOL data must be true or false"),
    ],
)
def test_json_tensor_errors_name_the_problem(obj, message):
    with pytest.raises(WireError, match=message.replace("[", r"\[").replace("]", r"\]")):
        json_to_tensor(obj)


def test_wire_error_is_a_value_error():
    assert issubclass(WireError, ValueError)


def test_is_json_tensor():
    assert is_json_tensor({"datatype": "FP32", "shape": [1], "data": [1.0]})
    assert is_json_tensor({"datatype": "FP32", "shape": [1], "data": [1.0], "name": "x", "parameters": {}})
    assert not is_json_tensor({"datatype": "FP32", "shape": [1]})
    assert not is_json_tensor({"datatype": "FP32", "shape": [1], "data": [1.0], "extra": 1})
    assert not is_json_tensor([1, 2])
    assert not is_json_tensor("FP32")


def test_unsupported_dtypes_are_refused():
    with pytest.raises(WireError, match="complex64"):
        tensor_to_json(torch.zeros(2, dtype=torch.complex64))


# -- walking nested values ----------------------------------------------------------------


def test_tutorial_outputs_encode_as_lists_of_tensor_objects():
    output = [torch.tensor([1.0]), torch.tensor([2.0])]
    encoded = encode_json_value(output)
    assert encoded == [
        {"datatype": "FP32", "shape": [1], "data": [1.0]},
        {"datatype": "FP32", "shape": [1], "data": [2.0]},
    ]
    decoded = decode_json_value(json.loads(json.dumps(encoded)))
    assert all(same(a, b) for a, b in zip(decoded, output, strict=True))


def test_plain_values_pass_through():
    value = {"n": 5, "f": 1.5, "s": "text", "none": None, "flag": True, "list": [8, 10, 8, 10]}
    assert encode_json_value(value) == value
    assert decode_json_value(value) == value


def test_numpy_values_and_containers():
    encoded = encode_json_value(
        {
            "array": np.arange(4, dtype=np.int16).reshape(2, 2),
            "big_endian": np.array([1.0, 2.0], dtype=">f4"),
            "scalar": np.float32(2.5),
            "int": np.int64(7),
            "bool": np.bool_(True),
            "strings": np.array(["a", "b"]),
            "tuple": (1, torch.tensor([True])),
            3: "int key",
            "size": torch.Size([2, 3]),
        }
    )
    assert encoded["array"] == {"datatype": "INT16", "shape": [2, 2], "data": [0, 1, 2, 3]}
    assert encoded["big_endian"] == {"datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}
    assert encoded["scalar"] == 2.5 and type(encoded["scalar"]) is float
    assert encoded["int"] == 7 and encoded["bool"] is True
    assert encoded["strings"] == ["a", "b"]
    assert encoded["tuple"] == [1, {"datatype": "BOOL", "shape": [1], "data": [True]}]
    assert encoded["3"] == "int key"
    assert encoded["size"] == [2, 3]
    json.dumps(encoded, allow_nan=False)


def test_other_objects_become_type_and_repr():
    class Thing:
        def __repr__(self) -> str:
            return "Thing()"

    encoded = encode_json_value([Thing(), b"raw", float("nan")])
    assert encoded[0] == {"type": f"{Thing.__module__}.{Thing.__qualname__}", "repr": "Thing()"}
    assert encoded[1] == {"type": "bytes", "repr": "b'raw'"}
    assert encoded[2] == "NaN"
    assert decode_json_value(encoded)[0] == encoded[0]  # left as it is


def test_cycles_are_an_error_not_a_crash():
    loop: list = []
    loop.append(loop)
    with pytest.raises(WireError, match="deeper"):
        encode_json_value(loop)


def test_decode_finds_tensors_at_any_depth_and_names_the_place():
    one = {"datatype": "FP32", "shape": [1], "data": [0.5]}
    decoded = decode_json_value({"kwargs": {"x": [one, {"deeper": [one]}], "n": 3}})
    assert same(decoded["kwargs"]["x"][0], torch.tensor([0.5]))
    assert same(decoded["kwargs"]["x"][1]["deeper"][0], torch.tensor([0.5]))
    assert decoded["kwargs"]["n"] == 3
    bad = {"datatype": "FP32", "shape": [2, 2], "data": [1, 2, 3]}
    with pytest.raises(WireError, match=r"kwargs\.x\[1\]: data has 3 values but shape \[2, 2\] needs 4"):
        decode_json_value({"x": [one, bad]}, "kwargs")


# -- safetensors --------------------------------------------------------------------------


def test_safetensors_round_trip_of_every_datatype():
    named = {datatype.lower(): sample(datatype) for datatype in DATATYPES}
    back = decode_safetensors(encode_safetensors(named))
    assert set(back) == set(named)
    assert all(same(back[k], named[k]) for k in named)
    # the library's own reader agrees
    assert same(st_load(encode_safetensors({"a": named["fp32"]}))["a"], named["fp32"])


def test_safetensors_takes_views_shared_tensors_and_scalars():
    base = torch.arange(8.0)
    named = {"a": base, "b": base, "view": base[2:4], "t": base.reshape(2, 4).t(), "s": torch.tensor(2)}
    back = decode_safetensors(encode_safetensors(named))
    assert all(same(back[k], named[k].contiguous()) for k in named)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"short",
        b"garbage garbage garbage",
        struct.pack("<Q", 10**6) + b"{}",
        struct.pack("<Q", 2) + b"[]",
        struct.pack("<Q", 5) + b"{bad}",
    ],
)
def test_malformed_safetensors_raise_codec_errors(body):
    with pytest.raises(WireError):
        decode_safetensors(body)


def test_truncated_and_corrupt_safetensors_raise_codec_errors():
    body = st_save({"x": torch.arange(100.0), "y": torch.ones(3, 3)})
    for cut in (len(body) - 1, len(body) // 2, 9, 20):
        with pytest.raises(WireError):
            decode_safetensors(body[:cut])
    with pytest.raises(WireError):
        decode_safetensors(_forge({"x": torch.arange(100.0), "y": torch.ones(3, 3)}, _set("x", "data_offsets", [0, 10**9])))


def test_safetensors_dtypes_without_a_datatype_are_refused():
    with pytest.raises(WireError, match="no wire datatype"):
        decode_safetensors(st_save({"u": torch.zeros(2, dtype=torch.uint16)}))


def _body_address_range(body: bytearray) -> range:
    start = np.frombuffer(body, dtype=np.uint8).ctypes.data
    return range(start, start + len(body))


def test_a_writable_body_is_viewed_in_place_and_a_read_only_one_is_copied():
    named = {datatype.lower(): sample(datatype) for datatype in DATATYPES}
    named["big"] = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    encoded = encode_safetensors(named)

    writable = bytearray(encoded)
    inside = _body_address_range(writable)
    viewed = decode_safetensors(writable)
    assert all(same(viewed[k], named[k]) for k in named)
    # no second copy of the body: every non-empty tensor's bytes lie inside it
    assert all(viewed[k].data_ptr() in inside for k in named if viewed[k].numel())
    viewed["big"][0, 0] = -1.0  # writable, and a view: the body changes with it
    assert decode_safetensors(writable)["big"][0, 0] == -1.0

    copied = decode_safetensors(encoded)  # bytes are read-only: the tensors own copies
    assert all(same(copied[k], named[k]) for k in named)
    copied["big"][0, 0] = -2.0
    assert decode_safetensors(encoded)["big"][0, 0] == 0.0


def _forge(named: dict[str, torch.Tensor], edit, tail: bytes = b"") -> bytes:
    """A safetensors body of ``named`` whose header ``edit`` changed (and ``tail`` appended)."""
    body = st_save(named)
    (length,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8 : 8 + length])
    edit(header)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body[8 + length :] + tail


def _set(name: str, key: str, value):
    return lambda header: header[name].__setitem__(key, value)


@pytest.mark.parametrize(
    ("edit", "tail", "message"),
    [
        (_set("a", "data_offsets", [0, 12]), b"", "hold 12 bytes but shape"),
        (_set("b", "data_offsets", [20, 36]), b"\0" * 4, "starts at data byte 20, not 16"),  # a gap
        (_set("b", "data_offsets", [12, 28]), b"", "starts at data byte 12, not 16"),  # an overlap
        (lambda header: None, b"\0" * 8, "40 bytes of tensor data but its header declares 32"),
        (_set("a", "data_offsets", [0, -16]), b"", "two non-negative integers"),
        (_set("a", "data_offsets", [0]), b"", "two non-negative integers"),
        (lambda header: header["a"].pop("shape"), b"", "needs dtype, shape and data_offsets"),
        (_set("a", "dtype", 4), b"", "has no wire datatype"),
        (_set("a", "shape", [2, -2]), b"", "negative dimension"),
    ],
)
def test_the_format_rules_are_checked_before_any_byte_is_read(edit, tail, message):
    named = {"a": torch.arange(4.0), "b": torch.ones(4)}  # bytes 0-16 and 16-32 of the data
    body = _forge(named, edit, tail)
    with pytest.raises(WireError, match=message):
        decode_safetensors(bytearray(body))
    # safetensors' own reader refuses the same bodies
    with pytest.raises(Exception):  # noqa: B017 - the Rust parser's own error type
        st_load(body)


def test_what_the_library_reads_is_read_the_same():
    named = {"a": torch.arange(4.0), "b": torch.ones(2, 2, dtype=torch.float64)}
    # keys the format does not define are ignored, as safetensors itself ignores them
    body = _forge(named, _set("a", "note", "x"))
    assert all(same(decode_safetensors(bytearray(body))[k], st_load(body)[k]) for k in named)
    # a dtype the format has but the wire does not is refused by name
    fp8 = _forge({"a": torch.zeros(4, dtype=torch.uint8)}, _set("a", "dtype", "F8_E4M3"))
    assert st_load(fp8)["a"].dtype == torch.float8_e4m3fn
    with pytest.raises(WireError, match="dtype 'F8_E4M3' has no wire datatype"):
        decode_safetensors(fp8)


def test_bool_bytes_other_than_0_and_1_are_refused():
    body = bytearray(st_save({"m": torch.tensor([True, False])}))
    body[-1] = 7
    with pytest.raises(WireError, match="BOOL bytes must be 0 or 1"):
        decode_safetensors(body)


# -- the call and output conventions ------------------------------------------------------


def test_pack_call_flattens_lists_and_unpack_call_restores_them():
    x = [torch.tensor([1.0]), torch.tensor([2.0])]
    named = pack_call({"x": x, "y": torch.ones(2, 2)})
    assert sorted(named) == ["x.0", "x.1", "y"]
    kwargs = unpack_call(decode_safetensors(encode_safetensors(named)))
    assert set(kwargs) == {"x", "y"}
    assert all(same(a, b) for a, b in zip(kwargs["x"], x, strict=True))
    assert same(kwargs["y"], torch.ones(2, 2))


def test_pack_call_turns_numbers_and_arrays_into_tensors():
    named = pack_call({"x": [1, 1, 1, 1], "y": 2.5, "z": np.arange(3), "w": [[1, 2], [3, 4]],
                       "t": {"datatype": "FP16", "shape": [1], "data": [0.5]}})
    assert [named[f"x.{i}"].item() for i in range(4)] == [1, 1, 1, 1]
    assert named["x.0"].dtype == torch.int64 and named["x.0"].shape == ()
    assert named["y"].dtype == torch.float32 and named["y"].item() == 2.5
    assert same(named["z"], torch.arange(3))
    assert named["w.1"].tolist() == [3, 4]
    assert same(named["t"], torch.tensor([0.5], dtype=torch.float16))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"config": {"hidden": 4}}, "send other values as JSON"),
        ({"x": None}, "NoneType"),
        ({"x": []}, "empty list"),
        ({"x": ["a"]}, "is a str"),
        ({"x": [["a"]]}, "cannot make a tensor"),
        ({"not valid": 1}, "not a valid argument name"),
        ({"x": 2**70}, "cannot make a tensor"),
    ],
)
def test_pack_call_errors(kwargs, message):
    with pytest.raises(WireError, match=message):
        pack_call(kwargs)


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["x.0", "x.2"], r"missing x\.1"),
        (["x.1"], r"missing x\.0"),
        (["x", "x.0"], "both as a tensor and as list items"),
        (["x.01"], "neither an argument name"),
        (["a.b"], "neither an argument name"),
        (["x.0.1"], "neither an argument name"),
        (["1x"], "neither an argument name"),
    ],
)
def test_unpack_call_errors(names, message):
    with pytest.raises(WireError, match=message):
        unpack_call({name: torch.zeros(1) for name in names})


def test_unpack_call_orders_list_items_by_index():
    named = {f"x.{i}": torch.tensor([float(i)]) for i in (10, 2, 0, 1, 3, 4, 5, 6, 7, 8, 9)}
    assert [t.item() for t in unpack_call(named)["x"]] == list(range(11))


def test_pack_output_shapes():
    assert list(pack_output(torch.ones(2))) == ["output"]
    assert list(pack_output([torch.ones(1), torch.ones(1)])) == ["output.0", "output.1"]
    assert list(pack_output(5)) == ["output"] and pack_output(5)["output"].item() == 5


def test_output_round_trip_keeps_dotted_and_digit_keys():
    weights = {"gate_up_proj.weight": torch.ones(4, 2), "down_proj.weight": torch.zeros(2, 2)}
    odd = {"0": torch.tensor([0]), "": torch.tensor([1]), "50%": torch.tensor([2]), "a.b.c": torch.tensor([3])}
    output = [weights, weights, {"nested": [odd, (torch.tensor([5]),)]}]
    named = pack_output(output)
    assert "output.0.gate_up_proj%2Eweight" in named
    back = unpack_output(decode_safetensors(encode_safetensors(named)))
    assert isinstance(back, list) and len(back) == 3
    assert set(back[0]) == set(weights) and same(back[1]["gate_up_proj.weight"], torch.ones(4, 2))
    inner = back[2]["nested"]
    assert set(inner[0]) == set(odd) and all(same(inner[0][k], odd[k]) for k in odd)
    assert same(inner[1][0], torch.tensor([5]))  # tuples come back as lists


def test_single_tensor_output_round_trip():
    y = torch.randn(3, 2, 4)
    assert same(unpack_output(decode_safetensors(encode_safetensors(pack_output(y)))), y)


@pytest.mark.parametrize("output", [None, [None, None], "text", [], {}, [torch.ones(1), object()]])
def test_pack_output_refuses_what_safetensors_cannot_carry(output):
    with pytest.raises(WireError):
        pack_output(output)


@pytest.mark.parametrize(
    ("names", "message"),
    [
        ([], "no tensors"),
        (["other"], "not under 'output'"),
        (["output", "output.0"], "both a tensor and a container"),
        (["output.0", "output.2"], "do not run from 0"),
        (["output.0", "output.key"], "mixes list indices and mapping keys"),
        (["output.0", "output.0.a"], "nests under a tensor"),
    ],
)
def test_unpack_output_errors(names, message):
    with pytest.raises(WireError, match=message):
        unpack_output({name: torch.zeros(1) for name in names})

"""The shared wire's tensors: OIP JSON tensor objects, what a caller passes, safetensors
bodies read by the format's rules, and the safetensors call and answer naming. numpy only
(torch where installed, for what is about torch)."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import safetensors.numpy
from helpers import TORCH

from hybridflow_client.wire.datatypes import DATATYPES, WireTensor, bf16_words, widen_bf16
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.safetensors_body import encode_safetensors, read_safetensors
from hybridflow_client.wire.safetensors_call import pack_call, pack_output, unpack_call, unpack_output
from hybridflow_client.wire.tensor_objects import from_json, is_json_tensor, tensor_object
from hybridflow_client.wire.tensors import to_wire


def same(a: WireTensor, b: WireTensor) -> bool:
    return a.datatype == b.datatype and a.shape == b.shape and np.array_equal(a.array, b.array, equal_nan=True)


def sample(datatype: str) -> WireTensor:
    """Two rows of three values of ``datatype``, its extremes included."""
    if datatype == "BOOL":
        return WireTensor(datatype, np.array([[True, False, True], [False, False, True]]))
    floats = np.array([[0.5, -1.25, 3.0], [1e-3, 0.0, -7.5]])
    if datatype == "BF16":
        return WireTensor(datatype, bf16_words(floats))
    dtype = DATATYPES[datatype]
    if dtype.kind == "f":
        return WireTensor(datatype, floats.astype(dtype))
    info = np.iinfo(dtype)
    return WireTensor(datatype, np.array([[info.min, 0, 1], [info.max, 7, info.max - 1]], dtype=dtype))


# -- JSON tensor objects ------------------------------------------------------------------


@pytest.mark.parametrize("datatype", list(DATATYPES))
def test_every_datatype_round_trips_through_json(datatype):
    tensor = sample(datatype)
    obj = tensor_object(tensor)
    assert obj["datatype"] == datatype and obj["shape"] == [2, 3] and len(obj["data"]) == 6
    assert same(from_json(json.loads(json.dumps(obj, allow_nan=False))), tensor)


def test_tensor_object_shape_and_data_layout():
    obj = tensor_object(to_wire(np.arange(6, dtype=np.float32).reshape(2, 3)))
    assert obj == {"datatype": "FP32", "shape": [2, 3], "data": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]}
    assert tensor_object(to_wire(np.float32([1.0])), name="y") == {"name": "y", "datatype": "FP32", "shape": [1],
                                                                   "data": [1.0]}


def test_scalars_empty_and_noncontiguous_arrays():
    assert tensor_object(to_wire(3)) == {"datatype": "INT64", "shape": [], "data": [3]}
    assert same(from_json({"datatype": "INT64", "shape": [], "data": [3]}), to_wire(np.int64(3)))
    empty = to_wire(np.zeros((0, 4), dtype=np.float16))
    assert same(from_json(tensor_object(empty)), empty)
    transposed = np.arange(6.0).reshape(2, 3).T
    assert tensor_object(to_wire(transposed))["data"] == [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]


def test_nested_data_is_flattened():
    assert from_json({"datatype": "INT32", "shape": [2, 2], "data": [[1, 2], [3, 4]]}).array.tolist() == [[1, 2], [3, 4]]
    deep = {"datatype": "FP64", "shape": [2, 1, 2], "data": [[[1.0, 2.0]], [[3.0, 4.0]]]}
    assert from_json(deep).array.tolist() == [[[1.0, 2.0]], [[3.0, 4.0]]]


def test_non_finite_floats_are_spelled_as_strings_both_ways():
    obj = tensor_object(to_wire(np.float32([1.0, math.nan, math.inf, -math.inf])))
    assert obj["data"] == [1.0, "NaN", "Infinity", "-Infinity"]
    json.dumps(obj, allow_nan=False)  # valid JSON
    back = from_json(obj).array
    assert back[0] == 1 and math.isnan(back[1]) and back[2] == math.inf and back[3] == -math.inf


def test_bf16_travels_as_floats_and_rounds_on_the_way_in():
    assert tensor_object(WireTensor("BF16", bf16_words(np.array([1.5, -2.0])))) == {
        "datatype": "BF16", "shape": [2], "data": [1.5, -2.0]}
    assert widen_bf16(from_json({"datatype": "BF16", "shape": [1], "data": [1.1]}).array)[0] == pytest.approx(1.1, abs=0.01)


@pytest.mark.skipif(TORCH is None, reason="torch is not installed")
def test_bf16_words_are_the_words_torch_makes():
    rng = np.random.default_rng(7)
    values = np.concatenate([
        rng.standard_normal(4000) * 10.0 ** rng.integers(-40, 39, 4000),  # every exponent, subnormals too
        np.float32(rng.standard_normal(1000)).view(np.uint32).astype(np.float64),  # wide magnitudes
        [0.0, -0.0, 1 + 2**-8, 1 + 3 * 2**-8, 3.3895313892515355e38, 3.39e38, 1e-45, np.nan, np.inf, -np.inf],
        [1 + 2**-8 + 2**-40],  # past the tie in float64, on it in float32: torch rounds through float32 (1.0)
    ])
    torch_words = TORCH.from_numpy(values).to(TORCH.bfloat16).view(TORCH.int16).numpy().view(np.uint16)
    words, nan = bf16_words(values), np.isnan(values)
    assert np.array_equal(words[~nan], torch_words[~nan])
    # a NaN stays a NaN (torch's vectorised path sets every bit of it, the canonical one is 0x7FC0)
    assert np.isnan(widen_bf16(torch_words[nan])).all() and words[nan].tolist() == [0x7FC0]


def test_a_bf16_scalar_widens_to_a_0d_array():
    widened = widen_bf16(np.array(0x3FC0, dtype=np.uint16))
    assert isinstance(widened, np.ndarray) and widened.shape == () and widened.dtype == np.float32 and widened == 1.5
    assert WireTensor("BF16", np.array(0xC000, dtype=np.uint16)).json_data() == [-2.0]


def test_integer_datatypes_accept_integral_floats():
    assert from_json({"datatype": "INT8", "shape": [2], "data": [3.0, -4]}).array.tolist() == [3, -4]


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
        ({"datatype": "FP16", "shape": [1], "data": [70000.0]}, "out of range for FP16 (largest is 65504.0)"),
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
    with pytest.raises(WireError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(
            ")", r"\)")):
        from_json(obj)


def test_wire_error_is_a_value_error():
    assert issubclass(WireError, ValueError)


def test_is_json_tensor():
    assert is_json_tensor({"datatype": "FP32", "shape": [1], "data": [1.0]})
    assert is_json_tensor({"datatype": "FP32", "shape": [1], "data": [1.0], "name": "x", "parameters": {}})
    assert not is_json_tensor({"datatype": "FP32", "shape": [1]})
    assert not is_json_tensor({"datatype": "FP32", "shape": [1], "data": [1.0], "extra": 1})
    assert not is_json_tensor([1, 2]) and not is_json_tensor("FP32")


def test_numbers_and_lists_follow_torch_dtype_rules():
    assert (to_wire(True).datatype, to_wire(3).datatype, to_wire(2.5).datatype) == ("BOOL", "INT64", "FP32")
    assert to_wire([1, 2.5]).datatype == "FP32" and to_wire([True, 2]).datatype == "INT64"
    for bad, message in [(np.zeros(2, dtype=np.complex64), "complex64"), (np.zeros(2, dtype=np.uint16), "uint16"),
                         ("text", "is a str"), ([[1], [1, 2]], "cannot make a tensor"), (2**63, "INT64 range"),
                         (2**70, "not numbers")]:
        with pytest.raises(WireError, match=message):
            to_wire(bad)


# -- safetensors --------------------------------------------------------------------------


def test_safetensors_round_trip_of_every_datatype():
    named = {datatype.lower(): sample(datatype) for datatype in DATATYPES}
    body = encode_safetensors(named)
    back, metadata = read_safetensors(body)
    assert set(back) == set(named) and metadata == {}
    assert all(same(back[k], named[k]) for k in named)
    plain = encode_safetensors({"fp32": named["fp32"]})  # the library's reader agrees (numpy has no BF16)
    assert np.array_equal(safetensors.numpy.load(plain)["fp32"], named["fp32"].array)


def test_safetensors_takes_views_shared_arrays_and_scalars():
    base = np.arange(8.0)
    named = {"a": base, "b": base, "view": base[2:4], "t": base.reshape(2, 4).T, "s": np.int64(2)}
    back = read_safetensors(encode_safetensors(named))[0]
    assert all(np.array_equal(back[k].array, np.asarray(named[k])) for k in named)


@pytest.mark.parametrize(
    "body",
    [b"", b"short", b"garbage garbage garbage", struct.pack("<Q", 10**6) + b"{}", struct.pack("<Q", 2) + b"[]",
     struct.pack("<Q", 5) + b"{bad}"],
)
def test_malformed_safetensors_are_wire_errors(body):
    with pytest.raises(WireError):
        read_safetensors(body)


def test_truncated_safetensors_are_wire_errors():
    body = safetensors.numpy.save({"x": np.arange(100.0), "y": np.ones((3, 3))})
    for cut in (len(body) - 1, len(body) // 2, 9, 20):
        with pytest.raises(WireError):
            read_safetensors(body[:cut])


def test_safetensors_dtypes_without_a_datatype_are_refused():
    with pytest.raises(WireError, match="no wire datatype"):
        read_safetensors(safetensors.numpy.save({"u": np.zeros(2, dtype=np.uint16)}))


def test_a_writable_body_is_viewed_in_place_and_a_read_only_one_is_copied():
    named = {datatype.lower(): sample(datatype) for datatype in DATATYPES}
    named["big"] = to_wire(np.arange(4096, dtype=np.float32).reshape(64, 64))
    encoded = encode_safetensors(named)
    writable = bytearray(encoded)
    start = np.frombuffer(writable, dtype=np.uint8).ctypes.data
    viewed = read_safetensors(writable)[0]
    assert all(same(viewed[k], named[k]) for k in named)
    # no second copy of the body: every non-empty array's bytes lie inside it
    assert all(start <= viewed[k].array.ctypes.data < start + len(writable) for k in named)
    viewed["big"].array[0, 0] = -1.0  # writable, and a view: the body changes with it
    assert read_safetensors(writable)[0]["big"].array[0, 0] == -1.0
    copied = read_safetensors(encoded)[0]  # bytes are read-only: the arrays own copies
    copied["big"].array[0, 0] = -2.0
    assert read_safetensors(encoded)[0]["big"].array[0, 0] == 0.0


def _forge(named: dict[str, np.ndarray], edit, tail: bytes = b"") -> bytes:
    """A safetensors body of ``named`` whose header ``edit`` changed (and ``tail`` appended)."""
    body = safetensors.numpy.save(named)
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
    body = _forge({"a": np.arange(4.0, dtype=np.float32), "b": np.ones(4, np.float32)}, edit, tail)
    with pytest.raises(WireError, match=message):
        read_safetensors(bytearray(body))
    with pytest.raises(Exception):  # noqa: B017 - safetensors' own reader refuses them too
        safetensors.numpy.load(body)


def test_what_the_library_reads_is_read_the_same():
    named = {"a": np.arange(4.0, dtype=np.float32), "b": np.ones((2, 2))}
    body = _forge(named, _set("a", "note", "x"))  # keys the format does not define are ignored
    assert all(np.array_equal(read_safetensors(bytearray(body))[0][k].array, safetensors.numpy.load(body)[k])
               for k in named)
    fp8 = _forge({"a": np.zeros(4, dtype=np.uint8)}, _set("a", "dtype", "F8_E4M3"))
    with pytest.raises(WireError, match="dtype 'F8_E4M3' has no wire datatype"):
        read_safetensors(fp8)


def test_bool_bytes_other_than_0_and_1_are_refused():
    body = bytearray(safetensors.numpy.save({"m": np.array([True, False])}))
    body[-1] = 7
    with pytest.raises(WireError, match="BOOL bytes must be 0 or 1"):
        read_safetensors(body)


# -- the call and answer naming -----------------------------------------------------------


def test_pack_call_flattens_lists_and_unpack_call_restores_them():
    x = [np.float32([1.0]), np.float32([2.0])]
    named = pack_call({"x": x, "y": np.ones((2, 2))})
    assert sorted(named) == ["x.0", "x.1", "y"]
    kwargs = unpack_call(read_safetensors(encode_safetensors(named))[0])
    assert [t.array.tolist() for t in kwargs["x"]] == [[1.0], [2.0]] and kwargs["y"].array.tolist() == [[1, 1], [1, 1]]


def test_pack_call_turns_numbers_and_arrays_into_tensors():
    named = pack_call({"x": [1, 1, 1, 1], "y": 2.5, "z": np.arange(3), "w": [[1, 2], [3, 4]],
                       "t": {"datatype": "FP16", "shape": [1], "data": [0.5]}})
    assert [named[f"x.{i}"].array.item() for i in range(4)] == [1, 1, 1, 1]
    assert named["x.0"].datatype == "INT64" and named["x.0"].shape == []
    assert named["y"].datatype == "FP32" and named["y"].array.item() == 2.5
    assert named["w.1"].array.tolist() == [3, 4] and same(named["t"], WireTensor("FP16", np.float16([0.5])))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"config": {"hidden": 4}}, "send other values as JSON"), ({"x": None}, "NoneType"), ({"x": []}, "empty list"),
     ({"x": ["a"]}, "is a str"), ({"x": [["a"]]}, "cannot make a tensor"), ({"not valid": 1}, "not a valid argument name"),
     ({"x": 2**70}, "cannot make a tensor")],
)
def test_pack_call_errors(kwargs, message):
    with pytest.raises(WireError, match=message):
        pack_call(kwargs)


@pytest.mark.parametrize(
    ("names", "message"),
    [(["x.0", "x.2"], r"missing x\.1"), (["x.1"], r"missing x\.0"), (["x", "x.0"], "both as a tensor and as list items"),
     (["x.01"], "neither an argument name"), (["a.b"], "neither an argument name"),
     (["x.0.1"], "neither an argument name"), (["1x"], "neither an argument name")],
)
def test_unpack_call_errors(names, message):
    with pytest.raises(WireError, match=message):
        unpack_call({name: 0 for name in names})


def test_unpack_call_orders_list_items_by_index():
    named = {f"x.{i}": i for i in (10, 2, 0, 1, 3, 4, 5, 6, 7, 8, 9)}
    assert unpack_call(named)["x"] == list(range(11))


def test_output_round_trip_keeps_dotted_and_digit_keys():
    weights = {"gate_up_proj.weight": np.ones((4, 2)), "down_proj.weight": np.zeros((2, 2))}
    odd = {"0": np.int64([0]), "": np.int64([1]), "50%": np.int64([2]), "a.b.c": np.int64([3])}
    output = [weights, weights, {"nested": [odd, (np.int64([5]),)]}]
    named = pack_output(output)
    assert "output.0.gate_up_proj%2Eweight" in named and list(pack_output(5)) == ["output"]
    back = unpack_output(read_safetensors(encode_safetensors(named))[0])
    assert isinstance(back, list) and len(back) == 3 and set(back[0]) == set(weights)
    assert back[1]["gate_up_proj.weight"].array.tolist() == [[1.0, 1.0]] * 4
    inner = back[2]["nested"]
    assert {k: v.array.tolist() for k, v in inner[0].items()} == {k: v.tolist() for k, v in odd.items()}
    assert inner[1][0].array.tolist() == [5]  # tuples come back as lists


@pytest.mark.parametrize("output", [None, [None, None], "text", [], {}, [np.ones(1), object()]])
def test_pack_output_refuses_what_safetensors_cannot_carry(output):
    with pytest.raises(WireError):
        pack_output(output)


@pytest.mark.parametrize(
    ("names", "message"),
    [([], "no tensors"), (["other"], "not under 'output'"), (["output", "output.0"], "both a tensor and a container"),
     (["output.0", "output.2"], "do not run from 0"), (["output.0", "output.key"], "mixes list indices and mapping keys"),
     (["output.0", "output.0.a"], "nests under a tensor")],
)
def test_unpack_output_errors(names, message):
    with pytest.raises(WireError, match=message):
        unpack_output({name: 0 for name in names})

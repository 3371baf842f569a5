"""hybridflow.state.codec: journal entries, snapshots and answers to bytes and back,
without pickle: exact bits for every dtype, types as documented, a ValueError naming
the path for what it cannot store, and a ValueError for any bytes it did not write."""

from __future__ import annotations

import enum
import json
import math
import random
import struct
from collections import OrderedDict, defaultdict, namedtuple

import numpy as np
import pytest
import torch
from safetensors.torch import save as safetensors_save

from hybridflow.state.codec import (
    MAX_DEPTH,
    StateCodecError,
    decode_answer,
    decode_call,
    decode_snapshot,
    decode_value,
    encode_answer,
    encode_call,
    encode_snapshot,
    encode_value,
    fingerprint,
)

#: Bit patterns no arithmetic would produce: NaNs with payloads and both signs,
#: infinities, signed zeros, the smallest subnormals.
FLOAT_BITS = {
    torch.float32: [0x7FC00000, 0xFFC00001, 0x7F800001, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001, 0x3F800000],
    torch.float64: [0x7FF8000000000000, 0xFFF0000000000001, 0x7FF0000000000000, 0xFFF0000000000000,
                    0x8000000000000000, 0x0000000000000001],
    torch.float16: [0x7E00, 0xFC01, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x3C00],
    torch.bfloat16: [0x7FC0, 0xFF81, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x3F80],
}
BITS_DTYPE = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def special_floats(dtype: torch.dtype) -> torch.Tensor:
    width = torch.iinfo(BITS_DTYPE[dtype]).bits
    signed = [b - (1 << width) if b >= 1 << (width - 1) else b for b in FLOAT_BITS[dtype]]
    return torch.tensor(signed, dtype=BITS_DTYPE[dtype]).view(dtype)


def bits(tensor: torch.Tensor) -> bytes:
    """The tensor's raw bytes (for any dtype, bfloat16 included)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return type(b) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)


def round_trip(value):
    return decode_value(encode_value(value))


# -- tensors ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(FLOAT_BITS))
def test_float_tensors_keep_every_bit(dtype):
    tensor = special_floats(dtype)
    assert tensor.isnan().sum() >= 2 and tensor.isinf().sum() >= 2
    back = round_trip(tensor)
    assert same_tensor(tensor, back)


@pytest.mark.parametrize(
    "dtype",
    [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
     torch.uint64, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2],
)
def test_every_other_dtype_round_trips(dtype):
    if dtype is torch.bool:
        tensor = torch.tensor([[True, False], [False, True]])
    elif dtype.is_floating_point:
        tensor = torch.tensor([[0.5, -2.0], [448.0 if dtype is torch.float8_e4m3fn else 57344.0, 0.0]]).to(dtype)
    elif dtype.is_complex:
        tensor = torch.tensor([[1 + 2j, float("nan") + 0j], [complex(0, float("inf")), -0.0 + 0j]], dtype=dtype)
    else:
        info = torch.iinfo(dtype)
        tensor = torch.tensor([[info.min, info.max], [0, 1]], dtype=torch.int64).to(dtype) if info.bits < 64 else (
            torch.tensor([info.min, info.max, 0, 1], dtype=dtype).reshape(2, 2)
        )
    assert same_tensor(tensor, round_trip(tensor))


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (2, 3, 4)])
def test_tensor_shapes_round_trip(shape):
    tensor = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    assert same_tensor(tensor, round_trip(tensor))


def test_views_parameters_and_shared_memory_come_back_as_plain_owned_tensors():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    parameter = torch.nn.Parameter(torch.ones(2))
    complex_base = torch.tensor([1 + 2j], dtype=torch.complex64)
    values = [base, base, base.t(), base[1], base[:, ::2], parameter, complex_base.conj(), -base[0]]
    back = round_trip(values)
    for original, decoded in zip(values, back, strict=True):
        assert same_tensor(original.detach().resolve_conj().resolve_neg(), decoded)
        assert decoded.is_contiguous() and not decoded.requires_grad
    back[0].add_(100)  # decoded tensors own their memory
    assert back[1][0, 0].item() == 0 and back[3][0].item() == 4


def test_a_module_state_dict_restores_a_module():
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    state = layer.state_dict()
    assert isinstance(state, OrderedDict)
    [restored_state] = decode_snapshot(encode_snapshot([state]))
    assert type(restored_state) is dict and list(restored_state) == list(state)
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    fresh.load_state_dict(restored_state)
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    assert bits(fresh(x).detach()) == bits(layer(x).detach())


# -- numpy --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint16, np.uint32, np.uint64,
              np.float16, np.float32, np.float64, np.complex64],
)
def test_numpy_arrays_come_back_as_numpy_arrays(dtype):
    array = (np.arange(6) % 2 == 0) if dtype is np.bool_ else np.arange(6).astype(dtype)
    array = array.reshape(2, 3)
    back = round_trip(array)
    assert type(back) is np.ndarray and back.dtype == array.dtype and back.shape == (2, 3)
    assert back.tobytes() == array.tobytes()


def test_numpy_special_floats_odd_layouts_and_scalars():
    nan_payload = np.array([0x7FF8000000000123, 0xFFF0000000000000, 0x8000000000000000], dtype=np.uint64).view(np.float64)
    big_endian = np.arange(4, dtype=">i4")
    read_only = np.arange(3.0)
    read_only.setflags(write=False)
    strided = np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2]
    values = {"nan": nan_payload, "be": big_endian, "ro": read_only, "strided": strided, "zero_d": np.array(2.5),
              "f32": np.float32(1.5), "i8": np.int8(-3), "b": np.bool_(True), "f16": np.float16("inf")}
    back = round_trip(values)
    assert back["nan"].view(np.uint64).tolist() == nan_payload.view(np.uint64).tolist()
    assert back["be"].tolist() == [0, 1, 2, 3] and back["be"].dtype == np.dtype("<i4")
    assert back["ro"].tolist() == [0.0, 1.0, 2.0]
    assert back["strided"].tolist() == strided.tolist()
    assert type(back["zero_d"]) is np.ndarray and back["zero_d"].shape == () and back["zero_d"] == 2.5
    for name in ("f32", "i8", "b", "f16"):
        assert type(back[name]) is type(values[name]) and back[name] == values[name]


# -- plain values -------------------------------------------------------------------------


def test_plain_values_keep_their_types():
    values = [
        None, True, False, 0, -1, 2**200, -(2**63), 1.5, -0.0, 1e-310, float("inf"), float("-inf"),
        "", "text", "ünïcødé ✓", "\ud800 lone surrogate", "\x00", b"", b"\x00\xffbytes",
        [], (), {}, [1, [2, (3, 4)]], (1, "a", None), ((),),
    ]
    back = round_trip(values)
    assert type(back) is list and len(back) == len(values)
    for original, decoded in zip(values, back, strict=True):
        assert type(decoded) is type(original) and decoded == original
    assert math.copysign(1.0, back[8]) == -1.0
    assert math.isnan(round_trip(float("nan")))
    nan_bits = struct.unpack("<d", bytes.fromhex("0100000000f8ffff"))[0]  # a NaN with a payload, sign set
    assert struct.pack("<d", round_trip(nan_bits)) == struct.pack("<d", nan_bits)


def test_mappings_keep_order_and_any_simple_key():
    ordered = OrderedDict([("z", 1), ("a", 2), ("layer.weight", 3)])
    assert list(round_trip(ordered)) == ["z", "a", "layer.weight"]
    odd_keys = {1: "int", 2.5: "float", None: "none", False: "bool", ("a", 1): "tuple", "$tensor": "dollar",
                "$": "x", float("inf"): "inf"}
    back = round_trip(odd_keys)
    assert back == odd_keys and list(back) == list(odd_keys)
    assert type(next(k for k in back if k == ("a", 1))) is tuple
    # a mapping that looks like a placeholder is data, not a reference
    assert round_trip({"$tensor": 0}) == {"$tensor": 0}
    assert round_trip([{"$tuple": [1]}, {"$bytes": 0}]) == [{"$tuple": [1]}, {"$bytes": 0}]


def test_a_call_round_trips_with_args_as_a_tuple():
    x = torch.tensor([[1.0, float("nan")]], dtype=torch.bfloat16)
    entry = encode_call("init_model", [1, (2, 3)], {"config": {"hidden_size": 64}, "x": x, "ids": np.arange(3)})
    method, args, kwargs = decode_call(entry)
    assert method == "init_model" and args == (1, (2, 3)) and type(args) is tuple
    assert kwargs["config"] == {"hidden_size": 64} and same_tensor(x, kwargs["x"])
    assert kwargs["ids"].tolist() == [0, 1, 2]
    assert decode_call(encode_call("get_value", (), {})) == ("get_value", (), {})


def test_snapshots_and_answers_round_trip():
    ranks = [{"value": torch.tensor([float(rank)]), "step": rank, "rng": np.arange(rank)} for rank in range(4)]
    back = decode_snapshot(encode_snapshot(ranks))
    assert len(back) == 4 and [b["step"] for b in back] == [0, 1, 2, 3]
    assert [b["value"].item() for b in back] == [0.0, 1.0, 2.0, 3.0] and back[3]["rng"].tolist() == [0, 1, 2]
    assert decode_snapshot(encode_snapshot([])) == []
    output = [torch.tensor([1.0]), torch.tensor([2.0])]
    assert [t.item() for t in decode_answer(encode_answer(output))] == [1.0, 2.0]
    assert decode_answer(encode_answer({"status": 422, "error": "bad"})) == {"status": 422, "error": "bad"}
    assert decode_answer(encode_answer(None)) is None


def test_encoding_is_deterministic_and_fingerprints_tell_bodies_apart():
    first = encode_call("add", (), {"x": torch.ones(4), "y": [1, 2]})
    assert first == encode_call("add", (), {"x": torch.ones(4), "y": [1, 2]})
    assert fingerprint(first) == fingerprint(encode_call("add", (), {"x": torch.ones(4), "y": [1, 2]}))
    assert fingerprint(first) != fingerprint(encode_call("add", (), {"x": torch.ones(4), "y": [1, 3]}))
    assert len(fingerprint(first)) == 64


def test_the_structure_is_json_and_tensors_are_not_in_it():
    blob = encode_call("add", (), {"x": torch.full((1000,), 7.0)})
    header_len = struct.unpack_from("<Q", blob, 5)[0]
    header = json.loads(blob[13:13 + header_len])
    assert header == {"kind": "call", "tensors": 1,
                      "body": {"method": "add", "args": {"$tuple": []}, "kwargs": {"x": {"$tensor": 0}}}}
    assert len(blob) > 4000  # the tensor's bytes follow, as safetensors


# -- what cannot be stored: a ValueError naming the path -----------------------------------


class Colour(enum.IntEnum):
    RED = 1


Point = namedtuple("Point", "x y")


@pytest.mark.parametrize(
    "encode, path, problem",
    [
        (lambda: encode_call("m", (), {"x": [1, {2: {3}}]}), r"kwargs\['x'\]\[1\]\[2\]", "set"),
        (lambda: encode_call("m", (object(),), {}), r"args\[0\]", "object"),
        (lambda: encode_call("m", (), {"x": torch.zeros(2, dtype=torch.complex128)}), r"kwargs\['x'\]", "complex128"),
        (lambda: encode_call("m", (), {"x": torch.zeros(3).to_sparse()}), r"kwargs\['x'\]", "layout"),
        (lambda: encode_call("m", (), {"x": torch.zeros(2, device="meta")}), r"kwargs\['x'\]", "meta"),
        (lambda: encode_call("m", (), {"x": np.array(["a"])}), r"kwargs\['x'\]", "numpy dtype"),
        (lambda: encode_call("m", (), {"x": np.array([object()])}), r"kwargs\['x'\]", "numpy dtype"),
        (lambda: encode_call("m", (), {"x": np.zeros(2, dtype=np.complex128)}), r"kwargs\['x'\]", "complex128"),
        (lambda: encode_call("m", (), {"x": np.str_("a")}), r"kwargs\['x'\]", "str_"),
        (lambda: encode_call("m", (), {"x": Colour.RED}), r"kwargs\['x'\]", "Colour"),
        (lambda: encode_call("m", (), {"x": defaultdict(int)}), r"kwargs\['x'\]", "defaultdict"),
        (lambda: encode_call("m", (), {"x": Point(1, 2)}), r"kwargs\['x'\]", "Point"),
        (lambda: encode_call("m", (), {"x": bytearray(b"a")}), r"kwargs\['x'\]", "bytearray"),
        (lambda: encode_call("m", (), {"x": 1j}), r"kwargs\['x'\]", "complex"),
        (lambda: encode_call("m", (), {"x": 2**9000}), r"kwargs\['x'\]", "bits"),
        (lambda: encode_call("m", (), {"x": {frozenset(): 1}}), r"kwargs\['x'\]\[frozenset\(\)\]", "key"),
        (lambda: encode_snapshot([{}, {"w": [torch.ones(1), lambda: 0]}]), r"rank\[1\]\['w'\]\[1\]", "function"),
        (lambda: encode_answer({"out": {1, 2}}), r"output\['out'\]", "set"),
        (lambda: encode_value([[[[]]]] * 2 + [{1.5: range(3)}]), r"value\[2\]\[1\.5\]", "range"),
        (lambda: encode_call("", (), {}), "method", "non-empty"),
        (lambda: encode_call("m", (), {1: 2}), r"kwargs\[1\]", "keyword names"),
        (lambda: encode_snapshot({"w": 1}), "rank_states", "one state per rank"),
    ],
)
def test_unsupported_values_raise_a_value_error_naming_the_path(encode, path, problem):
    with pytest.raises(StateCodecError, match=problem) as raised:
        encode()
    assert isinstance(raised.value, ValueError)
    assert __import__("re").match(path, str(raised.value)), str(raised.value)


def test_the_deepest_body_the_wire_takes_is_journaled_and_snapshotted():
    """One depth for the wire and the store: a call nested as deep as limits.max_depth
    allows can be journaled, and a state_dict that keeps its argument (two levels deeper)
    snapshotted, so no accepted call can make snapshots fail."""
    from hybridflow.config import LimitsConfig
    from hybridflow.http.call_body import parse_call_body
    from hybridflow.http.errors import ApiError
    from hybridflow_client.wire.limits import MAX_DEPTH as WIRE_MAX_DEPTH
    from hybridflow_client.wire.limits import WireLimits

    item: list = [1]
    for _ in range(WIRE_MAX_DEPTH - 2):
        item = [item]
    args, kwargs = parse_call_body("json", json.dumps({"args": [item]}).encode())
    assert args == [item]
    assert decode_call(encode_call("record", args, kwargs)) == ("record", (item,), {})
    assert decode_snapshot(encode_snapshot([{"history": [item]}] * 2)) == [{"history": [item]}] * 2
    with pytest.raises(ApiError, match="nests deeper"):  # one level more: refused at the door
        parse_call_body("json", json.dumps({"args": [[item]]}).encode())
    for build in (WireLimits, LimitsConfig):
        with pytest.raises(ValueError, match=f"(at most|less than or equal to) {WIRE_MAX_DEPTH}"):
            build(max_depth=WIRE_MAX_DEPTH + 1)


def test_cycles_and_deep_nesting_are_refused():
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(StateCodecError, match="nested deeper"):
        encode_value(cycle)
    deep: list = []
    for _ in range(MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(StateCodecError, match=r"value\[0\]\[0\]"):
        encode_value(deep)
    shallow: list = []
    for _ in range(MAX_DEPTH - 1):
        shallow = [shallow]
    assert round_trip(shallow) == shallow


# -- bytes it did not write: a ValueError, never anything else ------------------------------


def frame(header: object, blob: bytes = b"", raw: bytes | None = None) -> bytes:
    text = raw if raw is not None else json.dumps(header).encode()
    return b"HFSC\x01" + struct.pack("<Q", len(text)) + text + blob


def value_header(body: object, tensors: int = 0) -> dict:
    return {"kind": "value", "tensors": tensors, "body": {"value": body}}


TOO_DEEP: list = []
for _ in range(MAX_DEPTH + 1):
    TOO_DEEP = [TOO_DEEP]
ONE_TENSOR = safetensors_save({"0": torch.ones(2)})
ONE_BF16 = safetensors_save({"0": torch.ones(2, dtype=torch.bfloat16)})


@pytest.mark.parametrize(
    "data, problem",
    [
        (b"", "too short"),
        (b"HFSC", "too short"),
        (b"PK\x03\x04" + bytes(20), "magic"),
        (b"\x80\x04\x95" + bytes(20), "magic"),  # a pickle is not even looked at
        (b"HFSC\x02" + bytes(8), "format 2"),
        (b"HFSC\x01" + struct.pack("<Q", 2**63) + b"{}", "runs past the end"),
        (frame(None, raw=b"{not json"), "not valid JSON"),
        (frame(None, raw=b"\xff\xfe"), "not valid JSON"),
        (frame(None, raw=b'{"kind": "value", "tensors": 0, "body": {"value": NaN}}'), "NaN"),
        (frame(None, raw=b'{"kind": "value", "tensors": 0, "body": {"value": 1e999}}'), "non-finite"),
        (frame(None, raw=b'{"kind": "value", "kind": "value", "tensors": 0, "body": {}}'), "repeated key"),
        (frame(None, raw=b"[" * 100_000 + b"]" * 100_000), "nested"),
        (frame([1, 2]), "must be an object"),
        (frame({"kind": "value", "tensors": 0}), "must be an object"),
        (frame({"kind": "pickle", "tensors": 0, "body": {}}), "bad kind"),
        (frame({"kind": "value", "tensors": -1, "body": {}}), "tensor count"),
        (frame({"kind": "value", "tensors": True, "body": {}}), "tensor count"),
        (frame({"kind": "value", "tensors": 0, "body": []}), "bad kind"),
        (frame(value_header(1)) + b"extra", "after a header"),
        (frame(value_header(1), b""), None),  # valid: decodes to 1
        (frame({"kind": "value", "tensors": 0, "body": {"other": 1}}), "needs the fields"),
        (frame(value_header({"$unknown": 1})), "unknown tag"),
        (frame(value_header({"$tuple": [], "x": 1})), "unknown tag"),
        (frame(value_header({"$tuple": 5})), "needs a list"),
        (frame(value_header({"$dict": [[1]]})), "pair"),
        (frame(value_header({"$dict": [[[1], 2]]})), "mapping key"),
        (frame(value_header({"$dict": [[1, 2], [1, 3]]})), "repeated key"),
        (frame(value_header({"$float": "zz"})), "16 hex"),
        (frame(value_header({"$float": 1.0})), "16 hex"),
        (frame(value_header({"$tensor": 0})), "missing tensor"),
        (frame(value_header({"$tensor": 0}, 1), ONE_TENSOR[:-3]), "not valid safetensors"),
        (frame(value_header({"$tensor": 0}, 1), b"\xff" * 40), "not valid safetensors"),
        (frame(value_header({"$tensor": "0"}, 1), ONE_TENSOR), "missing tensor"),
        (frame(value_header({"$tensor": 1}, 1), ONE_TENSOR), "missing tensor"),
        (frame(value_header([{"$tensor": 0}, {"$tensor": 0}], 1), ONE_TENSOR), "referenced twice"),
        (frame(value_header(1, 1), ONE_TENSOR), "not referenced"),
        (frame(value_header({"$tensor": 0}, 2), ONE_TENSOR), "unexpected names"),
        (frame(value_header({"$bytes": 0}, 1), ONE_TENSOR), "1-D U8"),
        (frame(value_header({"$npscalar": 0}, 1), ONE_TENSOR), "0-d"),
        (frame(value_header({"$ndarray": 0}, 1), ONE_BF16), "numpy cannot hold"),
        (frame(value_header(TOO_DEEP)), "nested deeper"),
    ],
)
def test_hostile_bytes_raise_a_value_error(data, problem):
    if problem is None:
        assert decode_value(data) == 1
        return
    with pytest.raises(StateCodecError, match=problem):
        decode_value(data)


def test_a_record_of_another_kind_is_refused():
    answer = encode_answer([1])
    for decode in (decode_call, decode_snapshot, decode_value):
        with pytest.raises(StateCodecError, match="answer record where"):
            decode(answer)
    bad_call = frame({"kind": "call", "tensors": 0, "body": {"method": "m", "args": [1], "kwargs": {}}})
    with pytest.raises(StateCodecError, match="tuple of args"):
        decode_call(bad_call)
    bad_kwargs = frame({"kind": "call", "tensors": 0,
                        "body": {"method": "m", "args": {"$tuple": []}, "kwargs": {"$dict": [[1, 2]]}}})
    with pytest.raises(StateCodecError, match="keyword names"):
        decode_call(bad_kwargs)
    bad_ranks = frame({"kind": "snapshot", "tensors": 0, "body": {"rank[1]": {}}})
    with pytest.raises(StateCodecError, match="rank"):
        decode_snapshot(bad_ranks)
    with pytest.raises(StateCodecError, match="bytes are required"):
        decode_value("HFSC")


def test_every_truncation_and_random_corruption_gives_a_value_error_or_a_value():
    """Cut a real record at every length and flip random bytes in it: decoding either
    fails with StateCodecError or (when the flip hit a value's digits) returns a value;
    it never raises anything else."""
    record = encode_call(
        "add", (1.5, "s", (None, True)),
        {"x": torch.arange(6, dtype=torch.bfloat16), "y": np.arange(3), "z": np.float32(2), "b": b"\x01\x02",
         "d": {1: [float("nan")]}},
    )
    for cut in range(len(record)):
        with pytest.raises(StateCodecError):
            decode_call(record[:cut])
    rng = random.Random(13)
    outcomes = {"error": 0, "value": 0}
    for _ in range(3000):
        corrupted = bytearray(record)
        for _ in range(rng.randint(1, 4)):
            corrupted[rng.randrange(len(corrupted))] = rng.randrange(256)
        try:
            decode_call(bytes(corrupted))
            outcomes["value"] += 1
        except StateCodecError:
            outcomes["error"] += 1
    assert outcomes["error"] > 1000


# -- verl's DataProto ---------------------------------------------------------------------


def test_a_journaled_dataproto_argument_comes_back_whole():
    """A mutating verl method takes a DataProto (update_actor(data)); the journal keeps it
    without pickle and a replay gets the same batch, non-tensor columns and meta_info."""
    from single_controller.protocol import DataProto

    data = DataProto.from_dict(
        tensors={"responses": special_floats(torch.float32).reshape(2, 4), "mask": torch.tensor([[1], [0]])},
        non_tensors={"uid": np.array(["a", "b"], dtype=object), "score": np.array([0.5, 1.5])},
        meta_info={"temperature": 0.7, "tags": ["x", None]},
    )
    method, args, kwargs = decode_call(encode_call("update_actor", (data,), {"again": data}))
    assert method == "update_actor"
    for back in (args[0], kwargs["again"]):
        assert type(back) is DataProto and len(back) == 2
        assert same_tensor(data.batch["responses"], back.batch["responses"])
        assert torch.equal(back.batch["mask"], data.batch["mask"])
        assert back.non_tensor_batch["uid"].tolist() == ["a", "b"]
        assert back.non_tensor_batch["score"].tolist() == [0.5, 1.5]
        assert back.meta_info == {"temperature": 0.7, "tags": ["x", None]}


def test_a_dataproto_the_store_cannot_keep_names_its_place():
    from single_controller.protocol import DataProto

    data = DataProto.from_dict(tensors={"x": torch.ones(1, 2)}, meta_info={"callback": object()})
    with pytest.raises(StateCodecError, match=r"kwargs\['data'\]: DataProto.meta_info"):
        encode_call("update", (), {"data": data})


def test_a_forged_dataproto_record_is_refused():
    blob = encode_value({"d": [1]})
    header_len = struct.unpack_from("<4sBQ", blob)[2]
    header = json.loads(blob[13:13 + header_len])
    for payload in ({"document": {}, "tensors": {}}, {"document": None}, [1]):
        header["body"] = {"value": {"$dataproto": payload}}
        forged = json.dumps(header).encode()
        with pytest.raises(StateCodecError, match=r"\$dataproto|DataProto"):
            decode_value(struct.pack("<4sBQ", b"HFSC", 1, len(forged)) + forged)

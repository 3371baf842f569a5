"""wire's limits and the helpers the server calls with them: the strict loader's value
count, the size of a JSON answer, OIP output selection and header lengths, job splits."""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.wire.errors import WireError
from hybridflow.wire.json_tensors import check_json_output, decode_json_value, json_value_count
from hybridflow.wire.limits import DEFAULT_LIMITS, WireLimits
from hybridflow.wire.oip_messages import parse_header_length, parse_infer_request, requested_outputs
from hybridflow.wire.split import split_call
from hybridflow.wire.strict_json import loads_strict, value_bound


def test_limits_are_positive_and_built_from_a_config_mapping():
    assert WireLimits.from_mapping(None) == DEFAULT_LIMITS
    assert WireLimits.from_mapping({"max_tensors": 7}).max_tensors == 7
    with pytest.raises(ValueError, match="unknown field 'max_tensor'"):
        WireLimits.from_mapping({"max_tensor": 7})
    with pytest.raises(ValueError, match="limits.max_depth must be a positive integer"):
        WireLimits(max_depth=0)
    with pytest.raises(ValueError, match="max_json_values"):
        WireLimits(max_json_values=True)


def test_the_value_count_skips_strings_and_is_exact_for_compact_json():
    body = json.dumps({"a": [1, 2, [], {"b": None}, {}], "s": "x,y:[]{z" * 50}, separators=(",", ":")).encode()
    # the object, the list, 1, 2, [], {"b": ...}, None, {}, the string
    assert value_bound(body) == 9 and value_bound(b"[[],[{}]]") == 4 and value_bound(b"7") == 1
    assert loads_strict(body, limits=WireLimits(max_json_values=9))["a"][0] == 1
    with pytest.raises(WireError, match="more than 8 JSON values"):
        loads_strict(body, limits=WireLimits(max_json_values=8))
    # strings full of brackets cannot lower the count
    padded = json.dumps(["[]{}" * 100] + [0] * 20).encode()
    with pytest.raises(WireError, match="more than 20 JSON values"):
        loads_strict(padded, limits=WireLimits(max_json_values=20))


@pytest.mark.parametrize(
    ("raw", "message"),
    [(b"[NaN]", "NaN is not a number"), (b"[1e400]", "out of range for a 64-bit float"),
     (b"[9223372036854775808]", "out of the 64-bit range"), (b"{", "not valid JSON"), (b"\xff", "not valid JSON"),
     ('["\u2200", 0]'.encode("utf-16-le"), "must be UTF-8")],
)
def test_the_strict_loader_refuses_what_json_or_64_bits_cannot_hold(raw, message):
    with pytest.raises(WireError, match=message):
        loads_strict(raw)
    assert loads_strict(b"[-9223372036854775808, 1.5]") == [-(2**63), 1.5]


def test_decode_counts_tensors_and_values_before_building():
    one = {"datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}
    assert len(decode_json_value([one] * 3, limits=WireLimits(max_tensors=3))) == 3
    with pytest.raises(WireError, match="more than 2 tensors"):
        decode_json_value({"x": [one, {"y": [one, one]}]}, "kwargs", WireLimits(max_tensors=2))
    with pytest.raises(WireError, match="more than 20 values"):
        decode_json_value([[0] * 10, [[]] * 10], limits=WireLimits(max_json_values=20))


def test_json_answer_size_counts_elements_without_encoding():
    output = [{"w": torch.zeros(3, 4), "n": 5}, (torch.ones(2), "text")]
    # the outer list, the dict, 12 elements, 5, the tuple, 2 elements, "text"
    assert json_value_count(output) == 1 + 1 + 12 + 1 + 1 + 2 + 1
    assert check_json_output(output, WireLimits(max_json_output_values=19)) == 19
    with pytest.raises(WireError, match="more than 18 JSON values.*safetensors"):
        check_json_output(output, WireLimits(max_json_output_values=18))
    loop: list = []
    loop.append(loop)
    with pytest.raises(WireError, match="cycle"):
        json_value_count(loop)


def test_requested_outputs_pick_names_and_binary_flags():
    assert requested_outputs({}, ["y", "z"]) == (["y", "z"], set())
    assert requested_outputs({"parameters": {"binary_data_output": True}}, ["y", "z"]) == (["y", "z"], {"y", "z"})
    request = {"outputs": [{"name": "z", "parameters": {"binary_data": True}}, {"name": "y"}]}
    assert requested_outputs(request, ["y", "z"]) == (["z", "y"], {"z"})
    with pytest.raises(WireError, match="no output 'q'"):
        requested_outputs({"outputs": [{"name": "q"}]}, ["y"])


def test_header_length_is_checked_in_one_place():
    assert parse_header_length(None, 10) is None
    assert parse_header_length(" 4 ", 10) == 4 and parse_header_length(10, 10) == 10
    for bad, message in [("x", "not a non-negative integer"), ("-1", "not a non-negative integer"),
                         ("11", "does not fit a body of 10 bytes"), ("9" * 40, "not a non-negative integer")]:
        with pytest.raises(WireError, match=message):
            parse_header_length(bad, 10)
    header = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"parameters":{"binary_data_size":4}}]}'
    _, tensors = parse_infer_request(header + b"\0\0\x80?", str(len(header)))
    assert tensors["x"].tolist() == [1.0]


def test_split_pieces_are_tensor_split_pieces_made_on_demand():
    x = torch.arange(22.0).reshape(11, 2)
    y = torch.arange(7.0)
    pieces = split_call([[x, y], "keep"], {"scale": 2}, 3)
    assert len(pieces) == 3
    for (args, kwargs), want_x, want_y in zip(pieces, torch.tensor_split(x, 3), torch.tensor_split(y, 3), strict=True):
        assert torch.equal(args[0][0], want_x) and torch.equal(args[0][1], want_y)
        assert args[1:] == ["keep"] and kwargs == {"scale": 2}
    assert pieces[-1][0][0][0].data_ptr() == x[8:].data_ptr()  # views, not copies
    assert list(split_call([1], {}, 1)) == [([1], {})]
    with pytest.raises(WireError, match="one argument that is a list of tensors"):
        split_call([], {"a": [x], "b": [y]}, 2)
    with pytest.raises(WireError, match="4 pieces, over the limit of 3"):
        split_call([], {"x": [x, y]}, 2, WireLimits(max_split_views=3))

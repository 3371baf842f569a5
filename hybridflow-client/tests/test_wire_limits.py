"""The wire's limits and what every decoder does with them: the strict loader's value
count and its one budget per body (a safetensors header and every batch document in it),
the tensors and values of decoded JSON, the size of a JSON answer, OIP output selection
and header lengths. numpy only."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.json_values import check_json_output, decode_json_value, json_value_count
from hybridflow_client.wire.limits import CLIENT_LIMITS, DEFAULT_LIMITS, MAX_DEPTH, WireLimits
from hybridflow_client.wire.oip_messages import parse_header_length, parse_infer_request, requested_outputs
from hybridflow_client.wire.safetensors_body import encode_safetensors
from hybridflow_client.wire.safetensors_call import decode_call_body, decode_output_body
from hybridflow_client.wire.strict_json import JsonBudget, loads_strict, value_bound


def test_limits_are_positive_and_built_from_a_config_mapping():
    assert WireLimits.from_mapping(None) == DEFAULT_LIMITS
    assert WireLimits.from_mapping({"max_tensors": 7}).max_tensors == 7
    with pytest.raises(ValueError, match="unknown field 'max_tensor'"):
        WireLimits.from_mapping({"max_tensor": 7})
    with pytest.raises(ValueError, match="limits.max_depth must be a positive integer"):
        WireLimits(max_depth=0)
    with pytest.raises(ValueError, match="max_json_values"):
        WireLimits(max_json_values=True)
    with pytest.raises(ValueError, match="at most 100"):
        WireLimits(max_depth=MAX_DEPTH + 1)
    # a client's limits are past anything a service's config allows by default, but its nesting
    assert all(getattr(CLIENT_LIMITS, name) > getattr(DEFAULT_LIMITS, name)
               for name in ("max_tensors", "max_json_values", "max_json_output_values", "max_tensor_elements"))
    assert CLIENT_LIMITS.max_depth == MAX_DEPTH


def test_the_value_count_skips_strings_and_is_exact_for_compact_json():
    body = json.dumps({"a": [1, 2, [], {"b": None}, {}], "s": "x,y:[]{z" * 50}, separators=(",", ":")).encode()
    # the object, the list, 1, 2, [], {"b": ...}, None, {}, the string
    assert value_bound(body) == 9 and value_bound(b"[[],[{}]]") == 4 and value_bound(b"7") == 1
    assert loads_strict(body, limits=WireLimits(max_json_values=9))["a"][0] == 1
    with pytest.raises(WireError, match="more than 8 JSON values") as refused:
        loads_strict(body, limits=WireLimits(max_json_values=8))
    assert refused.value.unparsed
    padded = json.dumps(["[]{}" * 100] + [0] * 20).encode()  # strings full of brackets cannot lower the count
    with pytest.raises(WireError, match="more than 20 JSON values"):
        loads_strict(padded, limits=WireLimits(max_json_values=20))


@pytest.mark.parametrize(
    ("raw", "message"),
    [(b"[NaN]", "NaN is not a number"), (b"[1e400]", "out of range for a 64-bit float"),
     (b"[9223372036854775808]", "out of the 64-bit range"), (b"{", "not valid JSON"), (b"\xff", "not valid JSON"),
     ('["\u2200", 0]'.encode("utf-16-le"), "must be UTF-8")],
)
def test_the_strict_loader_refuses_what_json_or_64_bits_cannot_hold(raw, message):
    with pytest.raises(WireError, match=message) as refused:
        loads_strict(raw)
    assert refused.value.unparsed
    assert loads_strict(b"[-9223372036854775808, 1.5]") == [-(2**63), 1.5]
    assert loads_strict(b"[18446744073709551615]", wide_ints=True) == [2**64 - 1]  # an answer's uint64


def test_decode_counts_tensors_and_values_before_building():
    one = {"datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}
    assert len(decode_json_value([one] * 3, limits=WireLimits(max_tensors=3))) == 3
    with pytest.raises(WireError, match="more than 2 tensors") as refused:
        decode_json_value({"x": [one, {"y": [one, one]}]}, "kwargs", WireLimits(max_tensors=2))
    assert not refused.value.unparsed
    with pytest.raises(WireError, match="more than 20 values"):
        decode_json_value([[0] * 10, [[]] * 10], limits=WireLimits(max_json_values=20))
    with pytest.raises(WireError, match="nests deeper than 3 levels"):
        decode_json_value([[[[[1]]]]], limits=WireLimits(max_depth=3))


def test_json_answer_size_counts_elements_without_encoding():
    output = [{"w": np.zeros((3, 4)), "n": 5}, (np.ones(2), "text")]
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
                         ("11", "does not fit a body of 10 bytes"), ("9" * 40, "not a non-negative integer"),
                         (-1, "does not fit"), (True, "must be an integer"), (2.0, "must be an integer")]:
        with pytest.raises(WireError, match=message):
            parse_header_length(bad, 10)
    header = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"parameters":{"binary_data_size":4}}]}'
    _, tensors = parse_infer_request(header + b"\0\0\x80?", str(len(header)))
    assert np.asarray(tensors["x"]).tolist() == [1.0]


# -- one budget per safetensors body -------------------------------------------------------

LIMITS = WireLimits(max_json_values=1000)


def document(values: int) -> str:
    """A DataProto document holding about ``values`` JSON values (its meta_info list)."""
    return json.dumps({"rows": 0, "batch": [], "non_tensor_batch": {}, "meta_info": {"v": [0] * values}})


def test_documents_each_under_the_limit_are_refused_together():
    each = document(900)
    assert value_bound(each.encode()) < LIMITS.max_json_values  # one alone fits
    assert len(decode_call_body(encode_safetensors({}, {"d0": each}), LIMITS)["d0"]) == 0
    body = encode_safetensors({}, {f"d{i}": each for i in range(8)})
    with pytest.raises(WireError) as refused:
        decode_call_body(body, LIMITS)
    # refused at the second document (in the header's order), counted after the header and the
    # first document only, before any was parsed
    header = value_bound(json.dumps({"__metadata__": {f"d{i}": "" for i in range(8)}}).encode())
    spent = header + value_bound(each.encode())
    assert re.match(
        rf"batch 'd[0-7]' takes the body past 1000 JSON values \(limits.max_json_values counts every "
        rf"document of a body; {spent} came before it\)", str(refused.value)
    )
    with pytest.raises(WireError, match="takes the body past 1000 JSON values"):
        decode_output_body(encode_safetensors({"output.x": np.zeros(1)}, {"output.d0": each, "output.d1": each}),
                           limits=LIMITS)


def test_a_bad_name_is_refused_before_any_document_is_parsed():
    not_json = "{" * 10  # parsing it would be the error, were names not checked first
    for names, message in [
        ({"bad name": not_json}, "batch argument 'bad name' is not a valid argument name"),
        ({"x": not_json, "x.0": not_json}, "'x.0' is both a tensor and a batch"),
        ({"xs": not_json}, "argument 'xs' is given both as a batch and as tensors"),
    ]:
        body = encode_safetensors({"x.0": np.zeros(1), "xs.0": np.zeros(1)}, names)
        with pytest.raises(WireError, match=message.replace(".", r"\.")):
            decode_call_body(body, LIMITS)
    with pytest.raises(WireError, match="neither an argument name"):
        decode_call_body(encode_safetensors({"bad-name": np.zeros(1)}, {"d": not_json}), LIMITS)
    with pytest.raises(WireError, match="not valid JSON"):  # the same document, once the names are good
        decode_call_body(encode_safetensors({}, {"d": not_json}), LIMITS)


def test_the_number_of_batches_is_bounded():
    tiny = document(0)
    assert len(decode_call_body(encode_safetensors({}, {f"d{i}": tiny for i in range(5)}), WireLimits(max_tensors=5))) == 5
    with pytest.raises(WireError, match="holds 6 batches, over limits.max_tensors"):
        decode_call_body(encode_safetensors({}, {f"d{i}": tiny for i in range(6)}), WireLimits(max_tensors=5))


def test_a_budget_spends_across_documents_and_refuses_without_spending():
    budget = JsonBudget(WireLimits(max_json_values=10))
    assert loads_strict("[1,2,3]", "first", budget=budget) == [1, 2, 3] and budget.spent == 4
    with pytest.raises(WireError, match="second takes the body past 10 JSON values .* 4 came before it"):
        loads_strict("[1,2,3,4,5,6]", "second", budget=budget)
    assert budget.spent == 4  # a refused document spends nothing
    assert loads_strict('{"a": [1, 2], "b": "x,y,z"}', "third", budget=budget) == {"a": [1, 2], "b": "x,y,z"}
    assert budget.spent == 9
    with pytest.raises(WireError, match="body holds more than 3 JSON values"):  # alone: the plain message
        loads_strict("[1,2,3,4]", limits=WireLimits(max_json_values=3))

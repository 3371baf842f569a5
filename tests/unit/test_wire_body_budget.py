"""One JSON value budget per body: a safetensors header and every DataProto document in its
metadata spend from the same ``limits.max_json_values``, counted on the bytes before any
document is parsed; a call's names are checked before that."""

from __future__ import annotations

import json
import re

import pytest
import torch

from hybridflow.wire.errors import WireError
from hybridflow.wire.limits import WireLimits
from hybridflow.wire.safetensors_call import decode_call_body, decode_output_body, encode_safetensors
from hybridflow.wire.strict_json import JsonBudget, loads_strict, value_bound

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
        decode_output_body(encode_safetensors({"output.x": torch.zeros(1)}, {"output.d0": each, "output.d1": each}),
                           limits=LIMITS)


def test_a_bad_name_is_refused_before_any_document_is_parsed():
    not_json = "{" * 10  # parsing it would be the error, were names not checked first
    for names, message in [
        ({"bad name": not_json}, "batch argument 'bad name' is not a valid argument name"),
        ({"x": not_json, "x.0": not_json}, "'x.0' is both a tensor and a batch"),
        ({"xs": not_json}, "argument 'xs' is given both as a batch and as tensors"),
    ]:
        body = encode_safetensors({"x.0": torch.zeros(1), "xs.0": torch.zeros(1)}, names)
        with pytest.raises(WireError, match=message.replace(".", r"\.")):
            decode_call_body(body, LIMITS)
    tensors = {"bad-name": torch.zeros(1)}
    with pytest.raises(WireError, match="neither an argument name"):
        decode_call_body(encode_safetensors(tensors, {"d": not_json}), LIMITS)
    with pytest.raises(WireError, match="not valid JSON"):  # the same document, once the names are good
        decode_call_body(encode_safetensors({}, {"d": not_json}), LIMITS)


def test_the_number_of_dataprotos_is_bounded():
    tiny = document(0)
    body = encode_safetensors({}, {f"d{i}": tiny for i in range(5)})
    assert len(decode_call_body(body, WireLimits(max_tensors=5))) == 5
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
    # alone, the first document over the limit keeps the plain message
    with pytest.raises(WireError, match="body holds more than 3 JSON values"):
        loads_strict("[1,2,3,4]", limits=WireLimits(max_json_values=3))

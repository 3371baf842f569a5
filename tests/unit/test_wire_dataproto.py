"""verl's DataProto on the wire (wire.dataproto): through safetensors call bodies and
answers, and through JSON, both ways, never pickled; bad documents are WireErrors."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from hybridflow.wire.errors import WireError
from hybridflow.wire.json_tensors import decode_json_value, encode_json_value
from hybridflow.wire.safetensors_call import (
    decode_call_body,
    decode_output_body,
    encode_call_body,
    encode_output_body,
)
from hybridflow.wire.strict_json import loads_strict
from single_controller.protocol import DataProto


def sample(rows: int = 4) -> DataProto:
    labels = np.empty(rows, dtype=object)
    for i in range(rows):
        labels[i] = ["tok", i] if i % 2 else f"row {i}"
    return DataProto.from_dict(
        tensors={"x": torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3),
                 "ids": torch.arange(rows, dtype=torch.int64), "mask": torch.ones(rows, 2, dtype=torch.bool)},
        non_tensors={"label": labels, "score": np.linspace(0, 1, rows), "uid": np.array([f"u{i}" for i in range(rows)])},
        meta_info={"temperature": 0.7, "stage": "rollout", "steps": [1, 2], "nested": {"ok": True, "none": None}},
    )


def assert_same(a: DataProto, b: DataProto) -> None:
    assert len(a) == len(b)
    assert (a.batch is None) == (b.batch is None)
    for key in [] if a.batch is None else a.batch.keys():
        assert a.batch[key].dtype == b.batch[key].dtype and torch.equal(a.batch[key], b.batch[key])
    if a.batch is not None:
        assert sorted(a.batch.keys()) == sorted(b.batch.keys())
    assert sorted(a.non_tensor_batch) == sorted(b.non_tensor_batch)
    for key, value in a.non_tensor_batch.items():
        assert value.shape == b.non_tensor_batch[key].shape
        assert value.tolist() == b.non_tensor_batch[key].tolist()
    assert a.meta_info == b.meta_info


def test_a_call_body_carries_dataproto_arguments_beside_tensors():
    data = sample()
    kwargs = decode_call_body(encode_call_body({"data": data, "x": torch.ones(2), "xs": [1, 2]}))
    assert_same(kwargs["data"], data)
    assert torch.equal(kwargs["x"], torch.ones(2)) and [t.item() for t in kwargs["xs"]] == [1, 2]
    assert kwargs["data"].non_tensor_batch["label"].dtype == object
    assert kwargs["data"].non_tensor_batch["score"].dtype == np.float64


def test_answers_carry_dataprotos_anywhere_in_the_output():
    data = sample(6)
    assert_same(decode_output_body(encode_output_body(data)), data)
    both = decode_output_body(encode_output_body([data, {"extra": data[:2]}]))
    assert_same(both[0], data) and assert_same(both[1]["extra"], data[:2]) is None


def test_a_dataproto_of_non_tensors_only():
    data = DataProto.from_dict(non_tensors={"text": ["a", "b"]}, meta_info={"k": 1})
    assert_same(decode_call_body(encode_call_body({"data": data}))["data"], data)


def test_json_bodies_and_answers():
    data = sample()
    text = json.dumps(encode_json_value({"data": data, "n": 3}))
    decoded = decode_json_value(loads_strict(text))
    assert_same(decoded["data"], data) and decoded["n"] == 3


def test_values_json_cannot_hold_are_refused_when_sending():
    bad = sample()
    bad.meta_info["when"] = {1, 2}
    with pytest.raises(WireError, match="meta_info.when is a set"):
        encode_call_body({"data": bad})
    strange = DataProto.from_dict(non_tensors={"z": np.array([1 + 2j, 3j])})
    with pytest.raises(WireError, match="complex128 has no JSON form"):
        encode_output_body(strange)


def doctored(metadata: dict, tensors: dict | None = None) -> bytes:
    """A safetensors call body with this metadata and these (zero-size-free) tensors."""
    from safetensors.torch import save

    return save(tensors or {}, metadata={k: json.dumps(v) for k, v in metadata.items()})


DOC = {"rows": 2, "batch": ["x"], "non_tensor_batch": {}, "meta_info": {}}
HOSTILE = [
    ("tensors of no DataProto", doctored({}, {"data@x": torch.zeros(2)}), "belong to no batch"),
    ("rows that do not match", doctored({"data": DOC}, {"data@x": torch.zeros(3)}), "has not 2 rows"),
    ("a tensor the document does not name", doctored({"data": {**DOC, "batch": []}}, {"data@x": torch.zeros(2)}),
     "batch names"),
    ("data shorter than its shape", doctored({"data": {**DOC, "batch": [], "non_tensor_batch": {
        "t": {"dtype": "object", "shape": [2], "data": ["a"]}}}}), "data has 1 values but shape [2] needs 2"),
    ("a shape claiming billions", doctored({"data": {**DOC, "batch": [], "non_tensor_batch": {
        "t": {"dtype": "object", "shape": [2, 10**9, 10**9], "data": []}}}}), "limits.max_json_values"),
    ("a dtype that is no array type", doctored({"data": {**DOC, "batch": [], "non_tensor_batch": {
        "t": {"dtype": "V8", "shape": [2], "data": [1, 2]}}}}), "numeric or 'object'"),
    ("a document with other keys", doctored({"data": {"rows": 0, "pickle": "gASV"}}), "exactly"),
    ("metadata that is not a JSON document", struct.pack("<Q", 2) + b"[]", "not a JSON object"),
]


@pytest.mark.parametrize("body, message", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_dataproto_bodies_are_wire_errors(body, message):
    with pytest.raises(WireError, match=message.replace("[", r"\[").replace("]", r"\]")):
        decode_call_body(body)

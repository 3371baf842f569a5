"""verl's DataProto on the wire (hybridflow_client.wire.dataproto), as the client builds
it (WireDataProto): through safetensors call bodies and answers and through JSON, both
ways, never pickled; bad documents are WireErrors, checked before anything is built."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import safetensors.numpy

from hybridflow_client.wire.dataproto import JSON_MARKER, WireDataProto, dataproto_class
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.json_values import decode_json_value, encode_json_value
from hybridflow_client.wire.safetensors_call import (
    decode_call_body,
    decode_output_body,
    encode_call_body,
    encode_output_body,
)
from hybridflow_client.wire.strict_json import dumps_compact, loads_strict


def sample(rows: int = 4) -> WireDataProto:
    labels = np.empty(rows, dtype=object)
    for i in range(rows):
        labels[i] = ["tok", i] if i % 2 else f"row {i}"
    return WireDataProto.from_dict(
        tensors={"x": np.arange(rows * 3, dtype=np.float32).reshape(rows, 3), "ids": np.arange(rows, dtype=np.int64),
                 "mask": np.ones((rows, 2), dtype=np.bool_)},
        non_tensors={"label": labels, "score": np.linspace(0, 1, rows), "uid": np.array([f"u{i}" for i in range(rows)])},
        meta_info={"temperature": 0.7, "stage": "rollout", "steps": [1, 2], "nested": {"ok": True, "none": None}},
    )


def assert_same(a: WireDataProto, b: WireDataProto) -> None:
    assert isinstance(b, WireDataProto) and len(a) == len(b)
    assert sorted(a.batch) == sorted(b.batch)
    for key, value in a.batch.items():
        assert b.batch[key].dtype == value.dtype and np.array_equal(b.batch[key], value), key
    assert sorted(a.non_tensor_batch) == sorted(b.non_tensor_batch)
    for key, value in a.non_tensor_batch.items():
        assert value.shape == b.non_tensor_batch[key].shape and value.tolist() == b.non_tensor_batch[key].tolist()
    assert a.meta_info == b.meta_info


def test_a_call_body_carries_dataproto_arguments_beside_tensors(numpy_only):
    data = sample()
    kwargs = decode_call_body(encode_call_body({"data": data, "x": np.ones(2), "xs": [1, 2]}))
    assert_same(data, kwargs["data"])
    assert kwargs["x"].tolist() == [1.0, 1.0] and [int(t) for t in kwargs["xs"]] == [1, 2]
    assert kwargs["data"].non_tensor_batch["label"].dtype == object
    assert kwargs["data"].non_tensor_batch["score"].dtype == np.float64
    assert kwargs["data"].non_tensor_batch["uid"].dtype == object  # strings travel as JSON values


def test_answers_carry_dataprotos_anywhere_in_the_output(numpy_only):
    data = sample(6)
    assert_same(data, decode_output_body(encode_output_body(data)))
    both = decode_output_body(encode_output_body([data, {"extra": data}]))
    assert_same(data, both[0])
    assert_same(data, both[1]["extra"])


def test_a_dataproto_of_non_tensors_only(numpy_only):
    data = WireDataProto.from_dict(non_tensors={"text": ["a", "b"]}, meta_info={"k": 1})
    assert_same(data, decode_call_body(encode_call_body({"data": data}))["data"])


def test_json_bodies_and_answers(numpy_only):
    data = sample()
    text = dumps_compact(encode_json_value({"data": data, "n": 3}))
    assert json.loads(text)["data"][JSON_MARKER]["rows"] == 4
    decoded = decode_json_value(loads_strict(text))
    assert_same(data, decoded["data"]) and decoded["n"] == 3


def test_an_answer_is_built_with_the_class_at_hand():
    assert dataproto_class() is WireDataProto

    class DataProto(WireDataProto):  # a user's class of the name
        pass

    assert dataproto_class(DataProto) is DataProto


def test_values_json_cannot_hold_are_refused_when_sending():
    bad = sample()
    bad.meta_info["when"] = {1, 2}
    with pytest.raises(WireError, match="meta_info.when is a set"):
        encode_call_body({"data": bad})
    strange = WireDataProto.from_dict(non_tensors={"z": np.array([1 + 2j, 3j])})
    with pytest.raises(WireError, match="complex128 has no JSON form"):
        encode_output_body(strange)
    infinite = WireDataProto.from_dict(non_tensors={"z": np.array([1.0, float("inf")], dtype=object)})
    with pytest.raises(WireError, match="inf has no JSON form"):
        encode_output_body(infinite)


def doctored(metadata: dict, tensors: dict | None = None) -> bytes:
    """A safetensors call body with this metadata and these tensors."""
    return safetensors.numpy.save(tensors or {}, metadata={k: json.dumps(v) for k, v in metadata.items()})


DOC = {"rows": 2, "batch": ["x"], "non_tensor_batch": {}, "meta_info": {}}
HOSTILE = [
    ("tensors of no DataProto", doctored({}, {"data@x": np.zeros(2)}), "belong to no batch"),
    ("rows that do not match", doctored({"data": DOC}, {"data@x": np.zeros(3)}), "has not 2 rows"),
    ("a tensor the document does not name", doctored({"data": {**DOC, "batch": []}}, {"data@x": np.zeros(2)}),
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

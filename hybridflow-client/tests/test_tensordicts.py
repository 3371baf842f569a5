"""TensorDict batches in the client (where torch and tensordict are installed): the JSON
and safetensors forms it sends, written out literally, and the answers it reads back,
jagged tensors included; documents that do not fit are CodecErrors."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
tensordict = pytest.importorskip("tensordict")

from hybridflow_client import CodecError  # noqa: E402
from hybridflow_client.wire.json_values import decode_json_value, encode_json_value  # noqa: E402
from hybridflow_client.wire.safetensors_body import read_safetensors  # noqa: E402
from hybridflow_client.wire.safetensors_call import decode_output_body, encode_call_body  # noqa: E402

ROWS = [[1, 2, 3], [4], [5, 6]]


def sample() -> tensordict.TensorDict:
    ids = torch.nested.as_nested_tensor([torch.tensor(row) for row in ROWS], layout=torch.jagged)
    turns = tensordict.NonTensorStack.from_list([tensordict.NonTensorData(t) for t in ["a", ["b"], None]])
    return tensordict.TensorDict({"ids": ids, "x": torch.tensor([0.5, 1.0, -2.0]), "turns": turns,
                                  "temperature": tensordict.NonTensorData(0.7)}, batch_size=[3])


def assert_same(back: tensordict.TensorDict) -> None:
    assert back.batch_size == torch.Size([3])
    assert [row.tolist() for row in back.get("ids").unbind(0)] == ROWS
    assert back.get("x").tolist() == [0.5, 1.0, -2.0]
    assert back.get("turns").tolist() == ["a", ["b"], None] and back.get("temperature").data == 0.7


def test_the_json_form_is_the_documented_one_and_reads_back(mode):
    encoded = encode_json_value({"data": sample()})["data"]
    assert encoded == {"__tensordict__": {
        "batch_size": [3],
        "tensors": {"ids": {"values": {"datatype": "INT64", "shape": [6], "data": [1, 2, 3, 4, 5, 6]},
                            "offsets": {"datatype": "INT64", "shape": [4], "data": [0, 3, 4, 6]},
                            "ragged_dim": 1},
                    "x": {"datatype": "FP32", "shape": [3], "data": [0.5, 1.0, -2.0]}},
        "objects": {"turns": ["a", ["b"], None]},
        "metadata": {"temperature": 0.7}}}
    assert_same(decode_json_value(json.loads(json.dumps(encoded))))


def test_the_safetensors_form_names_its_tensors_in_the_metadata(mode):
    body = encode_call_body({"output": sample()})
    named, metadata = read_safetensors(body)
    assert sorted(named) == ["output@ids.offsets", "output@ids.values", "output@x"]
    document = json.loads(metadata["output"])["__tensordict__"]
    assert document["tensors"]["ids"] == {"values": "ids.values", "offsets": "ids.offsets", "ragged_dim": 1}
    assert_same(decode_output_body(body))  # an answer is read from the same form


def test_offsets_that_do_not_fit_are_codec_errors():
    entry = {"values": {"datatype": "INT64", "shape": [3], "data": [1, 2, 3]}, "ragged_dim": 1}
    for offsets in ([0, 2, 1], [0, 1, 4], [1, 2, 3], [0, 3]):
        bad = {"__tensordict__": {"batch_size": [2], "tensors": {"ids": {
            **entry, "offsets": {"datatype": "INT64", "shape": [len(offsets)], "data": offsets}}}}}
        with pytest.raises(CodecError, match="offsets"):
            decode_json_value(bad)

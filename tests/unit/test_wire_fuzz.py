"""Fuzzing the server's decoding of DataProto documents and safetensors headers and
metadata with hypothesis (the shared codecs with the server's builder, which makes the
library's DataProto): whatever the bytes, a decoder returns or raises WireError, and the
HTTP layer's body parsing answers a 4xx, never anything else. Bounded to a few seconds.
The shared codecs' own fuzzing, with the client's builder, is the client's
tests/test_wire_fuzz.py."""

from __future__ import annotations

import json
import sys
from functools import cache

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hybridflow.http.call_body import parse_call_body
from hybridflow.http.errors import ApiError
from hybridflow.wire.torch_builder import TORCH_BUILDER
from hybridflow_client.wire.dataproto import JSON_MARKER
from hybridflow_client.wire.dataproto import build_dataproto as shared_build_dataproto
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.formats import JSON as JSON_TYPE
from hybridflow_client.wire.formats import SAFETENSORS
from hybridflow_client.wire.limits import DEFAULT_LIMITS, WireLimits
from hybridflow_client.wire.safetensors_body import encode_safetensors
from tests.unit.test_client_install import CLIENT

# The fuzz strategies are the client's tests' own (a client-only checkout runs them too).
sys.path.insert(0, str(CLIENT / "tests"))
import wire_strategies  # noqa: E402
from wire_strategies import FUZZ, LIMITS, NAMES, SAFETENSORS_BODIES  # noqa: E402


@cache  # a strategy made once is validated once
def tensor_of(rows: int) -> st.SearchStrategy[torch.Tensor]:
    return st.builds(
        lambda cols, dtype: torch.zeros((rows, cols) if cols else (rows,), dtype=dtype),
        st.integers(0, 2), st.sampled_from([torch.float32, torch.int64, torch.bool]),
    )


def dataproto_cases() -> st.SearchStrategy[tuple[object, dict[str, torch.Tensor]]]:
    return wire_strategies.dataproto_cases(tensor_of)


TENSORS = tensor_of(2)


def build_dataproto(document: object, tensors: dict, where: str, limits: WireLimits = DEFAULT_LIMITS) -> object:
    return shared_build_dataproto(document, tensors, where, limits, TORCH_BUILDER)


def survives(decode, *args) -> None:
    try:
        decode(*args)
    except WireError:
        pass


def answers_4xx(kind: str, body: bytes | bytearray) -> None:
    """The server's body parsing of ``body``: arguments, or a 4xx (400 or 422)."""
    try:
        parse_call_body(kind, body, LIMITS)
    except ApiError as refused:
        assert refused.status in (400, 422), refused


@FUZZ
@given(case=dataproto_cases())
def test_a_dataproto_document_decodes_or_is_a_wire_error(case):
    document, tensors = case
    survives(build_dataproto, document, tensors, "data", LIMITS)
    json_tensors = {name: {"datatype": "INT64", "shape": [len(t)], "data": [0] * len(t)} for name, t in tensors.items()}
    if isinstance(document, dict) and isinstance(document.get("batch"), list):
        document = {**document, "batch": json_tensors}
    answers_4xx(JSON_TYPE, json.dumps({"kwargs": {"data": {JSON_MARKER: document}}}).encode())


@FUZZ
@given(cases=st.dictionaries(NAMES, dataproto_cases(), max_size=3), plain=st.dictionaries(NAMES, TENSORS, max_size=2))
def test_safetensors_metadata_decodes_or_is_a_wire_error(cases, plain):
    metadata = {path: json.dumps(document) for path, (document, _) in cases.items()}
    named = {f"{path}@{key}": tensor for path, (_, tensors) in cases.items() for key, tensor in tensors.items()}
    body = encode_safetensors({**plain, **named}, metadata)
    answers_4xx(SAFETENSORS, bytearray(body))


@FUZZ
@given(body=SAFETENSORS_BODIES)
def test_a_safetensors_header_decodes_or_is_a_wire_error(body):
    answers_4xx(SAFETENSORS, bytearray(body))


@pytest.mark.parametrize("dtype", ["(2147483647,)f4", "06E", "6:", "f4,i4", "M8", ["a"], {"names": []}, 4])
def test_dtypes_numpy_refuses_or_makes_into_no_number_are_wire_errors(dtype):
    array = {"dtype": dtype, "shape": [1], "data": [1]}
    with pytest.raises(WireError, match="must be numeric or 'object'"):
        build_dataproto({"rows": 1, "batch": [], "non_tensor_batch": {"a": array}, "meta_info": {}}, {}, "data")

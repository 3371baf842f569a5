"""Fuzzing the decoders of DataProto documents and safetensors headers and metadata with
hypothesis: whatever the bytes, a decoder returns or raises WireError (which a server
answers with a 4xx JSON error), never anything else. Bounded to a few seconds; numpy only."""

from __future__ import annotations

import json
from functools import cache

import numpy as np
import pytest
import wire_strategies
from hypothesis import given
from hypothesis import strategies as st
from wire_strategies import FUZZ, LIMITS, NAMES, SAFETENSORS_BODIES

from hybridflow_client.wire.builders import CLIENT_BUILDER
from hybridflow_client.wire.dataproto import JSON_MARKER, build_dataproto
from hybridflow_client.wire.datatypes import WireTensor
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.json_values import decode_json_value
from hybridflow_client.wire.safetensors_body import encode_safetensors
from hybridflow_client.wire.safetensors_call import decode_call_body, decode_output_body

DATATYPES = {"FP32": np.float32, "INT64": np.int64, "BOOL": np.bool_}


@cache  # a strategy made once is validated once
def tensor_of(rows: int) -> st.SearchStrategy[WireTensor]:
    return st.builds(
        lambda cols, datatype: WireTensor(datatype, np.zeros((rows, cols) if cols else (rows,), DATATYPES[datatype])),
        st.integers(0, 2), st.sampled_from(list(DATATYPES)),
    )


def dataproto_cases() -> st.SearchStrategy[tuple[object, dict[str, WireTensor]]]:
    return wire_strategies.dataproto_cases(tensor_of)


def survives(decode, *args, **kwargs) -> None:
    try:
        decode(*args, **kwargs)
    except WireError:
        pass


@FUZZ
@given(case=dataproto_cases())
def test_a_dataproto_document_decodes_or_is_a_wire_error(case):
    document, tensors = case
    survives(build_dataproto, document, tensors, "data", LIMITS, CLIENT_BUILDER)
    json_tensors = {name: {"datatype": "INT64", "shape": t.shape[:1], "data": [0] * t.shape[0]}
                    for name, t in tensors.items()}
    if isinstance(document, dict) and isinstance(document.get("batch"), list):
        document = {**document, "batch": json_tensors}
    survives(decode_json_value, {"data": {JSON_MARKER: document}}, "body", LIMITS)


@FUZZ
@given(cases=st.dictionaries(NAMES, dataproto_cases(), max_size=3), plain=st.dictionaries(NAMES, tensor_of(2), max_size=2))
def test_safetensors_metadata_decodes_or_is_a_wire_error(cases, plain):
    metadata = {path: json.dumps(document) for path, (document, _) in cases.items()}
    named = {f"{path}@{key}": tensor for path, (_, tensors) in cases.items() for key, tensor in tensors.items()}
    body = encode_safetensors({**plain, **named}, metadata)
    survives(decode_call_body, bytearray(body), LIMITS)
    survives(decode_output_body, body, "output", LIMITS)


@FUZZ
@given(body=SAFETENSORS_BODIES)
def test_a_safetensors_header_decodes_or_is_a_wire_error(body):
    survives(decode_call_body, bytearray(body), LIMITS)
    survives(decode_output_body, body, "output", LIMITS)


@pytest.mark.parametrize("dtype", ["(2147483647,)f4", "06E", "6:", "f4,i4", "M8", ["a"], {"names": []}, 4])
def test_dtypes_numpy_refuses_or_makes_into_no_number_are_wire_errors(dtype):
    array = {"dtype": dtype, "shape": [1], "data": [1]}
    with pytest.raises(WireError, match="must be numeric or 'object'"):
        build_dataproto({"rows": 1, "batch": [], "non_tensor_batch": {"a": array}, "meta_info": {}}, {}, "data",
                        LIMITS, CLIENT_BUILDER)

"""Fuzzing the decoders of DataProto documents and safetensors headers and metadata with
hypothesis: whatever the bytes, a decoder returns or raises WireError (which a server
answers with a 4xx JSON error), never anything else. Bounded to a few seconds; numpy only."""

from __future__ import annotations

import json
import struct
from functools import cache

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridflow_client.wire.builders import CLIENT_BUILDER
from hybridflow_client.wire.dataproto import JSON_MARKER, build_dataproto
from hybridflow_client.wire.datatypes import WireTensor
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.json_values import decode_json_value
from hybridflow_client.wire.limits import WireLimits
from hybridflow_client.wire.safetensors_body import encode_safetensors
from hybridflow_client.wire.safetensors_call import decode_call_body, decode_output_body

FUZZ = settings(
    max_examples=100, deadline=None, database=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
#: Small limits, so that the bounds are reached too.
LIMITS = WireLimits(max_tensors=8, max_json_values=200, max_tensor_elements=64, max_ndim=4, max_depth=6)

NAMES = st.sampled_from(["x", "y", "data", "data@x", "x.0", "x.1", "bad name", "", "@", "output", "output.0"])
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 63) - 1), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
JSON = st.recursive(
    SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=4)),
    max_leaves=12,
)
#: What a document may name: dtypes it may use, and strings numpy parses into anything
#: else or refuses with errors of its own (ValueError, SyntaxError).
DTYPES = st.one_of(
    st.sampled_from(["object", "<f4", "<f8", "|b1", "<i8", "|u1", ">i2", "f16"]),
    st.sampled_from([
        "float32", "(2147483647,)f4", "(2,)f4", "V8", "M8", "f4,i4", "S3", "U1", "O", "c8", "06E", "6:", "i4 ",
    ]),
    JSON,
)
ROWS = st.integers(0, 3)
BATCH_NAMES = st.lists(NAMES, unique=True, max_size=2)
EXTRA_DIMS = st.lists(st.integers(0, 2), max_size=2)
ONE_IN_EIGHT = st.sampled_from([True] + [False] * 7)
BROKEN_ARRAY = st.sampled_from([None, None, None, "shape", "data"])
JUNK_SHAPES = st.one_of(st.lists(st.integers(-1, 2**31), max_size=3), JSON)
ITEMS = st.one_of(st.integers(-300, 300), st.floats(-1e40, 1e40), st.booleans(), JSON)
DATATYPES = {"FP32": np.float32, "INT64": np.int64, "BOOL": np.bool_}


@cache  # a strategy made once is validated once
def tensor_of(rows: int) -> st.SearchStrategy[WireTensor]:
    return st.builds(
        lambda cols, datatype: WireTensor(datatype, np.zeros((rows, cols) if cols else (rows,), DATATYPES[datatype])),
        st.integers(0, 2), st.sampled_from(list(DATATYPES)),
    )


@cache
def items(count: int) -> st.SearchStrategy[list]:
    return st.lists(ITEMS, min_size=count, max_size=count)


@cache
def arrays_of(rows: int) -> st.SearchStrategy[dict]:
    return st.dictionaries(NAMES, array_documents(rows), min_size=1, max_size=2)


@st.composite
def array_documents(draw: st.DrawFn, rows: int) -> dict:
    """Mostly an array that fits ``rows``, with a dtype, shape or data that may not."""
    shape = [rows] + draw(EXTRA_DIMS)
    document = {"dtype": draw(DTYPES), "shape": shape, "data": draw(items(int(np.prod(shape))))}
    broken = draw(BROKEN_ARRAY)
    if broken:
        document[broken] = draw(JUNK_SHAPES)
    return document


ROWS_OF_TENSOR = st.sampled_from([0, 0, 0, 1])
META_INFO = st.dictionaries(st.text(max_size=3), JSON, max_size=3)
BROKEN = st.sampled_from([None] * 6 + ["rows", "batch", "non_tensor_batch", "meta_info", "pickle"])
JUNK_DOCUMENTS = st.one_of(
    st.dictionaries(st.sampled_from(["rows", "batch", "non_tensor_batch", "meta_info", "pickle"]), JSON), JSON
)


@st.composite
def dataproto_cases(draw: st.DrawFn) -> tuple[object, dict[str, WireTensor]]:
    """A document and its tensors: mostly consistent, then one part replaced by junk."""
    rows = draw(ROWS)
    names = draw(BATCH_NAMES)
    tensors = {name: draw(tensor_of(draw(ROWS_OF_TENSOR) + rows)) for name in names}
    document: dict = {"rows": rows, "batch": names, "non_tensor_batch": draw(arrays_of(rows)),
                      "meta_info": draw(META_INFO)}
    broken = draw(BROKEN)
    if broken:
        document[broken] = draw(JSON)
    return (draw(JUNK_DOCUMENTS) if draw(ONE_IN_EIGHT) else document), tensors


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


ENTRIES = st.fixed_dictionaries({
    "dtype": st.one_of(st.sampled_from(["F32", "I64", "BOOL", "BF16", "U16", "F8_E4M3"]), JSON),
    "shape": st.one_of(st.lists(st.integers(-1, 3), max_size=3), JSON),
    "data_offsets": st.one_of(st.lists(st.integers(-1, 40), min_size=2, max_size=2), JSON),
})


@FUZZ
@given(
    header=st.one_of(
        st.dictionaries(st.one_of(NAMES, st.just("__metadata__")), st.one_of(ENTRIES, JSON), max_size=4), JSON
    ),
    data=st.binary(max_size=40),
    claimed=st.one_of(st.none(), st.integers(0, (1 << 64) - 1)),
)
def test_a_safetensors_header_decodes_or_is_a_wire_error(header, data, claimed):
    text = json.dumps(header).encode()
    body = struct.pack("<Q", len(text) if claimed is None else claimed) + text + data
    survives(decode_call_body, bytearray(body), LIMITS)
    survives(decode_output_body, body, "output", LIMITS)


@pytest.mark.parametrize("dtype", ["(2147483647,)f4", "06E", "6:", "f4,i4", "M8", ["a"], {"names": []}, 4])
def test_dtypes_numpy_refuses_or_makes_into_no_number_are_wire_errors(dtype):
    array = {"dtype": dtype, "shape": [1], "data": [1]}
    with pytest.raises(WireError, match="must be numeric or 'object'"):
        build_dataproto({"rows": 1, "batch": [], "non_tensor_batch": {"a": array}, "meta_info": {}}, {}, "data",
                        LIMITS, CLIENT_BUILDER)

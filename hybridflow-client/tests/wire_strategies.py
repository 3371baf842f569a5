"""What the fuzz tests of the wire draw their bytes from (hypothesis strategies): DataProto
documents, mostly consistent and then broken in one part, and junk JSON. Shared by the
client's fuzz tests (``tests/test_wire_fuzz.py``, numpy tensors) and the server's
(``tests/unit/test_wire_fuzz.py``, torch tensors): ``dataproto_cases`` takes what draws a
tensor of a number of rows."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from hybridflow_client.wire.limits import WireLimits

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
ROWS_OF_TENSOR = st.sampled_from([0, 0, 0, 1])
META_INFO = st.dictionaries(st.text(max_size=3), JSON, max_size=3)
BROKEN = st.sampled_from([None] * 6 + ["rows", "batch", "non_tensor_batch", "meta_info", "pickle"])
JUNK_DOCUMENTS = st.one_of(
    st.dictionaries(st.sampled_from(["rows", "batch", "non_tensor_batch", "meta_info", "pickle"]), JSON), JSON
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


@st.composite
def dataproto_cases(draw: st.DrawFn, tensor_of: Callable[[int], st.SearchStrategy[Any]]) -> tuple[object, dict]:
    """A document and its tensors (each drawn from ``tensor_of(rows)``): mostly
    consistent, then one part replaced by junk."""
    rows = draw(ROWS)
    names = draw(BATCH_NAMES)
    tensors = {name: draw(tensor_of(draw(ROWS_OF_TENSOR) + rows)) for name in names}
    document: dict = {"rows": rows, "batch": names, "non_tensor_batch": draw(arrays_of(rows)),
                      "meta_info": draw(META_INFO)}
    broken = draw(BROKEN)
    if broken:
        document[broken] = draw(JSON)
    return (draw(JUNK_DOCUMENTS) if draw(ONE_IN_EIGHT) else document), tensors


#: A safetensors header's entry, well-formed or not.
HEADER_ENTRIES = st.fixed_dictionaries({
    "dtype": st.one_of(st.sampled_from(["F32", "I64", "BOOL", "BF16", "U16", "F8_E4M3"]), JSON),
    "shape": st.one_of(st.lists(st.integers(-1, 3), max_size=3), JSON),
    "data_offsets": st.one_of(st.lists(st.integers(-1, 40), min_size=2, max_size=2), JSON),
})


def _safetensors_body(header: Any, data: bytes, claimed: int | None) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text) if claimed is None else claimed) + text + data


#: A safetensors body of any header (entries, metadata or any JSON), any data, and a
#: header length as written or any other.
SAFETENSORS_BODIES = st.builds(
    _safetensors_body,
    st.one_of(st.dictionaries(st.one_of(NAMES, st.just("__metadata__")), st.one_of(HEADER_ENTRIES, JSON), max_size=4),
              JSON),
    st.binary(max_size=40),
    st.one_of(st.none(), st.integers(0, (1 << 64) - 1)),
)

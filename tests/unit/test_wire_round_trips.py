"""Both sides of the wire, against each other, as property tests: what the client encodes
(``hybridflow_client.messages``, the shared codecs with the client's table of formats) the
server decodes (``hybridflow.http.call_body`` and ``hybridflow.http.oip``, the same codecs
with the server's table and builder) into the same values, and what the server answers
the client reads back as the same values: for every format (JSON and safetensors calls and
answers, OIP JSON and binary), every datatype, shapes from scalars and zero-size ones to
64 dimensions (the default ``max_ndim``), and every batch type (tensors, lists and dicts
of them, DataProto, TensorDict with dense, jagged and object columns). The client reads
in its numpy mode and its torch mode. No Ray, no server: the messages go straight from
one side's encoder to the other's decoder."""

from __future__ import annotations

from typing import Any
from unittest import mock

import httpx
import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack, TensorDict

from hybridflow.http import oip
from hybridflow.http.call_body import call_answer_body, parse_call_body
from hybridflow_client import messages
from hybridflow_client.wire import tensors
from hybridflow_client.wire.dataproto import WireDataProto, dataproto_class, is_dataproto
from hybridflow_client.wire.datatypes import DATATYPES, WireTensor, widen_bf16
from hybridflow_client.wire.limits import DEFAULT_LIMITS
from hybridflow_client.wire.oip_messages import HEADER_LENGTH
from hybridflow_client.wire.tensordicts import is_tensordict
from hybridflow_client.wire.tensors import to_wire
from single_controller import tensordict_utils as tu
from single_controller.protocol import DataProto

PROPERTY = settings(max_examples=40, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
LIMITS = DEFAULT_LIMITS
ENVELOPE = {"group": "g", "method": "m", "dispatch_mode": "ONE_TO_ALL", "execute_mode": "ALL", "world_size": 2}

# -- tensors ------------------------------------------------------------------------------


@st.composite
def shapes(draw: st.DrawFn, rows: int | None = None) -> list[int]:
    """Mostly up to 4 small dimensions (0 among them), sometimes up to ``max_ndim`` ones
    of which a few are 2 or 0; ``rows`` fixes the first."""
    if draw(st.integers(0, 5)) == 0:
        shape = [1] * draw(st.integers(8, LIMITS.max_ndim))
        for index in draw(st.lists(st.integers(0, len(shape) - 1), max_size=3)):
            shape[index] = draw(st.sampled_from([0, 2]))
    else:
        shape = draw(st.lists(st.integers(0, 3), max_size=4))
    return shape if rows is None else [rows, *shape[:3]]


def array_of(datatype: str, shape: list[int], seed: int) -> np.ndarray:
    """Random bits of ``datatype`` (NaNs, infinities, subnormals and extremes included);
    BF16 as its words."""
    rng = np.random.default_rng(seed)
    if datatype == "BOOL":
        return rng.integers(0, 2, shape).astype(np.bool_)
    dtype = DATATYPES[datatype]
    return rng.integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8).view(dtype).reshape(shape)


@st.composite
def tensors_of(draw: st.DrawFn, rows: int | None = None, datatype: str | None = None) -> Any:
    """A tensor as a client or a worker holds one: a numpy array, or a torch tensor (BF16
    always: numpy has no bfloat16)."""
    datatype = datatype or draw(st.sampled_from(list(DATATYPES)))
    array = array_of(datatype, draw(shapes(rows)), draw(st.integers(0, 2**32 - 1)))
    if datatype == "BF16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array) if draw(st.booleans()) else array


def assert_same_tensor(sent: Any, got: Any, numpy_mode: bool = False) -> None:
    """The same datatype, shape and values (every NaN as a NaN, every other value bit for
    bit); a client in numpy mode gets BF16 back as float32 of the same values."""
    assert isinstance(got, np.ndarray if numpy_mode else torch.Tensor), type(got)
    mine, theirs = to_wire(sent), to_wire(got)
    assert theirs.shape == mine.shape
    if numpy_mode and mine.datatype == "BF16":
        mine = WireTensor("FP32", widen_bf16(mine.array))
    assert theirs.datatype == mine.datatype
    if mine.array.dtype.kind != "f" and mine.datatype != "BF16":
        assert np.array_equal(mine.array, theirs.array)
        return
    values, other = mine.values(), theirs.values()
    nan = np.isnan(values)
    assert np.array_equal(nan, np.isnan(other))
    bits = np.dtype(f"u{values.dtype.itemsize}")
    assert np.array_equal(values[~nan].view(bits), other[~nan].view(bits))


# -- batches ------------------------------------------------------------------------------

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 63) - 1),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6))
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)), max_leaves=6)
NAMES = st.text("abcdefgh_", min_size=1, max_size=6)


@st.composite
def dataprotos(draw: st.DrawFn, server: bool) -> Any:
    """A DataProto: the library's (a worker's answer) or the client's WireDataProto."""
    rows = draw(st.integers(1, 4))
    batch = draw(st.dictionaries(NAMES, tensors_of(rows), max_size=3))
    if server:
        batch = {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(v) for k, v in batch.items()}
    objects = np.empty(rows, dtype=object)
    objects[:] = draw(st.lists(JSON_VALUES, min_size=rows, max_size=rows))
    numbers = np.array(draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=rows, max_size=rows)), np.float32)
    non_tensors = draw(st.sampled_from([{}, {"objects": objects}, {"objects": objects, "numbers": numbers}]))
    meta_info = draw(st.dictionaries(NAMES, JSON_VALUES, max_size=3))
    cls = DataProto if server else WireDataProto
    return cls.from_dict(tensors=batch or None, non_tensors=non_tensors, meta_info=meta_info)


@st.composite
def jagged_tensors(draw: st.DrawFn, rows: int) -> torch.Tensor:
    """Rows of different lengths: ``[rows, j]`` or ``[rows, 2, j]`` (ragged_dim 1 or 2)."""
    datatype = draw(st.sampled_from(list(DATATYPES)))
    inner = draw(st.sampled_from([[], [2]]))
    parts = []
    for _ in range(rows):
        part = to_wire_torch(array_of(datatype, [*inner, draw(st.integers(0, 3))], draw(st.integers(0, 2**32 - 1))),
                             datatype)
        parts.append(part)
    return torch.nested.as_nested_tensor(parts, layout=torch.jagged)


def to_wire_torch(array: np.ndarray, datatype: str) -> torch.Tensor:
    tensor = torch.from_numpy(array.view(np.int16) if datatype == "BF16" else array)
    return tensor.view(torch.bfloat16) if datatype == "BF16" else tensor


@st.composite
def tensordicts(draw: st.DrawFn, server: bool) -> TensorDict:
    """A TensorDict of dense, jagged and object columns and metadata, as a worker (the
    library's object column) or a client (tensordict's own) builds it."""
    rows = draw(st.integers(1, 4))
    source: dict[str, Any] = {}
    for name in draw(st.lists(NAMES, unique=True, max_size=4)):
        kind = draw(st.sampled_from(["dense", "jagged", "objects", "metadata"]))
        if kind == "dense":
            dense = draw(tensors_of(rows))
            source[name] = dense if isinstance(dense, torch.Tensor) else torch.from_numpy(dense)
        elif kind == "jagged":
            source[name] = draw(jagged_tensors(rows))
        elif kind == "objects":
            items = draw(st.lists(JSON_VALUES, min_size=rows, max_size=rows))
            source[name] = tu.object_column(items) if server else NonTensorStack.from_list(
                [NonTensorData(item) for item in items])
        else:
            source[name] = NonTensorData(draw(JSON_VALUES))
    return TensorDict(source, batch_size=[rows])


def assert_same(sent: Any, got: Any, numpy_mode: bool = False, server: bool = False) -> None:
    """``got`` is ``sent`` as the other side reads it: tensors, lists (tuples too) and
    dicts, DataProtos (the library's on the server) and TensorDicts, with the same values."""
    if is_dataproto(sent):
        # a client builds the DataProto of a module it finds imported: here the library's
        assert isinstance(got, DataProto if server else dataproto_class()), type(got)
        names = [] if sent.batch is None else list(sent.batch.keys())
        assert sorted(names) == sorted([] if got.batch is None else got.batch.keys())
        for name in names:  # the library's DataProto holds torch tensors in either mode
            assert_same_tensor(sent.batch[name], got.batch[name], numpy_mode and isinstance(got, WireDataProto))
        assert sorted(sent.non_tensor_batch) == sorted(got.non_tensor_batch)
        for key, array in sent.non_tensor_batch.items():
            assert got.non_tensor_batch[key].tolist() == array.tolist() and got.non_tensor_batch[key].shape == array.shape
        assert got.meta_info == sent.meta_info
    elif is_tensordict(sent):
        assert isinstance(got, TensorDict) and got.batch_size == sent.batch_size
        assert sorted(got.keys()) == sorted(sent.keys())  # the document lists tensors, objects, metadata in turn
        for key in sent.keys():
            mine, theirs = sent.get(key), got.get(key)
            if isinstance(mine, torch.Tensor) and mine.is_nested:
                assert theirs.is_nested and theirs._ragged_idx == mine._ragged_idx
                for row, other in zip(mine.unbind(0), theirs.unbind(0), strict=True):
                    assert_same_tensor(row, other)
            elif isinstance(mine, torch.Tensor):
                assert_same_tensor(mine, theirs)
            elif isinstance(mine, NonTensorStack):
                assert isinstance(theirs, tu.ObjectColumn if server else NonTensorStack)
                assert theirs.tolist() == mine.tolist()
            else:
                assert isinstance(theirs, NonTensorData) and theirs.data == mine.data
    elif isinstance(sent, (list, tuple)):
        assert isinstance(got, list) and len(got) == len(sent)
        for mine, theirs in zip(sent, got, strict=True):
            assert_same(mine, theirs, numpy_mode, server)
    elif isinstance(sent, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(sent)
        for key, mine in sent.items():
            assert_same(mine, got[key], numpy_mode, server)
    elif isinstance(sent, (np.ndarray, torch.Tensor)):
        assert_same_tensor(sent, got, numpy_mode)
    else:
        assert got == sent and type(got) is type(sent)


# -- the values of each format ------------------------------------------------------------


def values(server: bool, json: bool) -> st.SearchStrategy[Any]:
    """A value a call or an answer carries: a tensor, a batch, or (JSON: with plain values
    beside) lists and dicts of them, non-empty where safetensors needs them so."""
    leaves = st.one_of(tensors_of(), dataprotos(server), tensordicts(server), *([SCALARS] if json else []))
    return st.recursive(leaves, lambda inner: st.one_of(
        st.lists(inner, min_size=0 if json else 1, max_size=3),
        st.dictionaries(NAMES, inner, min_size=0 if json else 1, max_size=3)), max_leaves=4)


def safetensors_kwargs() -> st.SearchStrategy[dict[str, Any]]:
    """What a safetensors call carries: keyword tensors, non-empty lists of tensors, batches."""
    argument = st.one_of(tensors_of(), st.lists(tensors_of(), min_size=1, max_size=3), dataprotos(False),
                         tensordicts(False))
    return st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,5}", fullmatch=True), argument, max_size=3)


def answer_of(body: bytes, media_type: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.Response(200, content=body, headers={"content-type": media_type, **(headers or {})})


def client_mode(numpy_mode: bool) -> Any:
    """The client as it runs without torch (numpy in, numpy back), or as it is."""
    return mock.patch.object(tensors, "installed_torch", lambda: None) if numpy_mode else mock.patch.object(
        tensors, "installed_torch", tensors.installed_torch)


# -- calls: the client encodes, the server decodes ----------------------------------------


@PROPERTY
@given(args=st.lists(values(server=False, json=True), max_size=3),
       kwargs=st.dictionaries(NAMES, values(server=False, json=True), max_size=3))
def test_a_json_call_the_client_sends_is_what_the_server_decodes(args, kwargs):
    request = messages.call_request("/v1/groups/g/m", args, kwargs, binary=False, binary_output=False)
    got_args, got_kwargs = parse_call_body(request.headers["Content-Type"], bytearray(request.content), LIMITS)
    assert_same(args, got_args, server=True)
    assert_same(kwargs, got_kwargs, server=True)


@PROPERTY
@given(kwargs=safetensors_kwargs())
def test_a_safetensors_call_the_client_sends_is_what_the_server_decodes(kwargs):
    request = messages.call_request("/v1/groups/g/m", (), kwargs, binary=True, binary_output=True)
    assert request.headers["Content-Type"] == "application/x-safetensors"
    body = bytearray(request.content)
    got_args, got_kwargs = parse_call_body(request.headers["Content-Type"], body, LIMITS)
    assert got_args == []
    assert_same(kwargs, got_kwargs, server=True)
    start = np.frombuffer(body, dtype=np.uint8).ctypes.data  # the server's plain tensors are views of the body
    plain = [t for v in got_kwargs.values() for t in (v if isinstance(v, list) else [v]) if isinstance(t, torch.Tensor)]
    assert all(start <= t.data_ptr() < start + len(body) for t in plain if t.numel() and t.data_ptr() % t.element_size() == 0)


# -- answers: the server encodes, the client decodes --------------------------------------


@PROPERTY
@given(output=values(server=True, json=True), numpy_mode=st.booleans())
def test_a_json_answer_the_server_sends_is_what_the_client_reads(output, numpy_mode):
    body, media_type = call_answer_body(output, ENVELOPE, "application/json", LIMITS)
    with client_mode(numpy_mode):
        answer = messages.call_answer("g", "m", answer_of(body, media_type))
    assert {k: answer[k] for k in ENVELOPE} == ENVELOPE
    assert_same(output, answer["output"], numpy_mode)


@PROPERTY
@given(output=values(server=True, json=False), numpy_mode=st.booleans())
def test_a_safetensors_answer_the_server_sends_is_what_the_client_reads(output, numpy_mode):
    body, media_type = call_answer_body(output, ENVELOPE, "application/x-safetensors", LIMITS)
    assert media_type == "application/x-safetensors"
    with client_mode(numpy_mode):
        answer = messages.call_answer("g", "m", answer_of(body, media_type))
    assert answer["dispatch_mode"] is None and answer["group"] == "g"
    assert_same(output, answer["output"], numpy_mode)


# -- OIP inference, both ways -------------------------------------------------------------


@PROPERTY
@given(inputs=st.dictionaries(NAMES, tensors_of(), min_size=1, max_size=3),
       outputs=st.dictionaries(NAMES, tensors_of(), min_size=1, max_size=3),
       binary_inputs=st.booleans(), binary_outputs=st.booleans(), numpy_mode=st.booleans())
def test_an_inference_crosses_the_wire_both_ways(inputs, outputs, binary_inputs, binary_outputs, numpy_mode):
    request = messages.infer_request("/v2/models/m/infer", inputs, list(outputs), binary_inputs, binary_outputs,
                                     "r1", None, None)
    decode = oip.INFER_BODIES[request.headers["Content-Type"]]
    inference, got = decode(bytearray(request.content), request.headers.get(HEADER_LENGTH), LIMITS)
    assert list(got) == list(inputs)
    assert_same(inputs, got, server=True)
    chosen, binary = oip.chosen_outputs("m", inference, list(outputs))
    assert chosen == list(outputs) and binary == (set(outputs) if binary_outputs else set())
    body, header_length = oip.response("m", inference, chosen, binary, outputs)
    headers = {} if header_length is None else {HEADER_LENGTH: str(header_length)}
    media_type = "application/json" if header_length is None else "application/octet-stream"
    with client_mode(numpy_mode):
        result = messages.infer_result(answer_of(body, media_type, headers))
    assert result.model_name == "m" and result.id == "r1" and list(result.outputs) == list(outputs)
    assert_same(outputs, result.outputs, numpy_mode)

"""TensorDict batches on the wire as the server reads them (the shared
hybridflow_client.wire.tensordicts, made into the library's TensorDict by
hybridflow.wire.torch_builder): through JSON bodies and answers, safetensors call bodies and
answers, and the state store's journal, jagged tensors included, never pickled; hostile
documents are WireErrors (4xx over HTTP) checked before any jagged tensor is made; a
group's meshes in GET /v1/groups/{group}."""

from __future__ import annotations

import asyncio
import functools
import json
import struct
from typing import Any

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save
from tensordict import NonTensorStack, TensorDict

from hybridflow.control.contract import CallRequest, CallResult, GroupSummary
from hybridflow.http.app import create_app
from hybridflow.http.settings import IngressSettings
from hybridflow.state.codec import StateCodecError, decode_answer, decode_call, encode_answer, encode_call
from hybridflow.wire.torch_builder import TORCH_BUILDER
from hybridflow_client.wire import json_values, safetensors_call
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.json_values import encode_json_value, json_value_count
from hybridflow_client.wire.limits import DEFAULT_LIMITS, WireLimits
from hybridflow_client.wire.safetensors_call import encode_call_body, encode_output_body
from hybridflow_client.wire.tensordicts import TENSORDICT_MARKER, tensordict_document
from single_controller import tensordict_utils as tu
from single_controller.protocol import DataProto

# the server's decoders: the shared codecs with the server's builder
decode_call_body = functools.partial(safetensors_call.decode_call_body, builder=TORCH_BUILDER)
decode_output_body = functools.partial(safetensors_call.decode_output_body, builder=TORCH_BUILDER)


def decode_json_value(value: Any, where: str = "value", limits: WireLimits = DEFAULT_LIMITS) -> Any:
    return json_values.decode_json_value(value, where, limits, TORCH_BUILDER)


def jagged(lengths: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.nested.as_nested_tensor([torch.arange(n, dtype=dtype) + 10 * n for n in lengths], layout=torch.jagged)


def sample() -> TensorDict:
    """Four rows: a jagged 2-D tensor, a jagged tensor ragged in its third dimension, a
    dense tensor, a column of Python objects and batch metadata."""
    positions = torch.nested.as_nested_tensor(
        [torch.arange(3 * n, dtype=torch.float32).reshape(3, n) for n in (2, 4, 1, 3)], layout=torch.jagged
    )
    return tu.get_tensordict(
        {"input_ids": jagged([3, 0, 2, 5]), "position_ids": positions, "scores": torch.tensor([0.5, -1.0, 2.0, 3.5]),
         "turns": [[], ["hi"], {"a": 1}, None]},
        {"temperature": 0.7, "stage": {"name": "rollout", "steps": [1, 2]}},
    )


def assert_same(a: TensorDict, b: TensorDict) -> None:
    assert type(b) is TensorDict and b.batch_size == a.batch_size
    assert sorted(a.keys()) == sorted(b.keys())
    for key in a.keys():
        mine, theirs = a.get(key), b.get(key)
        if tu.is_jagged(mine):
            assert tu.is_jagged(theirs) and theirs.layout == torch.jagged and theirs._ragged_idx == mine._ragged_idx
            rows = list(zip(mine.unbind(0), theirs.unbind(0), strict=True))
            assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in rows), key
        elif isinstance(mine, torch.Tensor):
            assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), key
        elif isinstance(mine, NonTensorStack):  # the service builds its ObjectColumn
            assert isinstance(theirs, tu.ObjectColumn) and tu.get(a, key) == tu.get(b, key), key
        else:
            assert type(mine) is type(theirs) and tu.get(a, key) == tu.get(b, key), key


# -- round trips ------------------------------------------------------------------------


def test_a_jagged_tensordict_round_trips_through_json():
    data = sample()
    encoded = encode_json_value({"data": data})
    document = encoded["data"][TENSORDICT_MARKER]
    assert document["batch_size"] == [4]
    assert document["tensors"]["input_ids"]["offsets"] == {"datatype": "INT64", "shape": [5], "data": [0, 3, 3, 5, 10]}
    assert document["tensors"]["input_ids"]["values"]["data"] == [30, 31, 32, 20, 21, 50, 51, 52, 53, 54]
    assert document["tensors"]["position_ids"]["ragged_dim"] == 2
    assert document["objects"] == {"turns": [[], ["hi"], {"a": 1}, None]}
    assert document["metadata"] == {"temperature": 0.7, "stage": {"name": "rollout", "steps": [1, 2]}}
    back = decode_json_value(json.loads(json.dumps(encoded)), "body")["data"]
    assert_same(data, back)
    assert json_value_count(data) >= 10 + 3 * 10 + 4 + 4


def test_a_jagged_tensordict_round_trips_through_safetensors_calls_and_answers():
    data = sample()
    kwargs = decode_call_body(encode_call_body({"data": data, "x": torch.ones(2)}))
    assert_same(data, kwargs["data"])
    assert torch.equal(kwargs["x"], torch.ones(2))
    output = decode_output_body(encode_output_body({"first": data, "more": [data, DataProto.from_dict({"y": torch.ones(2)})]}))
    assert_same(data, output["first"])
    assert_same(data, output["more"][0])
    assert isinstance(output["more"][1], DataProto) and output["more"][1].batch["y"].tolist() == [1.0, 1.0]


def test_a_tensordict_without_rows_and_one_built_by_hand_decode():
    plain = TensorDict({"w": torch.ones(2, 3)}, batch_size=[])
    assert_same(plain, decode_json_value(encode_json_value(plain)))
    # what a curl user writes: no objects or metadata, offsets as INT32
    body = {TENSORDICT_MARKER: {"batch_size": [2], "tensors": {"ids": {
        "values": {"datatype": "INT64", "shape": [3], "data": [7, 8, 9]},
        "offsets": {"datatype": "INT32", "shape": [3], "data": [0, 1, 3]}, "ragged_dim": 1}}}}
    rows = [row.tolist() for row in decode_json_value(body).get("ids").unbind(0)]
    assert rows == [[7], [8, 9]]


def test_the_journal_keeps_a_tensordict_argument_and_replays_it_whole():
    data = sample()
    method, args, kwargs = decode_call(encode_call("update_actor", (data,), {"data": data, "n": 1}))
    assert method == "update_actor" and kwargs["n"] == 1
    assert_same(data, args[0])
    assert_same(data, kwargs["data"])
    assert_same(data, decode_answer(encode_answer(data)))


def test_the_journal_refuses_a_tensordict_it_cannot_keep_naming_its_place():
    data = tu.get_tensordict({"x": torch.ones(2)}, {"callback": object()})
    with pytest.raises(StateCodecError, match=r"kwargs\['data'\]: TensorDict.callback"):
        encode_call("update", (), {"data": data})


def test_a_journal_record_whose_batch_tag_lies_is_refused():
    record = encode_call("update", (), {"data": sample()})
    (length,) = struct.unpack_from("<Q", record, 5)
    header = record[13 : 13 + length].replace(b'"$tensordict"', b'"$dataproto"')
    forged = record[:5] + struct.pack("<Q", len(header)) + header + record[13 + length :]
    with pytest.raises(StateCodecError, match=r"\$dataproto holds a TensorDict"):
        decode_call(forged)


# -- hostile documents ------------------------------------------------------------------


def tensor(values: list, datatype: str = "INT64") -> dict[str, Any]:
    return {"datatype": datatype, "shape": [len(values)], "data": values}


def body(tensors: dict[str, Any], batch_size: list[int] | None = None, **rest: Any) -> dict[str, Any]:
    return {"kwargs": {"data": {TENSORDICT_MARKER: {"batch_size": [2] if batch_size is None else batch_size,
                                                    "tensors": tensors, **rest}}}}


def ids(values: list, offsets: list, ragged_dim: Any = 1, offsets_type: str = "INT64") -> dict[str, Any]:
    return {"values": tensor(values), "offsets": tensor(offsets, offsets_type), "ragged_dim": ragged_dim}


HOSTILE = [
    ("offsets that decrease", body({"ids": ids([1, 2, 3], [0, 3, 2])}), "offsets decrease"),
    ("offsets past the values", body({"ids": ids([1, 2, 3], [0, 2, 1 << 40])}), "offsets end at 1099511627776"),
    ("offsets short of the values", body({"ids": ids([1, 2, 3], [0, 1, 2])}), "the values hold 3"),
    ("offsets not from 0", body({"ids": ids([1, 2, 3], [1, 2, 3])}), "must start at 0"),
    ("offsets for other rows", body({"ids": ids([1, 2, 3], [0, 1, 2, 3])}), "2 rows need 3"),
    ("float offsets", body({"ids": ids([1, 2, 3], [0, 1, 3], offsets_type="FP32")}), "INT32 or INT64"),
    ("a ragged dim past the values", body({"ids": ids([1, 2, 3], [0, 1, 3], ragged_dim=2)}), "ragged_dim must be"),
    ("a boolean ragged dim", body({"ids": ids([1, 2, 3], [0, 1, 3], ragged_dim=True)}), "ragged_dim must be"),
    ("a jagged entry missing a part", body({"ids": {"values": tensor([1]), "ragged_dim": 1}}), "exactly values"),
    ("a jagged tensor without rows", body({"ids": ids([1], [0, 1])}, batch_size=[]), "batch of one or more rows"),
    ("a dense tensor of the wrong batch size", body({"x": tensor([1, 2, 3])}), "does not start with batch_size [2]"),
    ("objects of the wrong batch size", body({}, objects={"o": [1, 2, 3]}), "one value per row (2 rows)"),
    ("a batch size of two dimensions", body({}, batch_size=[2, 1]), "batch_size must be [rows]"),
    ("a negative batch size", body({}, batch_size=[-1]), "batch_size must be [rows]"),
    ("a tensor that is no tensor object", body({"x": [1, 2]}), "must be a tensor object"),
    ("an entry given twice", body({"x": tensor([1, 2])}, metadata={"x": 1}), "'x' is given twice"),
    ("an unknown field", body({}, extra={}), "a TensorDict is an object with batch_size and tensors"),
    ("a missing field", {"kwargs": {"data": {TENSORDICT_MARKER: {"tensors": {}}}}}, "batch_size and tensors"),
]


@pytest.mark.parametrize("payload, message", [case[1:] for case in HOSTILE], ids=[case[0] for case in HOSTILE])
def test_a_hostile_json_tensordict_is_a_wire_error(payload, message):
    with pytest.raises(WireError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(
            ")", r"\)")):
        decode_json_value(payload, "body")


def test_too_many_entries_is_a_wire_error_before_any_tensor_is_decoded():
    limits = WireLimits(max_tensors=3)
    tensors = {f"t{i}": tensor([i, i]) for i in range(2)}
    decode_json_value(body(tensors, objects={"o": [1, 2]}), "body", limits)  # three entries: within
    many = body(tensors, objects={"o": [1, 2]}, metadata={"m": 1, "n": 2})
    with pytest.raises(WireError, match=r"5 entries, over the limit of 3 \(limits.max_tensors\)"):
        decode_json_value(many, "body", limits)


def test_offsets_are_checked_before_a_jagged_tensor_is_made(monkeypatch):
    made: list[Any] = []
    monkeypatch.setattr(tu, "jagged_from_parts", lambda *args: made.append(args))
    for _, payload, _message in HOSTILE[:6]:
        with pytest.raises(WireError):
            decode_json_value(payload, "body")
    assert made == []


SMALL = WireLimits(max_tensors=6, max_json_values=300, max_tensor_elements=64, max_ndim=4, max_depth=6)
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 1 << 62), st.text(max_size=3), st.lists(st.integers(-1, 4),
                                                                                                  max_size=3))
OFFSETS = st.lists(st.integers(-2, 12), max_size=6)


@st.composite
def tensordict_documents(draw: st.DrawFn) -> dict[str, Any]:
    """Mostly a TensorDict document that fits, with counts, offsets and names that may not."""
    rows = draw(st.integers(0, 4))
    values = draw(st.lists(st.integers(-5, 5), max_size=10))
    entries: dict[str, Any] = {}
    for name in draw(st.lists(st.sampled_from(["a", "b", "c"]), unique=True, max_size=3)):
        kind = draw(st.sampled_from(["dense", "jagged", "junk"]))
        if kind == "dense":
            entries[name] = tensor(draw(st.lists(st.floats(-1, 1), min_size=rows, max_size=rows + draw(st.integers(0, 1)))),
                                   "FP32")
        elif kind == "jagged":
            entries[name] = {"values": tensor(values), "offsets": tensor(draw(OFFSETS), draw(st.sampled_from(
                ["INT64", "INT32", "FP32"]))), "ragged_dim": draw(st.one_of(st.just(1), JUNK))}
        else:
            entries[name] = draw(JUNK)
    document: dict[str, Any] = {"batch_size": draw(st.one_of(st.just([rows]), st.just([]), JUNK)), "tensors": entries}
    if draw(st.booleans()):
        document["objects"] = {"o": draw(st.lists(JUNK, min_size=rows, max_size=rows + 1))}
    if draw(st.booleans()):
        document["metadata"] = {draw(st.sampled_from(["m", "a"])): draw(JUNK)}
    return document


@settings(max_examples=150, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(tensordict_documents())
def test_fuzzed_tensordict_documents_decode_or_are_wire_errors(document):
    try:
        decode_json_value({TENSORDICT_MARKER: document}, "body", SMALL)
    except WireError:
        pass


def safetensors_body(document: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bytes:
    return save(tensors, metadata={"data": json.dumps({TENSORDICT_MARKER: document})})


def test_hostile_safetensors_tensordicts_are_wire_errors():
    offsets, values = torch.tensor([0, 1, 3]), torch.tensor([7, 8, 9])
    entry = {"values": "v", "offsets": "o", "ragged_dim": 1}
    good = {"batch_size": [2], "tensors": {"ids": entry}}
    rows = decode_call_body(safetensors_body(good, {"data@v": values, "data@o": offsets}))["data"].get("ids").unbind(0)
    assert [row.tolist() for row in rows] == [[7], [8, 9]]
    for document, tensors, message in [
        (good, {"data@v": values}, "'o' names none of the batch's tensors"),
        ({**good, "tensors": {"ids": {**entry, "offsets": "v"}}}, {"data@v": values}, "'v' is used twice"),
        (good, {"data@v": values, "data@o": offsets, "data@w": values.clone()}, r"tensors \['w'\] belong to no entry"),
        (good, {"data@v": values, "data@o": torch.tensor([0, 3, 1])}, "offsets decrease"),
        (good, {"data@v": values, "data@o": torch.tensor([0, 1, 4])}, "offsets end at 4"),
        ({**good, "batch_size": [3]}, {"data@v": values, "data@o": offsets}, "3 rows need 4"),
    ]:
        with pytest.raises(WireError, match=message):
            decode_call_body(safetensors_body(document, tensors))


def test_a_nested_tensordict_is_refused_on_the_way_out():
    data = TensorDict({"inner": TensorDict({"x": torch.ones(2)}, batch_size=[2])}, batch_size=[2])
    with pytest.raises(WireError, match="no nested TensorDicts"):
        tensordict_document(data, "output")
    with pytest.raises(WireError, match="no nested TensorDicts"):
        encode_output_body(data)


# -- over HTTP --------------------------------------------------------------------------


class EchoBackend:
    """Answers every call with its ``data`` argument; counts the calls; one group with a mesh."""

    def __init__(self) -> None:
        self.calls: list[CallRequest] = []

    async def call(self, request: CallRequest) -> CallResult:
        self.calls.append(request)
        return CallResult(request.kwargs["data"], dispatch_mode="ND_COMPUTE_PROTO(actor)", execute_mode="ALL",
                          world_size=4)

    async def describe_group(self, group: str) -> GroupSummary:
        meshes = {"actor": {"dp_size": 2, "collect_ranks": [0, 2]}} if group == "mesh" else None
        return GroupSummary(name=group, deployment="d", world_size=4, resource_pool="p", worker_class="W",
                            status="ready", last_error=None, rebuilds=0, replayed_calls=0, journal_length=0,
                            methods=[], ranks=[], meshes=meshes)


def fetch(backend: EchoBackend, method: str, path: str, **kwargs: Any) -> httpx.Response:
    app = create_app(backend, IngressSettings(auth_token=None, groups={"mesh": "d", "plain": "d"}))

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://svc") as http:
            return await http.request(method, path, **kwargs)

    return asyncio.run(go())


def test_a_tensordict_body_reaches_the_group_and_comes_back_in_either_form():
    data, backend = sample(), EchoBackend()
    answer = fetch(backend, "POST", "/v1/groups/mesh/m", json={"kwargs": encode_json_value({"data": data})})
    assert answer.status_code == 200, answer.text
    assert_same(data, backend.calls[0].kwargs["data"])
    assert_same(data, decode_json_value(answer.json()["output"]))
    answer = fetch(backend, "POST", "/v1/groups/mesh/m", content=encode_call_body({"data": data}),
                   headers={"Content-Type": "application/x-safetensors", "Accept": "application/x-safetensors"})
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/x-safetensors"
    assert_same(data, decode_output_body(answer.content))


def test_a_hostile_tensordict_body_is_a_json_4xx_and_calls_nothing():
    backend = EchoBackend()
    answer = fetch(backend, "POST", "/v1/groups/mesh/m", json=HOSTILE[1][1])
    assert answer.status_code == 422 and "offsets end at" in answer.json()["error"]
    bad = safetensors_body({"batch_size": [2], "tensors": {"ids": {"values": "v", "offsets": "o", "ragged_dim": 1}}},
                           {"data@v": torch.tensor([7, 8, 9]), "data@o": torch.tensor([0, 2, 1])})
    answer = fetch(backend, "POST", "/v1/groups/mesh/m", content=bad, headers={"Content-Type": "application/x-safetensors"})
    assert answer.status_code == 400 and "offsets decrease" in answer.json()["error"]
    assert backend.calls == []


def test_a_group_shows_its_meshes_and_a_group_without_shows_none():
    backend = EchoBackend()
    assert fetch(backend, "GET", "/v1/groups/mesh").json()["meshes"] == {"actor": {"dp_size": 2, "collect_ranks": [0, 2]}}
    assert fetch(backend, "GET", "/v1/groups/plain").json()["meshes"] is None

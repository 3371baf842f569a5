"""Bytes for the state store, without pickle: journal entries, per-rank snapshots and
idempotency answers.

A record is one blob::

    b"HFSC" | format version (1 byte) | JSON length (8 bytes, little-endian) | JSON | safetensors

The JSON holds the structure; every tensor, numpy array, numpy scalar and ``bytes`` value
in it is a placeholder naming a tensor of the safetensors part (which is empty when there
are none), so tensor bits are stored exactly as they are in memory: NaN payloads,
infinities, signed zeros and every dtype safetensors knows (BOOL, U8-U64, I8-I64, F16,
BF16, F32, F64, the float8 formats and C64).

What comes back (the decisions a round trip leaves open):

- ``None``, ``bool``, ``int``, ``str`` and ``float`` come back as themselves (non-finite
  floats with their exact bits); lists as lists, tuples as tuples (tagged, so a replayed
  call gets the argument types it was first given), ``bytes`` as ``bytes``.
- dicts keep their order; an ``OrderedDict`` (what torch's ``state_dict()`` returns)
  comes back as a plain ``dict`` with the same order. Keys may be ``str``, ``int``,
  ``float``, ``bool``, ``None`` or tuples of those.
- A tensor comes back as a CPU ``torch.Tensor`` of the same dtype, shape and bits,
  contiguous, detached, owning its memory: a subclass such as ``nn.Parameter`` becomes a
  plain tensor, ``requires_grad`` is dropped, a CUDA tensor comes back on the CPU (a
  worker's ``load_state_dict`` copies it to its device), and two tensors that shared
  memory no longer do.
- A numpy array comes back as a numpy array (native byte order, C-contiguous), a numpy
  scalar (``np.float32(1.5)``) as a numpy scalar of the same dtype.
- A verl ``DataProto`` or ``TensorDict`` comes back as one, with the same tensors (as
  above; a jagged tensor as jagged), non-tensor columns and metadata, in the form the HTTP
  wire gives it (hybridflow_client.wire.tensordicts: Python values are JSON values there).
- Anything else (objects, sets, complex128, sparse or quantized tensors, numpy object or
  string arrays, ``int`` or ``dict`` subclasses such as enums, nesting deeper than
  :data:`MAX_DEPTH`) raises :class:`StateCodecError`, a ``ValueError`` whose message
  names the path of the value, e.g. ``kwargs['x'][2]: unsupported type 'set'``.

Decoding checks everything (magic, lengths, strict JSON, tags, tensor references used
exactly once, dtypes) and raises :class:`StateCodecError` for any blob it did not write.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from hybridflow.wire.torch_builder import TORCH_BUILDER
from hybridflow_client.wire.dataproto import is_dataproto
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.limits import DEFAULT_LIMITS
from hybridflow_client.wire.limits import MAX_DEPTH as WIRE_MAX_DEPTH
from hybridflow_client.wire.tensordicts import batch_document, build_batch, is_tensordict

__all__ = [
    "MAX_DEPTH", "StateCodecError", "decode_answer", "decode_call", "decode_snapshot", "decode_value",
    "encode_answer", "encode_call", "encode_snapshot", "encode_value", "fingerprint",
]

MAGIC = b"HFSC"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sBQ")
#: Containers nested deeper than this are refused both ways (cycles end here too): the
#: wire's deepest, and room for what a call record and ``state_dict()`` wrap around it.
MAX_DEPTH = WIRE_MAX_DEPTH + 16
#: Ints with more bits than this are refused (Python's int/str conversion limit is near).
MAX_INT_BITS = 8192

#: dtypes safetensors stores (complex128, quantized and bit-packed dtypes it does not).
TENSOR_DTYPES = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
    torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz,
})
#: numpy kinds that map onto a tensor dtype (bool, signed, unsigned, float, complex).
_NUMPY_KINDS = frozenset("biufc")

_KINDS = ("value", "call", "snapshot", "answer")
_BATCHES = {"$dataproto": "DataProto", "$tensordict": "TensorDict"}
_TAGS = ("$tensor", "$ndarray", "$npscalar", "$bytes", "$tuple", "$float", "$dict", *_BATCHES)


class StateCodecError(ValueError):
    """A value the codec cannot store, or bytes it did not write."""


class _PathError(Exception):
    """Raised inside the walk; each level adds its step, the top turns it into a
    StateCodecError naming the whole path (so paths cost nothing on success)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.steps: list[str] = []


def _step(key: Any) -> str:
    return f"[{key!r}]"


class _Walker:
    """What encoding and decoding share: walking containers, naming the step that failed."""

    def value(self, node: Any, depth: int) -> Any:
        raise NotImplementedError

    def _entries(
        self, pairs: Iterable[tuple[Any, Any]], depth: int, key: Callable[[Any], Any] | None = None
    ) -> list[tuple[Any, Any]]:
        out = []
        for name, item in pairs:
            try:
                out.append((name if key is None else key(name), self.value(item, depth + 1)))
            except _PathError as exc:
                exc.steps.append(_step(name))
                raise
        return out

    def _items(self, items: Sequence[Any], depth: int) -> list[Any]:
        return [item for _, item in self._entries(enumerate(items), depth)]


# -- encoding -------------------------------------------------------------------------


class _Encoder(_Walker):
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._storages: set[int] = set()

    def value(self, value: Any, depth: int) -> Any:
        kind = type(value)
        if value is None or kind is bool or kind is str:
            return value
        if kind is int:
            if value.bit_length() > MAX_INT_BITS:
                raise _PathError(f"int of {value.bit_length()} bits (at most {MAX_INT_BITS})")
            return value
        if kind is float:
            return value if math.isfinite(value) else {"$float": struct.pack("<d", value).hex()}
        if depth >= MAX_DEPTH:
            raise _PathError(f"nested deeper than {MAX_DEPTH} levels (or a container holds itself)")
        if kind is list:
            return self._items(value, depth)
        if kind is tuple or kind is torch.Size:
            return {"$tuple": self._items(value, depth)}
        if kind is dict or kind is OrderedDict:
            return self._mapping(value, depth)
        if isinstance(value, torch.Tensor):
            return {"$tensor": self._add(self._tensor(value))}
        if kind is np.ndarray:
            return {"$ndarray": self._add(self._array(value))}
        if isinstance(value, np.generic) and not isinstance(value, (str, bytes)):
            return {"$npscalar": self._add(self._array(np.asarray(value)))}
        if is_dataproto(value) or is_tensordict(value):
            return self._batch(value)
        if kind is bytes:
            data = torch.frombuffer(bytearray(value), dtype=torch.uint8) if value else torch.empty(0, dtype=torch.uint8)
            return {"$bytes": self._add(data)}
        raise _PathError(f"unsupported type {kind.__module__}.{kind.__qualname__}".replace("builtins.", ""))

    def _batch(self, data: Any) -> dict[str, Any]:
        # The wire's own form of a DataProto or TensorDict: its JSON document (Python values
        # as JSON values) and its tensors, here by index.
        tag = "$dataproto" if is_dataproto(data) else "$tensordict"
        try:
            document, tensors = batch_document(data, _BATCHES[tag])
        except WireError as exc:
            raise _PathError(str(exc)) from None
        return {tag: {"document": document, "tensors": {key: self._add(self._tensor(t)) for key, t in tensors.items()}}}

    def _mapping(self, mapping: Mapping[Any, Any], depth: int) -> Any:
        if all(type(key) is str and not key.startswith("$") for key in mapping):
            return dict(self._entries(mapping.items(), depth))
        return {"$dict": [list(pair) for pair in self._entries(mapping.items(), depth, self._key)]}

    def _key(self, key: Any) -> Any:
        kind = type(key)
        if key is None or kind in (bool, int, str, float):
            return self.value(key, 0)
        if kind is tuple:
            return {"$tuple": [self._key(part) for part in key]}
        raise _PathError(f"unsupported mapping key type {kind.__qualname__}")

    def _add(self, tensor: torch.Tensor) -> int:
        # safetensors refuses tensors sharing memory: a second view of one storage is copied.
        if tensor.numel():
            storage = tensor.untyped_storage().data_ptr()
            if storage in self._storages:
                tensor = tensor.clone()
            else:
                self._storages.add(storage)
        index = len(self.tensors)
        self.tensors[str(index)] = tensor
        return index

    @staticmethod
    def _tensor(value: torch.Tensor) -> torch.Tensor:
        if value.layout != torch.strided or value.is_quantized or value.is_nested:
            raise _PathError(f"unsupported tensor layout {value.layout} (dense tensors only)")
        if value.device.type == "meta":
            raise _PathError("a tensor on the meta device has no data")
        if value.dtype not in TENSOR_DTYPES:
            raise _PathError(f"unsupported tensor dtype {value.dtype}")
        tensor = value.detach().cpu().resolve_conj().resolve_neg()  # each a no-op unless it applies
        return tensor.contiguous().as_subclass(torch.Tensor)

    @staticmethod
    def _array(value: np.ndarray) -> torch.Tensor:
        if value.dtype.kind not in _NUMPY_KINDS:
            raise _PathError(f"unsupported numpy dtype {value.dtype}")
        # (np.ascontiguousarray would turn a 0-d array into a 1-d one)
        array = value if value.flags.c_contiguous else np.ascontiguousarray(value)
        if not array.dtype.isnative:
            array = array.astype(array.dtype.newbyteorder("="))
        if not array.flags.writeable:  # torch warns on read-only memory
            array = array.copy()
        try:
            tensor = torch.from_numpy(array)
        except TypeError as exc:
            raise _PathError(f"unsupported numpy dtype {value.dtype}") from exc
        if tensor.dtype not in TENSOR_DTYPES:
            raise _PathError(f"unsupported numpy dtype {value.dtype}")
        return tensor


def _encode(kind: str, roots: Sequence[tuple[str, Any]]) -> bytes:
    encoder = _Encoder()
    body = {}
    for name, value in roots:
        try:
            body[name] = encoder.value(value, 0)
        except _PathError as exc:
            raise StateCodecError(f"{name}{''.join(reversed(exc.steps))}: {exc.message}") from None
    header = json.dumps(
        {"kind": kind, "tensors": len(encoder.tensors), "body": body},
        ensure_ascii=True, allow_nan=False, separators=(",", ":"), check_circular=False,
    ).encode("ascii")
    blob = safetensors_save(encoder.tensors) if encoder.tensors else b""
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header + blob


def encode_value(value: Any) -> bytes:
    """Any supported value (see the module docstring) as bytes."""
    return _encode("value", [("value", value)])


def encode_call(method: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bytes:
    """A journal entry: the method name, positional and keyword arguments."""
    if type(method) is not str or not method:
        raise StateCodecError(f"method: a non-empty str is required, got {method!r}")
    for key in kwargs:
        if type(key) is not str:
            raise StateCodecError(f"kwargs[{key!r}]: keyword names must be str")
    return _encode("call", [("method", method), ("args", tuple(args)), ("kwargs", dict(kwargs))])


def encode_snapshot(rank_states: Sequence[Any]) -> bytes:
    """A group's snapshot: one ``state_dict()`` result per rank, in rank order."""
    if isinstance(rank_states, (str, bytes, Mapping)) or not isinstance(rank_states, Sequence):
        raise StateCodecError(f"rank_states: a sequence with one state per rank is required, got {type(rank_states).__name__}")
    return _encode("snapshot", [(f"rank[{rank}]", state) for rank, state in enumerate(rank_states)])


def encode_answer(output: Any) -> bytes:
    """A call's collected output (or whatever the controller keeps as its answer)."""
    return _encode("answer", [("output", output)])


def fingerprint(data: bytes) -> str:
    """SHA-256 of ``data`` in hex: what the controller compares to tell a retry from a
    different body under the same Idempotency-Key."""
    return hashlib.sha256(data).hexdigest()


# -- decoding -------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise StateCodecError(f"JSON constant {name} is not allowed")


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise StateCodecError("JSON object with a repeated key")
    return result


class _Decoder(_Walker):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.used: set[str] = set()

    def value(self, node: Any, depth: int) -> Any:
        if node is None or type(node) in (bool, int, str):
            return node
        if type(node) is float:
            if not math.isfinite(node):  # e.g. 1e999: the encoder tags non-finite floats
                raise _PathError("a bare non-finite number")
            return node
        if depth >= MAX_DEPTH:
            raise _PathError(f"nested deeper than {MAX_DEPTH} levels")
        if type(node) is list:
            return self._items(node, depth)
        if type(node) is not dict:
            raise _PathError(f"unexpected JSON {type(node).__name__}")
        if not any(key.startswith("$") for key in node):
            return dict(self._entries(node.items(), depth))
        if len(node) != 1 or next(iter(node)) not in _TAGS:
            raise _PathError(f"unknown tag object with keys {sorted(node)[:4]}")
        tag, payload = next(iter(node.items()))
        if tag == "$tuple":
            return tuple(self._items(self._list(payload, tag), depth))
        if tag == "$dict":
            return self._pairs(self._list(payload, tag), depth)
        if tag == "$float":
            return self._float(payload)
        if tag in _BATCHES:
            return self._batch(tag, payload)
        tensor = self._take(payload)
        if tag == "$tensor":
            return tensor
        if tag == "$bytes":
            if tensor.dtype != torch.uint8 or tensor.dim() != 1:
                raise _PathError("a $bytes reference must name a 1-D U8 tensor")
            return tensor.numpy().tobytes()
        try:
            array = tensor.numpy()
        except TypeError as exc:  # e.g. BF16: numpy has no such dtype
            raise _PathError(f"{tag} names a {tensor.dtype} tensor, which numpy cannot hold") from exc
        if tag == "$npscalar":
            if array.ndim != 0:
                raise _PathError("a $npscalar reference must name a 0-d tensor")
            return array[()]
        return array

    def _batch(self, tag: str, payload: Any) -> Any:
        if type(payload) is not dict or set(payload) != {"document", "tensors"} or type(payload["tensors"]) is not dict:
            raise _PathError(f"{tag} needs an object with document and tensors")
        tensors = {key: self._take(index) for key, index in payload["tensors"].items()}
        try:
            data = build_batch(payload["document"], tensors, _BATCHES[tag], DEFAULT_LIMITS, TORCH_BUILDER)
        except WireError as exc:
            raise _PathError(str(exc)) from None
        if is_tensordict(data) != (tag == "$tensordict"):
            raise _PathError(f"{tag} holds a {type(data).__name__}")
        return data

    def _pairs(self, pairs: list[Any], depth: int) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for index, pair in enumerate(pairs):
            try:
                if type(pair) is not list or len(pair) != 2:
                    raise _PathError("a $dict item must be a [key, value] pair")
                key = self._key(pair[0])
                if key in out:
                    raise _PathError(f"repeated key {key!r}")
                out[key] = self.value(pair[1], depth + 1)
            except _PathError as exc:
                exc.steps.append(f"<item {index}>")
                raise
        return out

    def _key(self, node: Any) -> Any:
        if node is None or type(node) in (bool, int, float, str):
            return node
        if type(node) is dict and len(node) == 1:
            tag, payload = next(iter(node.items()))
            if tag == "$float":
                return self._float(payload)
            if tag == "$tuple":
                return tuple(self._key(part) for part in self._list(payload, tag))
        raise _PathError("a mapping key must be None, bool, int, float, str or a tuple of those")

    @staticmethod
    def _list(payload: Any, tag: str) -> list[Any]:
        if type(payload) is not list:
            raise _PathError(f"{tag} needs a list")
        return payload

    @staticmethod
    def _float(payload: Any) -> float:
        try:
            if type(payload) is not str or len(payload) != 16:
                raise ValueError
            return struct.unpack("<d", bytes.fromhex(payload))[0]
        except ValueError:
            raise _PathError("$float needs 16 hex digits") from None

    def _take(self, payload: Any) -> torch.Tensor:
        name = str(payload) if type(payload) is int else None
        if name not in self.tensors:
            raise _PathError(f"reference to a missing tensor {payload!r}")
        if name in self.used:
            raise _PathError(f"tensor {payload!r} referenced twice")
        self.used.add(name)
        return self.tensors[name]


def _split(data: bytes | bytearray | memoryview) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise StateCodecError(f"bytes are required, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < _PREFIX.size:
        raise StateCodecError(f"{len(data)} bytes: too short for a state record")
    magic, version, header_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise StateCodecError("not a state record (bad magic bytes)")
    if version != FORMAT_VERSION:
        raise StateCodecError(f"state record format {version}; this code reads format {FORMAT_VERSION}")
    if header_len > len(data) - _PREFIX.size:
        raise StateCodecError(f"header length {header_len} runs past the end ({len(data)} bytes)")
    start = _PREFIX.size
    try:
        header = json.loads(
            data[start:start + header_len].decode("utf-8"),
            parse_constant=_reject_constant, object_pairs_hook=_unique_pairs,
        )
    except RecursionError:
        raise StateCodecError("header nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, StateCodecError
        raise StateCodecError(f"header is not valid JSON: {exc}") from None
    if type(header) is not dict or set(header) != {"kind", "tensors", "body"}:
        raise StateCodecError("header must be an object with kind, tensors and body")
    count = header["tensors"]
    if type(count) is not int or count < 0 or header["kind"] not in _KINDS or type(header["body"]) is not dict:
        raise StateCodecError("header has a bad kind, tensor count or body")
    blob = data[start + header_len:]
    if count == 0:
        if blob:
            raise StateCodecError(f"{len(blob)} bytes after a header that names no tensors")
        return header, {}
    try:
        tensors = safetensors_load(blob)
    except Exception as exc:  # safetensors raises its own error types on bad bytes
        raise StateCodecError(f"tensor data is not valid safetensors: {exc}") from None
    if set(tensors) != {str(i) for i in range(count)}:
        raise StateCodecError(f"tensor data holds {len(tensors)} tensors with unexpected names; the header names {count}")
    return header, tensors


def _decode(data: bytes, kind: str, names: Sequence[str] | None) -> dict[str, Any]:
    header, tensors = _split(data)
    if header["kind"] != kind:
        raise StateCodecError(f"a {header['kind']} record where a {kind} record was expected")
    body = header["body"]
    if names is not None and list(body) != list(names):
        raise StateCodecError(f"a {kind} record needs the fields {list(names)}, got {list(body)[:8]}")
    decoder = _Decoder(tensors)
    out = {}
    for name, node in body.items():
        try:
            out[name] = decoder.value(node, 0)
        except _PathError as exc:
            raise StateCodecError(f"{name}{''.join(reversed(exc.steps))}: {exc.message}") from None
    if len(decoder.used) != len(tensors):
        raise StateCodecError(f"{len(tensors) - len(decoder.used)} tensors are not referenced by the structure")
    return out


def decode_value(data: bytes) -> Any:
    """The inverse of :func:`encode_value`."""
    return _decode(data, "value", ["value"])["value"]


def decode_call(data: bytes) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """The inverse of :func:`encode_call`: ``(method, args, kwargs)``."""
    body = _decode(data, "call", ["method", "args", "kwargs"])
    method, args, kwargs = body["method"], body["args"], body["kwargs"]
    if type(method) is not str or not method or type(args) is not tuple or type(kwargs) is not dict:
        raise StateCodecError("a call record needs a str method, a tuple of args and a dict of kwargs")
    if not all(type(key) is str for key in kwargs):
        raise StateCodecError("a call record's keyword names must be str")
    return method, args, kwargs


def decode_snapshot(data: bytes) -> list[Any]:
    """The inverse of :func:`encode_snapshot`: one state per rank, in rank order."""
    body = _decode(data, "snapshot", None)
    expected = [f"rank[{rank}]" for rank in range(len(body))]
    if list(body) != expected:
        raise StateCodecError("a snapshot record's fields must be rank[0], rank[1], ... in order")
    return list(body.values())


def decode_answer(data: bytes) -> Any:
    """The inverse of :func:`encode_answer`."""
    return _decode(data, "answer", ["output"])["output"]

"""Open Inference Protocol (KServe v2) inference requests and responses, both ways, with
the binary tensor data extension: a JSON header of ``Inference-Header-Content-Length``
bytes, then the binary tensors' raw little-endian row-major bytes, in the order the header
lists them. Requests are built as tritonclient builds them.

Parsing checks the whole message before any model runs: the header, every tensor's
datatype, shape (against :class:`~hybridflow_client.wire.limits.WireLimits`) and size,
the requested outputs and their parameters. Nothing here unpickles.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from hybridflow_client.wire.builders import CLIENT_BUILDER
from hybridflow_client.wire.datatypes import WireTensor, check_datatype, check_shape, from_buffer, itemsize
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.limits import DEFAULT_LIMITS, WireLimits
from hybridflow_client.wire.parts import Builder
from hybridflow_client.wire.strict_json import dumps_compact, loads_strict
from hybridflow_client.wire.tensor_objects import from_json
from hybridflow_client.wire.tensors import is_tensor, to_wire

__all__ = [
    "HEADER_LENGTH",
    "build_infer_request",
    "build_infer_response",
    "parse_header_length",
    "parse_infer_request",
    "parse_infer_response",
    "requested_outputs",
]

#: The binary extension's header: how many bytes of the body are the JSON header.
HEADER_LENGTH = "Inference-Header-Content-Length"


def parse_header_length(value: str | int | None, body_size: int) -> int | None:
    """The ``Inference-Header-Content-Length`` header as an int that fits a body of
    ``body_size`` bytes (None when absent: the whole body is JSON)."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if not text.isdigit() or len(text) > 20:
            raise WireError(f"{HEADER_LENGTH} {value[:40]!r} is not a non-negative integer")
        value = int(text)
    elif isinstance(value, bool) or not isinstance(value, int):
        raise WireError(f"{HEADER_LENGTH} must be an integer, got {value!r:.40}")
    if value < 0 or value > body_size:
        raise WireError(f"{HEADER_LENGTH} {value} does not fit a body of {body_size} bytes")
    return value


def _split_body(
    body: bytes | bytearray, header_length: str | int | None, what: str, limits: WireLimits
) -> tuple[Any, memoryview, bool]:
    """The parsed JSON header, the bytes after it, and whether a header length was given."""
    view = memoryview(body).cast("B")
    length = parse_header_length(header_length, len(view))
    if length is None:
        return loads_strict(view, f"{what} body", limits), view[len(view) :], False
    return loads_strict(view[:length], f"{what} header", limits), view[length:], True


def _parameters(entry: Mapping[str, Any], label: str) -> dict[str, Any]:
    parameters = entry.get("parameters")
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise WireError(f"{label}: parameters must be an object, got {type(parameters).__name__}")
    return parameters


def _flag(parameters: Mapping[str, Any], key: str, label: str) -> bool:
    value = parameters.get(key)
    if value is not None and not isinstance(value, bool):
        raise WireError(f"{label}: parameters.{key} must be true or false, got {value!r:.40}")
    return bool(value)


def _check_count(entries: list, kind: str, what: str, limits: WireLimits) -> list:
    if len(entries) > limits.max_tensors:
        raise WireError(
            f"{what} lists {len(entries)} {kind}s, over the limit of {limits.max_tensors} (limits.max_tensors)"
        )
    return entries


def _parse_tensors(
    entries: list, rest: memoryview, binary_allowed: bool, kind: str, limits: WireLimits, builder: Builder
) -> dict[str, Any]:
    """Tensors of an OIP ``inputs`` or ``outputs`` list, binary ones read from ``rest``."""
    tensors: dict[str, WireTensor] = {}
    offset = 0
    for position, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise WireError(f"{kind}s[{position}] must be an object")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise WireError(f"{kind}s[{position}] needs a non-empty string 'name'")
        label = f"{kind} {name!r:.100}"
        if name in tensors:
            raise WireError(f"{label} is given twice")
        datatype = check_datatype(entry.get("datatype"), label)
        shape = check_shape(entry.get("shape"), label, limits)
        parameters = _parameters(entry, label)
        if "shared_memory_region" in parameters:
            raise WireError(f"{label}: shared-memory tensors are not supported")
        size = parameters.get("binary_data_size")
        if size is None:
            if "data" not in entry:
                raise WireError(f"{label} has neither 'data' nor parameters.binary_data_size")
            tensors[name] = from_json(entry, label, limits)
            continue
        if "data" in entry:
            raise WireError(f"{label} has both 'data' and parameters.binary_data_size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise WireError(f"{label}: binary_data_size must be a non-negative integer, got {size!r:.40}")
        if not binary_allowed:
            raise WireError(f"{label} has binary_data_size but no {HEADER_LENGTH} says where the JSON ends")
        expected = math.prod(shape) * itemsize(datatype)
        if size != expected:
            raise WireError(
                f"{label}: binary_data_size is {size} bytes but shape {shape} of {datatype} needs {expected}"
            )
        if offset + size > len(rest):
            raise WireError(
                f"{label}: the body ends {offset + size - len(rest)} bytes short of its binary data "
                f"({len(rest)} bytes follow the JSON header)"
            )
        tensors[name] = from_buffer(rest[offset : offset + size], datatype, shape, label)
        offset += size
    if offset != len(rest):
        raise WireError(
            f"the body has {len(rest) - offset} bytes after the JSON header that no {kind} declares "
            f"({offset} declared by binary_data_size, {len(rest)} present)"
        )
    return {name: builder.tensor(tensor) for name, tensor in tensors.items()}


def _check_requested_outputs(request: dict[str, Any], limits: WireLimits) -> None:
    """The request's ``parameters`` and ``outputs`` entries, down to their flags."""
    _flag(_parameters(request, "inference request"), "binary_data_output", "inference request")
    outputs = request.get("outputs")
    if outputs is None:
        return
    if not isinstance(outputs, list) or not all(
        isinstance(entry, dict) and isinstance(entry.get("name"), str) and entry["name"] for entry in outputs
    ):
        raise WireError("inference request 'outputs' must be a list of objects with a non-empty 'name'")
    names: set[str] = set()
    for entry in _check_count(outputs, "output", "inference request", limits):
        label = f"requested output {entry['name']!r:.100}"
        if entry["name"] in names:
            raise WireError(f"{label} is asked for twice")
        names.add(entry["name"])
        _flag(_parameters(entry, label), "binary_data", label)


def parse_infer_request(
    body: bytes | bytearray, header_length: str | int | None, limits: WireLimits = DEFAULT_LIMITS,
    builder: Builder = CLIENT_BUILDER,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """An OIP inference request and its input tensors (made by ``builder``), by name in
    request order.

    ``header_length`` is the ``Inference-Header-Content-Length`` header, as sent or as an
    int (None when absent: the whole body is JSON). Inputs with
    ``parameters.binary_data_size`` take their bytes, in the order the JSON lists them,
    from after the header; the others take ``data`` from the JSON. Sizes must match shape
    and datatype and add up to the body exactly. The requested outputs and every
    ``parameters`` object are checked too, so nothing is left to fail after the model ran.
    The request dict is returned as parsed (with ``data`` lists left in it).
    """
    request, rest, binary = _split_body(body, header_length, "inference request", limits)
    if not isinstance(request, dict):
        raise WireError("inference request must be a JSON object")
    if "id" in request and not isinstance(request["id"], str):
        raise WireError(f"inference request 'id' must be a string, got {request['id']!r:.40}")
    _check_requested_outputs(request, limits)
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise WireError("inference request needs a non-empty 'inputs' list")
    _check_count(inputs, "input", "inference request", limits)
    return request, _parse_tensors(inputs, rest, binary, "input", limits, builder)


def parse_infer_response(
    body: bytes | bytearray, header_length: str | int | None, limits: WireLimits = DEFAULT_LIMITS,
    builder: Builder = CLIENT_BUILDER,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """An OIP inference response and its output tensors (made by ``builder``), with the
    checks of :func:`parse_infer_request`."""
    response, rest, binary = _split_body(body, header_length, "inference response", limits)
    if not isinstance(response, dict) or not isinstance(response.get("outputs", []), list):
        raise WireError("inference response must be a JSON object with an 'outputs' list")
    outputs = _check_count(response.get("outputs", []), "output", "inference response", limits)
    return response, _parse_tensors(outputs, rest, binary, "output", limits, builder)


def requested_outputs(request: Mapping[str, Any], output_names: Sequence[str]) -> tuple[list[str], set[str]]:
    """The outputs to answer, in order, and those of them to send as binary, for a request
    that :func:`parse_infer_request` accepted and a model with ``output_names``: the
    outputs it names (each with its ``binary_data`` flag), or every output when it names
    none (all binary when ``parameters.binary_data_output`` is true). An output the model
    lacks is a :class:`WireError`; call it before running the model."""
    requested = request.get("outputs") or []
    unknown = [entry["name"] for entry in requested if entry["name"] not in output_names]
    if unknown:
        raise WireError(f"no output {unknown[0]!r:.100} (outputs: {list(output_names)})")
    if requested:
        chosen = [entry["name"] for entry in requested]
        binary = {entry["name"] for entry in requested if (entry.get("parameters") or {}).get("binary_data")}
        return chosen, binary
    everything = bool((request.get("parameters") or {}).get("binary_data_output"))
    return list(output_names), set(output_names) if everything else set()


def _wants_binary(binary: set[str] | bool | Sequence[str] | None, names: Sequence[str]) -> set[str]:
    if binary is True:
        return set(names)
    if binary is False or binary is None:
        return set()
    return set(binary) & set(names)


def _tensor_entries(
    tensors: Mapping[str, Any], binary: set[str], kind: str, tensors_only: bool
) -> tuple[list[dict[str, Any]], list[bytes]]:
    entries: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, value in tensors.items():
        label = f"{kind} {name!r}"
        if tensors_only and not (is_tensor(value) or isinstance(value, WireTensor)):
            raise WireError(f"{label} is a {type(value).__name__}, not a tensor")
        tensor = to_wire(value, label)
        entry: dict[str, Any] = {"name": name, "datatype": tensor.datatype, "shape": tensor.shape}
        if name in binary:
            raw = tensor.to_bytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = tensor.json_data()
        entries.append(entry)
    return entries, blobs


def _assemble(message: dict[str, Any], blobs: list[bytes]) -> tuple[bytes, int | None]:
    header = dumps_compact(message)
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)


def build_infer_response(
    model_name: str,
    model_version: str | None,
    outputs: Mapping[str, Any],
    binary: set[str] | bool,
    id: str | None = None,
    parameters: Mapping[str, Any] | None = None,
) -> tuple[bytes, int | None]:
    """An OIP inference response body and, when any output is binary, the length of its
    JSON header (send it as ``Inference-Header-Content-Length``; Triton answers such
    bodies as ``application/octet-stream``, JSON-only ones as ``application/json``).

    ``outputs``: tensors (torch or numpy). ``binary``: True for every output in binary,
    False for none, or the names to send in binary (names not among ``outputs`` are
    ignored). JSON outputs carry flat ``data`` (BF16 as floats, non-finite floats as
    "NaN"/"Infinity"/"-Infinity"); binary outputs carry ``parameters.binary_data_size``
    and their bytes follow the header in order.
    """
    entries, blobs = _tensor_entries(outputs, _wants_binary(binary, list(outputs)), "output", tensors_only=True)
    message: dict[str, Any] = {"model_name": model_name}
    if model_version is not None:
        message["model_version"] = model_version
    if id is not None:
        message["id"] = id
    if parameters:
        message["parameters"] = dict(parameters)
    message["outputs"] = entries
    return _assemble(message, blobs)


def build_infer_request(
    inputs: Mapping[str, Any],
    binary: set[str] | bool = True,
    outputs: Sequence[str] | None = None,
    binary_outputs: bool = True,
    id: str | None = None,
    parameters: Mapping[str, Any] | None = None,
) -> tuple[bytes, int | None]:
    """An OIP inference request body, as tritonclient builds it, and its JSON header's
    length (None when the body is JSON only). ``inputs`` maps names to tensors (torch,
    numpy, numbers, lists); ``binary`` inputs (True: all) go as raw bytes after the JSON
    header, the rest as JSON ``data``. Named ``outputs`` are asked for with
    ``parameters.binary_data`` = ``binary_outputs``; with no names,
    ``parameters.binary_data_output`` asks for every output in binary."""
    entries, blobs = _tensor_entries(inputs, _wants_binary(binary, list(inputs)), "input", tensors_only=False)
    message: dict[str, Any] = {}
    if id is not None:
        message["id"] = id
    request_parameters = dict(parameters or {})
    if outputs:
        message["outputs"] = [{"name": name, "parameters": {"binary_data": binary_outputs}} for name in outputs]
    elif binary_outputs:
        request_parameters["binary_data_output"] = True
    if request_parameters:
        message["parameters"] = request_parameters
    message["inputs"] = entries
    return _assemble(message, blobs)

"""Open Inference Protocol (KServe v2) inference requests out and responses in, with the
binary tensor data extension: a JSON header of ``Inference-Header-Content-Length``
bytes, then the binary tensors' raw little-endian row-major bytes, in the order the
header lists them. Requests are built as tritonclient builds them."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hybridflow_client.json_codec import dumps_compact
from hybridflow_client.tensors import (
    DATATYPES,
    CodecError,
    check_datatype,
    check_shape,
    from_buffer,
    from_json,
    to_user,
    to_wire,
)

if TYPE_CHECKING:
    from hybridflow_client.tensors import Tensor

__all__ = ["HEADER_LENGTH", "build_infer_request", "parse_header_length", "parse_infer_response"]

#: The binary extension's header: how many bytes of the body are the JSON header.
HEADER_LENGTH = "Inference-Header-Content-Length"


def build_infer_request(
    inputs: Mapping[str, Any],
    binary: bool = True,
    outputs: Sequence[str] | None = None,
    binary_outputs: bool = True,
    id: str | None = None,
    parameters: Mapping[str, Any] | None = None,
) -> tuple[bytes, int | None]:
    """An inference request body and its JSON header's length (None when the body is
    JSON only). ``inputs`` maps names to tensors (torch, numpy, numbers, lists); with
    ``binary`` their bytes follow the header, else they are JSON ``data``. Named
    ``outputs`` are asked for with ``parameters.binary_data`` = ``binary_outputs``; with
    none, ``parameters.binary_data_output`` asks for every output in binary."""
    entries: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, value in inputs.items():
        tensor = to_wire(value, f"input {name!r}")
        entry: dict[str, Any] = {"name": name, "datatype": tensor.datatype, "shape": tensor.shape}
        if binary:
            blobs.append(tensor.to_bytes())
            entry["parameters"] = {"binary_data_size": len(blobs[-1])}
        else:
            entry["data"] = tensor.json_data()
        entries.append(entry)
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
    header = dumps_compact(message)
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)


def parse_header_length(value: str | int | None, body_size: int) -> int | None:
    """The ``Inference-Header-Content-Length`` header as an int that fits a body of
    ``body_size`` bytes (None when absent: the whole body is JSON)."""
    if value is None:
        return None
    text = str(value).strip()
    if not text.isdigit() or len(text) > 20 or int(text) > body_size:
        raise CodecError(f"{HEADER_LENGTH} {text[:40]!r} is not a length within the body's {body_size} bytes")
    return int(text)


def parse_infer_response(body: bytes, header_length: str | int | None) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """An inference response's JSON and its output tensors by name, binary ones read in
    order from after the header."""
    view = memoryview(body).cast("B")
    length = parse_header_length(header_length, len(view))
    header, rest = (view, view[len(view) :]) if length is None else (view[:length], view[length:])
    try:
        response = json.loads(bytes(header))
    except ValueError as exc:
        raise CodecError(f"inference response is not JSON: {exc}") from None
    if not isinstance(response, dict) or not isinstance(response.get("outputs", []), list):
        raise CodecError("inference response must be a JSON object with an 'outputs' list")
    outputs: dict[str, Tensor] = {}
    offset = 0
    for position, entry in enumerate(response.get("outputs", [])):
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str):
            raise CodecError(f"outputs[{position}] needs a string 'name'")
        label = f"output {name!r:.100}"
        size = (entry.get("parameters") or {}).get("binary_data_size")
        if size is None:
            outputs[name] = to_user(from_json(entry, label))
            continue
        datatype = check_datatype(entry.get("datatype"), label)
        shape = check_shape(entry.get("shape"), label)
        needed = math.prod(shape) * DATATYPES[datatype].itemsize
        if isinstance(size, bool) or not isinstance(size, int) or size != needed:
            raise CodecError(f"{label}: binary_data_size {size!r:.40} does not fit shape {shape} of {datatype}")
        if offset + size > len(rest):
            raise CodecError(f"{label}: the body ends {offset + size - len(rest)} bytes short of its binary data")
        outputs[name] = to_user(from_buffer(rest[offset : offset + size], datatype, shape, label))
        offset += size
    if offset != len(rest):
        raise CodecError(f"the body has {len(rest) - offset} bytes after the JSON header that no output declares")
    return response, outputs

"""KServe v2 gRPC messages (``inference.ModelInferRequest`` and its answers) to and from the
wire's tensors, with the stubs tritonclient generates from the protocol's proto.

A request's tensors come either all in ``raw_input_contents`` (one little-endian
row-major blob per input, in the inputs' order: what tritonclient sends) or all in the
inputs' typed ``contents`` fields (``fp32_contents``, ``int_contents``, ...). Everything
is checked before any model runs: names, datatypes (no BYTES), shapes against
:class:`hybridflow_client.wire.limits.WireLimits`, each blob's size against its shape, typed
values' count and range, and the outputs asked for. Answers carry every output in
``raw_output_contents``, as Triton does. The proxy parses the protobuf; nothing here
unpickles, and decoding costs in proportion to the tensors' bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tritonclient.grpc import service_pb2 as pb

from hybridflow_client.wire.datatypes import DATATYPES, check_datatype, check_shape, from_buffer, itemsize
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.limits import DEFAULT_LIMITS, WireLimits
from hybridflow_client.wire.strict_json import dumps_compact
from hybridflow_client.wire.tensors import is_tensor, to_torch, to_wire, torch_dtype

__all__ = [
    "VERSION",
    "InferCall",
    "chosen_outputs",
    "decode_infer_request",
    "encode_infer_response",
    "model_metadata_response",
    "parameters_of",
    "raw_bytes",
    "set_parameters",
    "typed_values",
]

#: The one version of every model.
VERSION = "1"

#: Where each datatype's typed values go (FP16 and BF16 have no field: raw contents only).
TYPED_FIELD: dict[str, str] = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}
#: The numpy type each typed field is read as, before the range check and the cast.
_READ_AS: dict[str, type] = {
    "bool_contents": np.bool_,
    "int_contents": np.int32,
    "uint_contents": np.uint32,
    "int64_contents": np.int64,
    "fp32_contents": np.float32,
    "fp64_contents": np.float64,
}
CONTENT_FIELDS: tuple[str, ...] = tuple(f.name for f in pb.InferTensorContents.DESCRIPTOR.fields)
#: Tensor parameters asking for what this service does not do.
_SHARED_MEMORY = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")
_REFUSED_OUTPUT_PARAMETERS = (*_SHARED_MEMORY, "classification")


@dataclass
class InferCall:
    """A checked inference request: its inputs by name in request order, and the outputs
    it asks for by name in order (empty: every output of the model)."""

    model: str
    id: str = ""
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)


def typed_values(request: pb.ModelInferRequest) -> int:
    """How many typed values the request's inputs carry (counted without reading them)."""
    return sum(len(getattr(entry.contents, name)) for entry in request.inputs for name in CONTENT_FIELDS)


def _refuse_parameters(parameters: Mapping[str, Any], refused: Sequence[str], label: str) -> None:
    for key in refused:
        if key in parameters:
            what = "classification outputs are" if key == "classification" else "shared-memory tensors are"
            raise WireError(f"{label}: parameter {key!r}: {what} not supported")


def _from_raw(raw: bytes, position: int, datatype: str, shape: list[int], label: str) -> torch.Tensor:
    expected = math.prod(shape) * itemsize(datatype)
    if len(raw) != expected:
        raise WireError(
            f"{label}: raw_input_contents[{position}] has {len(raw)} bytes but shape {shape} of {datatype} "
            f"needs {expected}"
        )
    return to_torch(from_buffer(raw, datatype, shape, label))


def _from_typed(
    contents: pb.InferTensorContents, datatype: str, shape: list[int], label: str
) -> torch.Tensor:
    count = math.prod(shape)
    present = [name for name in CONTENT_FIELDS if len(getattr(contents, name))]
    if not present:
        if count:
            raise WireError(f"{label} has no data: send raw_input_contents (one per input) or typed contents")
        return torch.empty(shape, dtype=torch_dtype(datatype))
    typed = TYPED_FIELD.get(datatype)
    if typed is None:
        raise WireError(f"{label}: {datatype} has no typed contents field; send it in raw_input_contents")
    stray = [name for name in present if name != typed]
    if stray:
        raise WireError(
            f"{label} is {datatype}, whose values go in contents.{typed}, but contents.{stray[0]} is set"
        )
    values = getattr(contents, typed)
    if len(values) != count:
        raise WireError(f"{label}: contents.{typed} has {len(values)} values but shape {shape} needs {count}")
    numbers = np.fromiter(values, dtype=_READ_AS[typed], count=count)
    target = DATATYPES[datatype]
    if target.kind in "iu" and numbers.dtype.itemsize > target.itemsize and count:
        bounds = np.iinfo(target)
        low, high = int(numbers.min()), int(numbers.max())
        if low < bounds.min or high > bounds.max:
            bad = low if low < bounds.min else high
            raise WireError(f"{label}: value {bad} is out of {datatype}'s range [{bounds.min}, {bounds.max}]")
    return torch.from_numpy(numbers).to(torch_dtype(datatype)).reshape(shape)


def _check_names(names: list[str], kind: str, limits: WireLimits) -> None:
    if len(names) > limits.max_tensors:
        raise WireError(
            f"inference request lists {len(names)} {kind}s, over the limit of {limits.max_tensors} "
            "(limits.max_tensors)"
        )
    seen: set[str] = set()
    for position, name in enumerate(names):
        if not name:
            raise WireError(f"{kind}s[{position}] needs a non-empty name")
        if name in seen:
            raise WireError(f"{kind} {name!r:.100} is given twice")
        seen.add(name)


def decode_infer_request(
    request: pb.ModelInferRequest, raws: Sequence[bytes] | None = None, limits: WireLimits = DEFAULT_LIMITS
) -> InferCall:
    """The request's input tensors and asked-for outputs, checked (a :class:`WireError`
    says what is wrong). ``raws``: the request's ``raw_input_contents`` when the caller
    read them already (each read of a protobuf bytes field is a copy)."""
    raws = list(request.raw_input_contents) if raws is None else list(raws)
    entries = request.inputs
    if not entries:
        raise WireError("inference request needs at least one input")
    _check_names([entry.name for entry in entries], "input", limits)
    if raws and len(raws) != len(entries):
        raise WireError(
            f"raw_input_contents has {len(raws)} entries for {len(entries)} inputs; send one per input, "
            "in the inputs' order, or none (typed contents)"
        )
    values = typed_values(request)
    if values > limits.max_json_values:
        raise WireError(
            f"the inputs' typed contents hold {values} values, over the limit of {limits.max_json_values} "
            "(limits.max_json_values); send large tensors in raw_input_contents"
        )
    inputs: dict[str, torch.Tensor] = {}
    for position, entry in enumerate(entries):
        label = f"input {entry.name!r:.100}"
        check_datatype(entry.datatype, label)
        shape = check_shape(list(entry.shape), label, limits)
        _refuse_parameters(entry.parameters, _SHARED_MEMORY, label)
        if raws:
            if any(len(getattr(entry.contents, name)) for name in CONTENT_FIELDS):
                raise WireError(
                    f"{label} has typed contents while the request sends raw_input_contents; send one"
                )
            inputs[entry.name] = _from_raw(raws[position], position, entry.datatype, shape, label)
        else:
            inputs[entry.name] = _from_typed(entry.contents, entry.datatype, shape, label)
    asked = request.outputs
    _check_names([entry.name for entry in asked], "output", limits)
    for entry in asked:
        _refuse_parameters(
            entry.parameters, _REFUSED_OUTPUT_PARAMETERS, f"requested output {entry.name!r:.100}"
        )
    return InferCall(request.model_name, request.id, inputs, [entry.name for entry in asked])


def chosen_outputs(call: InferCall, names: Sequence[str]) -> list[str]:
    """The outputs to answer, in order: those the request names, or every one of the
    model's. One the model lacks is a :class:`WireError` (ask before the model runs)."""
    unknown = [name for name in call.outputs if name not in names]
    if unknown:
        raise WireError(f"model {call.model!r} has no output {unknown[0]!r:.100} (outputs: {list(names)})")
    return list(call.outputs) or list(names)


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's little-endian row-major bytes in its wire datatype's layout."""
    return to_wire(tensor).to_bytes()


def set_parameters(target: MutableMapping[str, Any], values: Mapping[str, Any]) -> None:
    """Fill a protobuf ``map<string, InferParameter>`` from plain values: bools, integers
    (int64, or uint64 above its range), floats and strings as themselves, anything else
    as its compact JSON text."""
    for key, value in values.items():
        slot = target[key]
        if isinstance(value, bool):
            slot.bool_param = value
        elif isinstance(value, int) and -(1 << 63) <= value < (1 << 63):
            slot.int64_param = value
        elif isinstance(value, int) and 0 <= value < (1 << 64):
            slot.uint64_param = value
        elif isinstance(value, float):
            slot.double_param = value
        elif isinstance(value, str):
            slot.string_param = value
        else:
            slot.string_param = dumps_compact(value).decode()


def parameters_of(source: Mapping[str, Any]) -> dict[str, Any]:
    """A protobuf ``map<string, InferParameter>`` as plain values."""
    found = {}
    for key, parameter in source.items():
        choice = parameter.WhichOneof("parameter_choice")
        if choice is not None:
            found[key] = getattr(parameter, choice)
    return found


def encode_infer_response(
    model: str,
    request_id: str,
    outputs: Mapping[str, Any],
    chosen: Sequence[str],
    parameters: Mapping[str, Any] | None = None,
) -> pb.ModelInferResponse:
    """The answer: the ``chosen`` outputs, each as its datatype and shape in ``outputs``
    and its bytes in ``raw_output_contents``, and the answer's ``parameters``."""
    response = pb.ModelInferResponse(model_name=model, model_version=VERSION, id=request_id)
    set_parameters(response.parameters, parameters or {})
    blobs = []
    for name in chosen:
        label = f"output {name!r}"
        tensor = outputs.get(name)
        if not is_tensor(tensor):
            raise WireError(f"{label} is a {type(tensor).__name__}, not a tensor")
        wire = to_wire(tensor, label)
        entry = response.outputs.add()
        entry.name = name
        entry.datatype = wire.datatype
        entry.shape.extend(wire.shape)
        blobs.append(wire.to_bytes())
    response.raw_output_contents.extend(blobs)
    return response


def model_metadata_response(metadata: Mapping[str, Any]) -> pb.ModelMetadataResponse:
    """A model's metadata (as the controllers answer it for ``GET /v2/models/{model}``)."""
    response = pb.ModelMetadataResponse(
        name=metadata["name"],
        versions=list(metadata.get("versions", [VERSION])),
        platform=metadata.get("platform", ""),
    )
    for kind in ("inputs", "outputs"):
        for spec in metadata.get(kind, []):
            getattr(response, kind).add(
                name=spec["name"], datatype=spec["datatype"], shape=list(spec["shape"])
            )
    return response

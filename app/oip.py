"""Open Inference Protocol (KServe v2) inference on a group method, with the binary tensor
data extension. A model is a group method taking one input tensor as a one-item dp list
(MEGATRON_COMPUTE's convention) and returning one output per dp rank."""

from __future__ import annotations

from typing import Any

import torch

from app.errors import ApiError
from wire.dtypes import DATATYPE_OF
from wire.errors import WireError
from wire.oip_messages import build_infer_response, parse_infer_request, requested_outputs

SERVER_NAME = "hybridflow-single-controller"
SERVER_VERSION = "0.1.0"
EXTENSIONS = ["binary_tensor_data"]


def parse_request(body: bytes, header_length: str | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    try:
        return parse_infer_request(body, header_length)
    except WireError as exc:
        raise ApiError(400, str(exc)) from None


def check_input(inputs: dict[str, torch.Tensor], spec: dict[str, Any]) -> torch.Tensor:
    """The one input the model takes, checked against its declared datatype and shape."""
    (declared,) = spec["inputs"]
    name = declared["name"]
    if set(inputs) != {name}:
        raise ApiError(400, f"model takes exactly one input {name!r}, got {sorted(inputs)}")
    tensor = inputs[name]
    datatype = DATATYPE_OF.get(tensor.dtype, str(tensor.dtype))
    if datatype != declared["datatype"]:
        raise ApiError(400, f"input {name!r} must be {declared['datatype']}, got {datatype}")
    shape = declared["shape"]
    if tensor.dim() != len(shape) or any(d not in (-1, s) for d, s in zip(shape, tensor.shape, strict=True)):
        raise ApiError(400, f"input {name!r} must have shape {shape} (-1: any), got {list(tensor.shape)}")
    if any(s == 0 for s in tensor.shape):
        raise ApiError(400, f"input {name!r} is empty: shape {list(tensor.shape)}")
    return tensor


def response(
    model: str, request: dict[str, Any], spec: dict[str, Any], outputs: dict[str, torch.Tensor]
) -> tuple[bytes, int | None]:
    try:
        chosen, binary = requested_outputs(request, [o["name"] for o in spec["outputs"]])
    except WireError as exc:
        raise ApiError(400, f"model {model!r}: {exc}") from None
    try:
        return build_infer_response(model, "1", {n: outputs[n] for n in chosen}, binary, id=request.get("id"))
    except WireError as exc:
        raise ApiError(500, f"cannot encode the answer: {exc}") from None


def model_metadata(model: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": model,
        "versions": ["1"],
        "platform": "pytorch_megatron_core",
        "inputs": spec["inputs"],
        "outputs": spec["outputs"],
    }

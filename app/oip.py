"""Open Inference Protocol (KServe v2) inference on a group method, with the binary tensor
data extension. A model is a group method taking one input tensor as a one-item dp list
(MEGATRON_COMPUTE's convention) and returning one output per dp rank."""

from __future__ import annotations

from typing import Any

import torch

from app.errors import ApiError
from app.tensor_codec import TensorCodecError, build_infer_response, parse_infer_request

SERVER_NAME = "hybridflow-single-controller"
SERVER_VERSION = "0.1.0"
EXTENSIONS = ["binary_tensor_data"]

_TORCH_DATATYPES = {torch.float32: "FP32", torch.float16: "FP16", torch.float64: "FP64", torch.bfloat16: "BF16"}


def parse_request(body: bytes, header_length: str | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    length: int | None = None
    if header_length is not None:
        try:
            length = int(header_length)
        except ValueError:
            raise ApiError(400, f"Inference-Header-Content-Length {header_length!r} is not an integer") from None
        if length < 0 or length > len(body):
            raise ApiError(
                400, f"Inference-Header-Content-Length {length} does not fit a body of {len(body)} bytes"
            )
    try:
        return parse_infer_request(body, length)
    except TensorCodecError as exc:
        raise ApiError(400, str(exc)) from None


def check_input(inputs: dict[str, torch.Tensor], spec: dict[str, Any]) -> torch.Tensor:
    """The one input the model takes, checked against its declared datatype and shape."""
    (declared,) = spec["inputs"]
    name = declared["name"]
    if set(inputs) != {name}:
        raise ApiError(400, f"model takes exactly one input {name!r}, got {sorted(inputs)}")
    tensor = inputs[name]
    datatype = _TORCH_DATATYPES.get(tensor.dtype, str(tensor.dtype))
    if datatype != declared["datatype"]:
        raise ApiError(400, f"input {name!r} must be {declared['datatype']}, got {datatype}")
    shape = declared["shape"]
    if tensor.dim() != len(shape) or any(d not in (-1, s) for d, s in zip(shape, tensor.shape, strict=True)):
        raise ApiError(400, f"input {name!r} must have shape {shape} (-1: any), got {list(tensor.shape)}")
    if any(s == 0 for s in tensor.shape):
        raise ApiError(400, f"input {name!r} is empty: shape {list(tensor.shape)}")
    return tensor


def binary_outputs(request: dict[str, Any], output_names: list[str]) -> set[str]:
    """Outputs the client asked to receive as binary (per output, or all at once)."""
    wanted = set()
    requested = request.get("outputs") or []
    for entry in requested:
        if isinstance(entry, dict) and (entry.get("parameters") or {}).get("binary_data"):
            wanted.add(entry.get("name"))
    if not requested and (request.get("parameters") or {}).get("binary_data_output"):
        wanted = set(output_names)
    return wanted & set(output_names)


def response(
    model: str, request: dict[str, Any], spec: dict[str, Any], outputs: dict[str, torch.Tensor]
) -> tuple[bytes, int | None]:
    names = [o["name"] for o in spec["outputs"]]
    requested = [o.get("name") for o in request.get("outputs") or [] if isinstance(o, dict)]
    unknown = [n for n in requested if n not in names]
    if unknown:
        raise ApiError(400, f"model {model!r} has no output {unknown[0]!r}; outputs: {names}")
    chosen = {n: outputs[n] for n in (requested or names)}
    try:
        return build_infer_response(
            model, "1", chosen, binary_outputs(request, names), id=request.get("id")
        )
    except TensorCodecError as exc:
        raise ApiError(500, f"cannot encode the answer: {exc}") from None


def model_metadata(model: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": model,
        "versions": ["1"],
        "platform": "pytorch_megatron_core",
        "inputs": spec["inputs"],
        "outputs": spec["outputs"],
    }

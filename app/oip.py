"""Open Inference Protocol (KServe v2) messages on the HTTP side: the request parsed and
checked before any model runs, the answer built with the binary tensor data extension."""

from __future__ import annotations

from typing import Any

import torch

from app.errors import ApiError
from app.tensor_codec import TensorCodecError, build_infer_response, parse_infer_request

SERVER_NAME = "hybridflow-single-controller"
SERVER_VERSION = "0.2.0"
EXTENSIONS = ["binary_tensor_data"]


def parse_request(body: bytes, header_length: str | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    length: int | None = None
    if header_length is not None:
        try:
            length = int(header_length)
        except ValueError:
            raise ApiError(400, f"Inference-Header-Content-Length {header_length!r} is not an integer") from None
    try:
        return parse_infer_request(body, length)
    except TensorCodecError as exc:
        raise ApiError(400, str(exc)) from None


def requested_outputs(model: str, request: dict[str, Any], names: list[str]) -> list[str]:
    """The outputs the request asks for (all when it names none); 400 for a name the
    model does not have, before the model runs."""
    for entry in request.get("outputs") or []:
        if entry.get("parameters") is not None and not isinstance(entry["parameters"], dict):
            raise ApiError(400, f"output {entry.get('name')!r}: 'parameters' must be an object")
    requested = [o.get("name") for o in request.get("outputs") or []]
    unknown = [n for n in requested if n not in names]
    if unknown:
        raise ApiError(400, f"model {model!r} has no output {unknown[0]!r}; outputs: {names}")
    return requested or list(names)


def binary_outputs(request: dict[str, Any], output_names: list[str]) -> set[str]:
    """Outputs the client asked to receive as binary (per output, or all at once)."""
    wanted = set()
    requested = request.get("outputs") or []
    for entry in requested:
        if (entry.get("parameters") or {}).get("binary_data"):
            wanted.add(entry.get("name"))
    if not requested and (request.get("parameters") or {}).get("binary_data_output"):
        wanted = set(output_names)
    return wanted & set(output_names)


def response(model: str, request: dict[str, Any], chosen: list[str], outputs: dict[str, Any]) -> tuple[bytes, int | None]:
    try:
        return build_infer_response(
            model, "1", {n: outputs[n] for n in chosen}, binary_outputs(request, chosen), id=request.get("id")
        )
    except TensorCodecError as exc:
        raise ApiError(500, f"cannot encode the answer: {exc}") from None

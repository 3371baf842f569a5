"""Open Inference Protocol (KServe v2) messages on the HTTP side: the request parsed and
checked (its requested outputs too) before any model runs, the answer built with the
binary tensor data extension (the shared :mod:`hybridflow_client.wire.oip_messages`).
:data:`INFER_BODIES` is the inference route's table from media type to decoder."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import version
from typing import Any

import torch

from hybridflow.http.body import JSON, OCTET_STREAM
from hybridflow.http.errors import ApiError
from hybridflow.wire.loop_work import loop_work
from hybridflow.wire.torch_builder import TORCH_BUILDER
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.limits import DEFAULT_LIMITS, WireLimits
from hybridflow_client.wire.oip_messages import build_infer_response, parse_infer_request, requested_outputs

SERVER_NAME = "hybridflow-single-controller"
#: The installed package's version (pyproject.toml holds it; nothing else states it).
SERVER_VERSION = version("hybridflow-serve")
#: Triton's names: the binary tensor data, statistics and model repository extensions
#: (the repository's load and unload answer 400: the serve config fixes the models).
EXTENSIONS = ["binary_tensor_data", "statistics", "model_repository"]


def parse_request(
    body: bytes, header_length: str | None, limits: WireLimits = DEFAULT_LIMITS
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    try:
        return parse_infer_request(body, header_length, limits, TORCH_BUILDER)
    except WireError as exc:
        raise ApiError(400, str(exc)) from None


def request_work(body: bytes | bytearray, header_length: str | None) -> int:
    """Decoding ``body``'s work (``hybridflow.wire.loop_work``): its JSON is parsed, the
    binary tensor data after a header only viewed or copied. A header length that is no
    length, or past the body, counts the whole body as JSON (the decoder refuses it)."""
    size = len(body)
    parsed = int(header_length) if header_length is not None and header_length.isdigit() else size
    parsed = min(parsed, size)
    return loop_work(parsed, size - parsed)


def answer_work(outputs: Mapping[str, Any], binary: set[str]) -> int:
    """Encoding the answer's work: binary outputs are copied, the others spelled as JSON."""
    parsed = raw = 0
    for name, tensor in outputs.items():
        if isinstance(tensor, torch.Tensor):
            nbytes = tensor.numel() * tensor.element_size()
            if name in binary:
                raw += nbytes
            else:
                parsed += nbytes
    return loop_work(parsed, raw)


#: An inference body by media type: JSON, the binary extension's octet stream, or none
#: (tritonclient sends no Content-Type); the header length tells the two forms apart.
INFER_BODIES: dict[str, Callable[..., tuple[dict[str, Any], dict[str, torch.Tensor]]]] = {
    "": parse_request, JSON: parse_request, OCTET_STREAM: parse_request,
}


def chosen_outputs(model: str, request: dict[str, Any], names: Sequence[str]) -> tuple[list[str], set[str]]:
    """The outputs to answer and those to send as binary; 400 for an output the model
    does not have (asked before the model runs)."""
    try:
        return requested_outputs(request, names)
    except WireError as exc:
        raise ApiError(400, f"model {model!r}: {exc}") from None


def response(
    model: str, request: dict[str, Any], chosen: list[str], binary: set[str], outputs: dict[str, Any],
    parameters: Mapping[str, Any] | None = None,
) -> tuple[bytes, int | None]:
    """The answer's body, with the answer's ``parameters`` (``InferResult.answer_parameters``:
    one that shared its group call with other requests says with how many in ``batch_size``)."""
    try:
        return build_infer_response(
            model, "1", {n: outputs[n] for n in chosen}, binary, id=request.get("id"), parameters=parameters
        )
    except WireError as exc:
        raise ApiError(500, f"cannot encode the answer: {exc}") from None

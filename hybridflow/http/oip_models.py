"""Pydantic models of the Open Inference Protocol (KServe v2) REST messages, for request
validation and the OpenAPI schema of the /v2 routes.

Inference bodies that use the binary tensor data extension are a JSON header followed by
raw bytes; only the header is described by :class:`InferRequest` / :class:`InferResponse`
(a binary tensor carries ``parameters.binary_data_size`` instead of ``data``). Decoding
tensors is :mod:`hybridflow_client.wire.oip_messages`' job.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, model_validator

from hybridflow_client.wire.datatypes import DATATYPES

#: Tensor datatypes this service accepts and returns (OIP names).
Datatype = Literal[tuple(DATATYPES)]  # type: ignore[valid-type]

#: Name of the binary tensor data extension in server metadata.
BINARY_TENSOR_DATA = "binary_tensor_data"

_DATATYPE_DOC = (
    "Element type: BOOL, UINT8, INT8, INT16, INT32, INT64, FP16, BF16, FP32 or FP64. "
    "BF16 travels as floats in JSON and as raw 2-byte words in binary."
)
_DATA_DOC = (
    "Elements in row-major order, flat (a nested list is accepted and flattened). JSON has no "
    'NaN or infinity: floats spell them as the strings "NaN", "Infinity", "-Infinity". '
    "Absent when the tensor is binary (see parameters.binary_data_size)."
)


class _Open(BaseModel):
    """Parameters objects: the protocol lets clients add their own keys."""

    model_config = ConfigDict(extra="allow")


class InputParameters(_Open):
    binary_data_size: NonNegativeInt | None = Field(
        None,
        description="Binary tensor data extension: the tensor's bytes (little-endian, row-major) follow the "
        "JSON header, in input order; this many bytes, which must equal prod(shape) * element size.",
        examples=[2048],
    )


class RequestedOutputParameters(_Open):
    binary_data: bool | None = Field(
        None, description="Binary tensor data extension: return this output as raw bytes after the JSON header."
    )


class RequestParameters(_Open):
    binary_data_output: bool | None = Field(
        None,
        description="Binary tensor data extension: return every output as raw bytes (used when 'outputs' "
        "names none).",
    )


class OutputParameters(_Open):
    binary_data_size: NonNegativeInt | None = Field(
        None, description="Size in bytes of this output's raw data after the JSON header, when sent in binary."
    )


class InferInputTensor(BaseModel):
    """One input tensor of an inference request."""

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"name": "x", "shape": [1, 1, 2], "datatype": "FP32", "data": [0.5, 1.5]}]}
    )

    name: str = Field(..., min_length=1, description="Input name, as listed in the model metadata.", examples=["x"])
    shape: list[NonNegativeInt] = Field(..., description="Dimensions of the tensor.", examples=[[8, 2, 64]])
    datatype: Datatype = Field(..., description=_DATATYPE_DOC, examples=["FP32"])
    parameters: InputParameters | None = Field(None, description="Per-input parameters.")
    data: list[Any] | None = Field(None, description=_DATA_DOC)

    @model_validator(mode="after")
    def _data_or_binary(self) -> InferInputTensor:
        binary = self.parameters is not None and self.parameters.binary_data_size is not None
        if binary and self.data is not None:
            raise ValueError(f"input {self.name!r} has both data and parameters.binary_data_size")
        if not binary and self.data is None:
            raise ValueError(f"input {self.name!r} needs data, or parameters.binary_data_size for binary data")
        return self


class InferRequestedOutput(BaseModel):
    """An output the client asks for; listing none means every output."""

    name: str = Field(..., min_length=1, description="Output name, as listed in the model metadata.", examples=["y"])
    parameters: RequestedOutputParameters | None = Field(None, description="Per-output parameters.")


class InferRequest(BaseModel):
    """``POST /v2/models/{model}/infer`` (the JSON header, with the binary extension)."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "id": "42",
                    "inputs": [{"name": "x", "shape": [1, 1, 2], "datatype": "FP32", "data": [0.5, 1.5]}],
                    "outputs": [{"name": "y", "parameters": {"binary_data": False}}],
                }
            ]
        }
    )

    id: str | None = Field(None, description="Request identifier, echoed in the response.", examples=["42"])
    parameters: RequestParameters | None = Field(None, description="Request-wide parameters.")
    inputs: list[InferInputTensor] = Field(..., min_length=1, description="Input tensors.")
    outputs: list[InferRequestedOutput] | None = Field(
        None, description="Outputs to return, and how; absent or empty returns every output as JSON "
        "unless parameters.binary_data_output is true."
    )


class InferOutputTensor(BaseModel):
    """One output tensor of an inference response."""

    name: str = Field(..., description="Output name.", examples=["y"])
    shape: list[NonNegativeInt] = Field(..., description="Dimensions of the tensor.", examples=[[8, 2, 64]])
    datatype: Datatype = Field(..., description=_DATATYPE_DOC, examples=["FP32"])
    parameters: OutputParameters | None = Field(None, description="Per-output parameters.")
    data: list[Any] | None = Field(None, description=_DATA_DOC)


class InferResponse(BaseModel):
    """Answer of ``POST /v2/models/{model}/infer`` (its JSON header, with the binary extension)."""

    model_name: str = Field(..., description="The model that answered.", examples=["mlp"])
    model_version: str | None = Field(None, description="Version of the model that answered.", examples=["1"])
    id: str | None = Field(None, description="The request's identifier, when it had one.")
    parameters: dict[str, Any] | None = Field(None, description="Response-wide parameters.")
    outputs: list[InferOutputTensor] = Field(..., description="Output tensors, in the order their bytes follow.")


class ServerMetadata(BaseModel):
    """``GET /v2``."""

    name: str = Field(..., description="Server name.", examples=["hybridflow-single-controller"])
    version: str = Field(..., description="Server version.", examples=["0.1.0"])
    extensions: list[str] = Field(
        default_factory=lambda: [BINARY_TENSOR_DATA],
        description="Protocol extensions the server supports.",
        examples=[[BINARY_TENSOR_DATA]],
    )


class MetadataTensor(BaseModel):
    """An input or output a model declares."""

    name: str = Field(..., description="Tensor name.", examples=["x"])
    datatype: Datatype = Field(..., description=_DATATYPE_DOC, examples=["FP32"])
    shape: list[int] = Field(
        ..., description="Dimensions; -1 marks a dimension of any size.", examples=[[-1, -1, 4096]]
    )

    @model_validator(mode="after")
    def _dims(self) -> MetadataTensor:
        if any(d < -1 for d in self.shape):
            raise ValueError(f"shape {self.shape}: dimensions are sizes, or -1 for any size")
        return self


class ModelMetadata(BaseModel):
    """``GET /v2/models/{model}``."""

    name: str = Field(..., description="Model name.", examples=["mlp"])
    versions: list[str] | None = Field(None, description="Versions the server can run.", examples=[["1"]])
    platform: str = Field(..., description="Framework that runs the model.", examples=["pytorch_megatron_core"])
    inputs: list[MetadataTensor] = Field(..., description="Inputs the model takes.")
    outputs: list[MetadataTensor] = Field(..., description="Outputs the model returns.")


# -- statistics extension ------------------------------------------------------------------


class DurationStatistic(BaseModel):
    """A count and a cumulative duration."""

    count: NonNegativeInt = Field(..., description="How many times the duration was measured.", examples=[12])
    ns: NonNegativeInt = Field(..., description="Their total, in nanoseconds.", examples=[48000000])


class InferenceStatistics(BaseModel):
    success: DurationStatistic = Field(..., description="Requests answered with outputs, and their whole time.")
    fail: DurationStatistic = Field(..., description="Requests that failed, and their time.")
    queue: DurationStatistic = Field(..., description="Time requests waited for a batch.")
    compute_input: DurationStatistic = Field(..., description="Checking inputs against the model's spec.")
    compute_infer: DurationStatistic = Field(..., description="The group call that runs the model.")
    compute_output: DurationStatistic = Field(..., description="Work on the outputs after the call (none here).")
    cache_hit: DurationStatistic = Field(..., description="Always zero: there is no response cache.")
    cache_miss: DurationStatistic = Field(..., description="Always zero: there is no response cache.")


class BatchStatistic(BaseModel):
    batch_size: int = Field(..., ge=1, description="Requests run in one execution.", examples=[1])
    compute_input: DurationStatistic
    compute_infer: DurationStatistic
    compute_output: DurationStatistic


class ModelStatistic(BaseModel):
    """One model version's cumulative statistics since its controller replica started."""

    name: str = Field(..., examples=["mlp"])
    version: str = Field(..., examples=["1"])
    last_inference: NonNegativeInt = Field(..., description="Milliseconds since the epoch (0: none yet).")
    inference_count: NonNegativeInt = Field(..., description="Successful inferences.")
    execution_count: NonNegativeInt = Field(..., description="Model executions (a batch is one).")
    inference_stats: InferenceStatistics
    batch_stats: list[BatchStatistic]


class ModelStatisticsResponse(BaseModel):
    """``GET /v2/models[/{model}[/versions/{version}]]/stats`` (Triton's statistics extension)."""

    model_stats: list[ModelStatistic]


# -- model repository extension -------------------------------------------------------------


class RepositoryIndexRequest(BaseModel):
    """``POST /v2/repository/index``; an empty body asks for every model."""

    model_config = ConfigDict(extra="forbid")

    ready: bool = Field(False, strict=True, description="List only the models ready for inference.")


class RepositoryModel(BaseModel):
    name: str = Field(..., examples=["mlp"])
    version: str = Field(..., examples=["1"])
    state: Literal["READY", "UNAVAILABLE"] = Field(..., description="READY when its group is ready.")
    reason: str = Field(..., description="Why the model is not ready (empty when it is).", examples=[""])

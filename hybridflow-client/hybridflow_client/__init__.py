"""Client of the HybridFlow single-controller HTTP service: a Python client (sync and
async, on httpx) and a CLI (``hybridflow``, or ``python -m hybridflow_client.cli``).
Installs alone: httpx, numpy and safetensors; torch is optional. Its wire formats
(:mod:`hybridflow_client.wire`) are the service's own: the server decodes and encodes
with the same code."""

from hybridflow_client.python_client import (
    AsyncSingleControllerClient,
    InferResult,
    ServiceError,
    SingleControllerClient,
)
from hybridflow_client.version import __version__
from hybridflow_client.wire.dataproto import WireDataProto
from hybridflow_client.wire.errors import WireError as CodecError  # the client's name for the wire's error

__all__ = [
    "AsyncSingleControllerClient",
    "CodecError",
    "InferResult",
    "ServiceError",
    "SingleControllerClient",
    "WireDataProto",
    "__version__",
]

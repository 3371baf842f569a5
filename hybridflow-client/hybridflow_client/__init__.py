"""Client of the HybridFlow single-controller HTTP service: a Python client (sync and
async, on httpx) and a CLI (``hybridflow``, or ``python -m hybridflow_client.cli``).
Installs alone: httpx, numpy and safetensors; torch is optional."""

from hybridflow_client.dataproto import WireDataProto
from hybridflow_client.python_client import (
    AsyncSingleControllerClient,
    InferResult,
    ServiceError,
    SingleControllerClient,
)
from hybridflow_client.tensors import CodecError
from hybridflow_client.version import __version__

__all__ = [
    "AsyncSingleControllerClient",
    "CodecError",
    "InferResult",
    "ServiceError",
    "SingleControllerClient",
    "WireDataProto",
    "__version__",
]

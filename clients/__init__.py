"""Clients of the service: a Python client (sync and async, on httpx) and a CLI
(``python -m clients.cli``)."""

from clients.python_client import (
    AsyncSingleControllerClient,
    InferResult,
    ServiceError,
    SingleControllerClient,
)

__all__ = ["AsyncSingleControllerClient", "InferResult", "ServiceError", "SingleControllerClient"]

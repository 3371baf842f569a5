"""Tensors on the wire, shared by the server and the client: numpy, torch, safetensors and
the standard library only (no FastAPI, pydantic or Ray).

- :mod:`wire.dtypes`: OIP datatype names <-> torch/numpy, item sizes, shape checks.
- :mod:`wire.json_tensors`: OIP JSON tensor objects; decoding and encoding nested values.
- :mod:`wire.safetensors_call`: safetensors bodies, a call's arguments and an output's packing.
- :mod:`wire.oip_messages`: OIP inference requests and responses, binary data extension.
- :mod:`wire.strict_json`: the one strict JSON loader.
- :mod:`wire.split`: a job's split of its dp-list argument, lazy and bounded.
- :mod:`wire.limits`: the bounds every decoder takes; :mod:`wire.errors`: :class:`WireError`.

Bytes from the network are only ever parsed as JSON, safetensors or raw little-endian
numbers; nothing here unpickles.
"""

from hybridflow.wire.errors import WireError
from hybridflow.wire.limits import DEFAULT_LIMITS, WireLimits

__all__ = ["DEFAULT_LIMITS", "WireError", "WireLimits"]

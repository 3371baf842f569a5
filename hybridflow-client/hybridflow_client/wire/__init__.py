"""The wire formats of the HybridFlow service, once, for the server and the client alike:
numpy, safetensors and the standard library only (torch optional: used where a caller
hands over or asks for torch tensors; no FastAPI, pydantic, Ray or httpx).

- :mod:`.datatypes`: OIP datatype names, shapes, raw bytes, :class:`WireTensor`.
- :mod:`.tensors`: what a caller passes (torch, numpy, numbers) to and from :class:`WireTensor`.
- :mod:`.tensor_objects`: OIP JSON tensor objects.
- :mod:`.strict_json`: the one strict JSON loader, counted before parsing.
- :mod:`.json_values`: tensors and batches in JSON values, both ways.
- :mod:`.dataproto`, :mod:`.tensordicts`: verl's batches as documents and tensors.
- :mod:`.safetensors_body`: safetensors bodies read by the format's rules.
- :mod:`.formats`: what a call format is; :mod:`.json_call` and :mod:`.safetensors_call`
  are the two (one module per format, one table row per side of the wire).
- :mod:`.oip_messages`: OIP inference requests and responses, binary data extension.
- :mod:`.parts`, :mod:`.builders`: what decoders hand over, and the client's values of it.
- :mod:`.limits`: the bounds every decoder takes; :mod:`.errors`: :class:`WireError`.

Every decoder takes the bounds and checks counts and shapes before it builds anything;
bytes are only ever parsed as JSON, safetensors or raw little-endian numbers; nothing here
unpickles.
"""

from hybridflow_client.wire.datatypes import WireTensor
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.limits import CLIENT_LIMITS, DEFAULT_LIMITS, WireLimits

__all__ = ["CLIENT_LIMITS", "DEFAULT_LIMITS", "WireError", "WireLimits", "WireTensor"]

"""What the decoders hand to the side that decodes: a :class:`Builder` makes that side's
own values of checked parts (a client: numpy arrays, or torch tensors where torch is
installed; the server: torch tensors and its library's batch types), so the format's code
exists once and each side keeps its own types."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

__all__ = ["Builder", "JaggedParts", "TensorDictParts"]


@dataclass(frozen=True)
class JaggedParts:
    """A jagged tensor's checked parts: its rows' elements joined (``values``: a tensor
    as decoded), where each row starts (``offsets``: int64, rows + 1 of them, from 0,
    never decreasing, ending at the values' length along the ragged dimension) and the
    ragged dimension (1 for ``[rows, j]``)."""

    values: Any
    offsets: np.ndarray
    ragged_dim: int


@dataclass(frozen=True)
class TensorDictParts:
    """A TensorDict's checked parts: ``batch_size`` (``[rows]`` or ``[]``), its tensors in
    the document's order (each a decoded tensor or :class:`JaggedParts`), its columns of
    Python objects (one JSON value a row) and its metadata (JSON values)."""

    batch_size: list[int]
    tensors: dict[str, Any] = field(default_factory=dict)
    objects: dict[str, list[Any]] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)


class Builder(Protocol):
    """How one side of the wire makes its values of what a decoder checked."""

    def tensor(self, tensor: Any) -> Any:
        """The side's tensor of a decoded one (a :class:`~hybridflow_client.wire.datatypes.WireTensor`)."""

    def dataproto(self, tensors: dict[str, Any], non_tensors: dict[str, np.ndarray], meta_info: dict[str, Any],
                  where: str) -> Any:
        """The side's DataProto of checked parts (tensors as decoded, in the batch's order)."""

    def tensordict(self, parts: TensorDictParts, where: str) -> Any:
        """The side's TensorDict of checked parts."""

"""The server's values of what the shared codecs (:mod:`hybridflow_client.wire`) decode:
torch tensors sharing the decoded arrays' memory (views of a request's body where its
bytes lie aligned, so a large body is held once), and the library's batch types: its
``DataProto``, and TensorDicts whose jagged tensors are views of their values
(``single_controller.jagged``, offsets checked already) and whose object columns are one
list (``single_controller.object_column``), so a batch costs in proportion to its bytes."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hybridflow_client.wire.datatypes import WireTensor
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.parts import JaggedParts, TensorDictParts
from hybridflow_client.wire.tensordicts import tensordict_of
from hybridflow_client.wire.tensors import to_torch

__all__ = ["TORCH_BUILDER", "TorchBuilder", "as_torch"]


def as_torch(tensor: Any) -> torch.Tensor:
    """A decoded tensor as torch (no copy); a torch tensor (the state store's) as it is."""
    return to_torch(tensor) if isinstance(tensor, WireTensor) else tensor


def _jagged(parts: JaggedParts) -> torch.Tensor:
    from single_controller import tensordict_utils

    return tensordict_utils.jagged_from_parts(as_torch(parts.values), torch.from_numpy(parts.offsets), parts.ragged_dim)


def _column(items: list[Any]) -> Any:
    from single_controller import tensordict_utils

    return tensordict_utils.object_column(items)


class TorchBuilder:
    """The server's :class:`~hybridflow_client.wire.parts.Builder`."""

    def tensor(self, tensor: WireTensor) -> torch.Tensor:
        return to_torch(tensor)

    def dataproto(self, tensors: dict[str, Any], non_tensors: dict[str, np.ndarray], meta_info: dict[str, Any],
                  where: str) -> Any:
        from single_controller.protocol import DataProto, DataProtoError

        try:
            return DataProto.from_dict(
                tensors={name: as_torch(tensor) for name, tensor in tensors.items()} or None,
                non_tensors=non_tensors,
                meta_info=meta_info,
            )
        except DataProtoError as exc:
            raise WireError(f"{where}: {exc}") from None

    def tensordict(self, parts: TensorDictParts, where: str) -> Any:
        return tensordict_of(parts, where, as_torch, _jagged, _column)


#: What every decoder of the server is given.
TORCH_BUILDER = TorchBuilder()

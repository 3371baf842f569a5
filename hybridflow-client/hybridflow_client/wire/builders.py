"""The client's values of what the decoders checked: tensors as numpy arrays, or as torch
tensors where torch is installed (BF16 without torch: float32 arrays of exactly the same
values); DataProtos of the class the call sent, verl's or the library's where one is
imported (with torch tensors, as theirs hold), else
:class:`~hybridflow_client.wire.dataproto.WireDataProto`; TensorDicts (torch and tensordict
needed) with torch tensors whatever the client hands back elsewhere."""

from __future__ import annotations

from typing import Any

import numpy as np

from hybridflow_client.wire import tensors
from hybridflow_client.wire.dataproto import WireDataProto, dataproto_class
from hybridflow_client.wire.datatypes import WireTensor
from hybridflow_client.wire.errors import WireError
from hybridflow_client.wire.parts import JaggedParts, TensorDictParts
from hybridflow_client.wire.tensordicts import tensordict_of

__all__ = ["CLIENT_BUILDER", "ClientBuilder"]


def _torch_of(tensor: Any) -> Any:
    return tensors.to_torch(tensor) if isinstance(tensor, WireTensor) else tensor


class ClientBuilder:
    """A client's :class:`~hybridflow_client.wire.parts.Builder`; ``dataproto_type``: the
    class DataProto answers are built with (a DataProto argument's class)."""

    def __init__(self, dataproto_type: type | None = None) -> None:
        self.dataproto_type = dataproto_type

    def tensor(self, tensor: WireTensor) -> Any:
        if tensors.installed_torch() is None:
            return tensor.values()
        return tensors.to_torch(tensor)

    def dataproto(self, tensors: dict[str, Any], non_tensors: dict[str, np.ndarray], meta_info: dict[str, Any],
                  where: str) -> Any:
        cls = dataproto_class(self.dataproto_type)
        tensor = self.tensor if cls is WireDataProto else _torch_of  # verl's batch holds torch tensors
        return cls.from_dict(
            tensors={name: tensor(value) for name, value in tensors.items()} or None,
            non_tensors=non_tensors,
            meta_info=meta_info,
        )

    def tensordict(self, parts: TensorDictParts, where: str) -> Any:
        try:
            import torch
            from tensordict import NonTensorData, NonTensorStack
        except ImportError:
            raise WireError(f"{where} is a TensorDict: reading one needs torch and tensordict installed") from None

        def jagged(entry: JaggedParts) -> Any:
            offsets = torch.from_numpy(entry.offsets)
            return torch.nested.nested_tensor_from_jagged(_torch_of(entry.values), offsets, jagged_dim=entry.ragged_dim)

        def column(items: list[Any]) -> Any:
            return NonTensorStack.from_list([NonTensorData(item) for item in items])

        return tensordict_of(parts, where, _torch_of, jagged, column)


#: The client's builder when no DataProto argument names a class.
CLIENT_BUILDER = ClientBuilder()

"""HybridFlow single-controller library: one controller drives groups of Ray actor workers.

``from single_controller import DataProto`` (verl's ``from verl import DataProto``) and
verl's ``verl.single_controller`` names (``Worker``, ``WorkerGroup``, ``ClassWithInitArgs``,
``ResourcePool``) work; each is imported on first use, so ``import single_controller``
itself stays cheap (no torch, no tensordict, no Ray).
"""

from __future__ import annotations

import importlib
from typing import Any

#: Lazily served names and the module each comes from.
_LAZY_NAMES = {
    **dict.fromkeys(("DataProto", "DataProtoConfig", "DataProtoFuture", "DataProtoItem"), "single_controller.protocol"),
    **dict.fromkeys(("Worker", "WorkerGroup", "ClassWithInitArgs", "ResourcePool"), "single_controller.base"),
}

__all__ = list(_LAZY_NAMES)


def __getattr__(name: str) -> Any:
    module = _LAZY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'single_controller' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

"""Weights from one worker group to another, resharded (HybridFlow's hand-off between a
training layout and a generation layout).

- :mod:`.layout`: what a rank declares (logical parameters, full shapes, tp split, place);
- :mod:`.plan`: which slices of which source ranks each destination rank needs;
- :mod:`.transport`: object store or collective group, from the layouts;
- :mod:`.collective`: the torch.distributed path (NCCL on GPUs, gloo on CPU);
- :mod:`.worker`: the worker-side mixin (stage, commit, read, load);
- :mod:`.sync`: the controller side (``sync_weights`` and its steps).

Names are imported on first use, so the pure planning modules load without torch or Ray.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY_NAMES = {
    **dict.fromkeys(("Box", "ParamSpec", "RankWeights", "WeightLayout"), "single_controller.weights.layout"),
    **dict.fromkeys(("ReshardPlan", "SliceTransfer", "plan_resharding"), "single_controller.weights.plan"),
    **dict.fromkeys(("Route", "choose_transport"), "single_controller.weights.transport"),
    "WeightSyncWorker": "single_controller.weights.worker",
    **dict.fromkeys(
        (
            "StagedSync", "SyncReport", "WeightSyncError", "abort_weights", "commit_weights", "load_weights",
            "read_rank_weights", "read_weights", "stage_weights", "sync_weights", "weight_layout", "weights_version",
        ),
        "single_controller.weights.sync",
    ),
}

__all__ = sorted(_LAZY_NAMES)


def __getattr__(name: str) -> Any:
    module = _LAZY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'single_controller.weights' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

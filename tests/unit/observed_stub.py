"""The service's real FastAPI app over a stub backend that answers what an operator looks
at: groups in several states (with rank placement), jobs, and models with statistics
kept by the controller's own ``hybridflow.control.model_statistics``."""

from __future__ import annotations

import time
from typing import Any

from hybridflow.control import model_statistics
from hybridflow.control.contract import ControllerError, ErrorKind, GroupSummary, MethodSummary
from hybridflow.http.app import create_app
from hybridflow.http.settings import IngressSettings, ModelRoute

#: group -> (deployment, world size, status, last error)
GROUPS = {
    "accumulator": ("accumulators", 1, "ready", None),
    "gpu_accumulator": ("accumulators", 4, "ready", None),
    "test_actor": ("test_actor", 4, "rebuilding", "test_actor: a worker is lost (ActorDiedError)"),
    "mlp": ("mlp", 4, "failed", "rebuild failed: ResourceUnavailableError: no GPUs left"),
}
#: model -> its group
MODELS = {"checksum": "test_actor", "double": "gpu_accumulator", "mlp": "mlp"}
JOB = {"id": "0123456789abcdef", "group": "mlp", "method": "run_layer", "status": "running", "progress": 0.5,
       "split": 4, "error": None, "error_kind": None, "cancel_requested": False, "elapsed_s": 1.5}


def summary(name: str) -> GroupSummary:
    deployment, world_size, status, last_error = GROUPS[name]
    return GroupSummary(
        name=name, deployment=deployment, world_size=world_size, resource_pool=f"pool [{world_size}]",
        worker_class=name.title().replace("_", ""), status=status, last_error=last_error, rebuilds=1 if last_error else 0,
        replayed_calls=0, journal_length=2, methods=[MethodSummary("add", "ONE_TO_ALL", "ALL", True, False)],
    )


class ObservedStub:
    async def describe(self) -> list[GroupSummary]:
        return [summary(name) for name in GROUPS]

    async def describe_group(self, group: str) -> GroupSummary | ControllerError:
        found = summary(group)
        found.ranks = [
            {"rank": r, "local_rank": r, "node_id": "ab12cd34ef56" * 4, "node_ip": "10.0.0.7", "pid": 4000 + r,
             "cuda_visible_devices": str(r), "device": "cpu"}
            for r in range(found.world_size)
        ]
        return found

    async def ready(self) -> dict[str, bool]:
        return {name: status == "ready" for name, (_, _, status, _) in GROUPS.items()}

    async def model_statistics(self, model: str) -> dict[str, Any] | ControllerError:
        if model not in MODELS:
            return ControllerError(ErrorKind.UNKNOWN_MODEL, f"unknown model {model!r}")
        return model_statistics.of(model).as_triton()

    async def list_jobs(self) -> list[dict[str, Any]]:
        return [{**JOB, "submitted_at": time.time()}]


def observed_app(token: str | None = None) -> Any:
    settings = IngressSettings(
        auth_token=token,
        groups={name: deployment for name, (deployment, *_) in GROUPS.items()},
        models={name: ModelRoute(deployment=GROUPS[group][0], group=group, outputs=["y"]) for name, group in MODELS.items()},
    )
    stub = ObservedStub()
    return create_app(stub, settings, stub)

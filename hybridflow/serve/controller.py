"""Where a controller meets Ray Serve in the layout with controllers in replicas of their
own: one deployment class for every declared deployment, each replica a single
controller that owns its groups and models. Its methods are the controllers' own
(:class:`~hybridflow.control.controllers.Controllers`, the backend the ingress reaches
through a Serve handle); the embedded layout hosts the same class in the ingress
instead (``hybridflow.serve.ingress_controllers``)."""

from __future__ import annotations

from typing import Any

from ray import serve

from hybridflow.control.controllers import Controllers
from hybridflow.control.placement import DeploymentPlan
from hybridflow.serve.preload import load_batch_types


@serve.deployment(max_ongoing_requests=256)
class ControllerDeployment(Controllers):
    """A controller replica: claims its groups' stored state in ``__init__`` (stored state
    that no longer fits a group fails the replica with an error naming it), then starts
    the groups and restores their state in the background, so a replica that Serve
    restarts answers at once: 503 with Retry-After for a group until it is ready. It
    answers the ingress and the jobs deployment, and gives Serve a health check that
    never waits behind calls and never fails the replica for a lost worker (that group
    is rebuilt in the background)."""

    async def __init__(
        self,
        deployment: dict[str, Any],
        plan: DeploymentPlan,
        service: dict[str, Any],
        status_codes: dict[str, int] | None = None,
    ) -> None:
        load_batch_types()  # no request pays their import with the loop waiting
        built = Controllers.build([deployment], [plan], service, status_codes)
        super().__init__(list(built.controllers.values()), built.pools)
        await self.begin()

    def __del__(self) -> None:
        if getattr(self, "controllers", None):
            self.shutdown()

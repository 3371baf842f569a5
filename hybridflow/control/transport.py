"""Which transport each group's calls take to its ranks (``transport`` in a group's config):

- ``tasks``: a Ray task per rank and call (``RayWorkerGroup.submit``).
- ``socket``: one TCP connection per rank (``single_controller.ray.socket_channel``): a
  call is one pickled frame written to each rank's connection from the controller's event
  loop and one read back, without a Ray task, the object store or a thread hop. Costs
  nothing while idle (each rank's thread waits in ``recv``).
- ``compiled``: one Ray Compiled Graph over the group's processes
  (``single_controller.ray.graph_channel.GraphChannel``): a call is one write into shared
  memory read by every rank. While the graph exists each of its ranks polls its input,
  idle or not: about half a core per rank.
- ``auto``: ``socket`` where the group can take every call over a channel
  (``hybridflow.config.loading.channel_unfit``), else ``tasks``. ``auto`` never picks the
  polling graph; docs/benchmarks.md compares the three.
"""

from __future__ import annotations

from hybridflow.config import DeploymentConfig
from hybridflow.config.loading import channel_unfit

COMPILED, SOCKET, TASKS = "compiled", "socket", "tasks"


def resolve_transports(deployments: list[DeploymentConfig]) -> dict[str, str]:
    """Each group's transport, ``compiled``, ``socket`` or ``tasks``: as declared, and
    ``auto`` decided per group."""
    chosen: dict[str, str] = {}
    for deployment in deployments:
        for group in deployment.groups:
            if group.transport != "auto":
                chosen[group.name] = group.transport
            else:
                chosen[group.name] = SOCKET if channel_unfit(group, deployment) is None else TASKS
    return chosen

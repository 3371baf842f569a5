"""Which transport each group's calls take to its ranks (``transport`` in a group's config):

- ``tasks``: a Ray task per rank and call (``RayWorkerGroup.submit``). Costs nothing while
  idle.
- ``compiled``: one Ray Compiled Graph over the group's processes
  (``single_controller.ray.graph_channel.GraphChannel``): a call is one write into shared
  memory read by every rank, without a Ray task per rank. While the graph exists each of
  its ranks polls its input, idle or not: about a core per rank.
- ``auto``: ``compiled`` where the group can use it (``hybridflow.config.loading.graph_unfit``)
  and the node has a core to spare for each of its ranks, after :data:`RESERVED_CORES` for
  the service's own processes, the ranks of groups declared ``compiled`` and those of
  groups ``auto`` placed on a graph before it; else ``tasks``. So a 2-core machine never runs a polling graph on its own choice.
"""

from __future__ import annotations

import os

from hybridflow.config import DeploymentConfig
from hybridflow.config.loading import graph_unfit

COMPILED, TASKS = "compiled", "tasks"
#: Cores ``auto`` leaves to the service's own processes (proxy, ingress, controllers,
#: Ray's daemons) before it gives any to polling ranks.
RESERVED_CORES = 4


def node_cores() -> int:
    """The cores this process may run on (its CPU affinity), as ``auto`` counts them."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def resolve_transports(
    deployments: list[DeploymentConfig], world_sizes: dict[str, int], cores: int
) -> dict[str, str]:
    """Each group's transport, ``compiled`` or ``tasks``, for the deployments one process
    hosts (their ranks share its node), ``auto`` decided in the order the groups are
    declared. ``world_sizes``: ranks per group (a plain actor's 1)."""
    groups = [(group, deployment) for deployment in deployments for group in deployment.groups]
    # Groups declared compiled poll whatever auto decides: their ranks' cores go first.
    spare = cores - RESERVED_CORES - sum(world_sizes.get(g.name, 1) for g, _ in groups if g.transport == COMPILED)
    chosen: dict[str, str] = {}
    for group, deployment in groups:
        ranks = world_sizes.get(group.name, 1)
        if group.transport != "auto":
            chosen[group.name] = group.transport
        elif graph_unfit(group, deployment) is None and ranks <= spare:
            chosen[group.name] = COMPILED
            spare -= ranks
        else:
            chosen[group.name] = TASKS
    return chosen

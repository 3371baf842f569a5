"""Starting one rank of a running group again: a new actor for that rank alone, in the
bundle its first actor had, with the same environment (rank, world size, rendezvous), so
that from inside it the new actor cannot tell it is a replacement.

A group started by ``RayWorkerGroup`` keeps each rank's :class:`RankPlace`;
``RayWorkerGroup.replace_worker(rank)`` uses it. Only ranks that share nothing with the
others can be replaced this way: a rank that joined a process group (torch.distributed,
Megatron's parallel state) with the others cannot rejoin it alone, and a process that
colocated roles share holds the other roles' state too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray

#: Separates a rank's actor name from the count of its replacements (``..._0:1~2``).
REPLACED_MARK = "~"


@dataclass(frozen=True)
class RankPlace:
    """Where and how one rank's actor was started: enough to start it again."""

    placement_group: Any
    bundle_index: int
    env: dict[str, str]
    name: str
    use_gpu: bool
    num_gpus: float
    num_cpus: float
    detached: bool

    def start(self, cls_with_init: Any, name: str | None = None) -> Any:
        """An actor of ``cls_with_init`` here, named ``name`` (the place's own by default)."""
        return cls_with_init(
            placement_group=self.placement_group,
            placement_group_bundle_idx=self.bundle_index,
            use_gpu=self.use_gpu,
            num_gpus=self.num_gpus,
            num_cpus=self.num_cpus,
            env_vars=dict(self.env),
            name=name or self.name,
            detached=self.detached,
        )


def next_name(current: str) -> str:
    """The name of the next replacement of the actor named ``current``: an actor's name
    stays taken until Ray has reaped it, so a replacement never reuses it."""
    base, _, count = current.rpartition(REPLACED_MARK)
    if base and count.isdigit():
        return f"{base}{REPLACED_MARK}{int(count) + 1}"
    return f"{current}{REPLACED_MARK}1"


def replace_worker(group: Any, rank: int, timeout_s: float) -> Any:
    """Kill ``group``'s actor of ``rank`` (if it still runs) and start a new one in its
    place (see the module docstring); returns the new actor once it is up. The group's
    compiled graphs are torn down first (they span the old actor); its calls go to the new
    actor from then on. An actor that does not come up within ``timeout_s`` is killed and
    the error raised; the group then has no live actor for ``rank``."""
    places = getattr(group, "_places", None)
    if not places:
        raise ValueError("only a group that started its own workers can replace one (not attached workers)")
    if not 0 <= rank < len(places):
        raise ValueError(f"rank {rank} is not in this group of {len(places)} ranks")
    if group._method_prefix:
        raise ValueError("a role of colocated or fused workers cannot replace a rank: its processes hold other roles")
    group._teardown_compiled()
    old = group._workers[rank]
    try:
        ray.kill(old, no_restart=True)
    except Exception:  # gone already
        pass
    name = next_name(group._worker_names[rank])
    actor = places[rank].start(group.ray_cls_with_init, name)
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)
    except Exception:
        ray.kill(actor, no_restart=True)
        raise
    group._workers[rank] = actor
    group._worker_names[rank] = name
    group._rank_info_cache = None
    check = group._shared.get("aliveness")
    if check is not None:
        check.workers[rank] = actor
    return actor

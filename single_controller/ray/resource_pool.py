"""Ray resource pools: one STRICT_PACK placement group per node entry; merges and splits
of pools (``merge_resource_pool``, ``split_resource_pool``) share their bundles.

When the cluster has a node for every entry, each entry goes to a node of its own
(``ray.io/node-id`` label selectors); with fewer nodes (a single machine), entries share.
Every group built on a pool (or on a merge of pools) places rank ``r`` in bundle
``r``, so ranks of different groups on one pool share that bundle's GPU. A pool the
cluster cannot hold fails fast with what was asked and what the cluster has, never
an endless pending placement group (verl's "program stuck" report).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from single_controller.base.worker_group import ResourcePool

#: CPUs a bundle reserves when not told otherwise: small, so the tutorial's 8 bundles
#: and a Serve application fit on a 2-core machine. Processes still share real cores.
DEFAULT_CPUS_PER_BUNDLE = 0.1
#: The label Ray gives every node: its node id.
NODE_ID_LABEL = "ray.io/node-id"


class ResourceUnavailableError(RuntimeError):
    """The cluster cannot place a resource pool."""


def _fmt(resources: dict[str, float]) -> str:
    keys = [k for k in ("CPU", "GPU") if k in resources] + sorted(
        k
        for k in resources
        if k not in ("CPU", "GPU") and not k.startswith(("node:", "bundle_group", "memory", "object_store"))
    )
    return "{" + ", ".join(f"{k}: {resources[k]:g}" for k in keys) + "}"


class RayResourcePool(ResourcePool):
    """``RayResourcePool([4], use_gpu=True)``: 4 processes on one node, a GPU each.

    ``max_colocate_count`` is how many groups may share one bundle: each actor
    reserves ``1/max_colocate_count`` of its bundle's GPU and CPUs.

    Every pool's placement groups get names of their own (``name_prefix``, then a token
    unique to the pool), so any number of pools, named alike or unnamed, from any number
    of drivers or controller replicas, coexist in one cluster.
    """

    def __init__(
        self,
        process_on_nodes: Sequence[int] | None = None,
        use_gpu: bool = True,
        name_prefix: str | None = None,
        max_colocate_count: int = 10,
        detached: bool = False,
        accelerator_type: str | None = None,
        num_cpus_per_bundle: float = DEFAULT_CPUS_PER_BUNDLE,
        placement_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(process_on_nodes, max_colocate_count)
        if num_cpus_per_bundle < 0:
            raise ValueError(f"num_cpus_per_bundle must be >= 0, got {num_cpus_per_bundle}")
        self.use_gpu = bool(use_gpu)
        self.name_prefix = name_prefix or ""
        #: Makes this pool's placement-group names unique in the cluster.
        self.pool_token = uuid.uuid4().hex[:12]
        self.detached = detached
        self.accelerator_type = accelerator_type
        self.num_cpus_per_bundle = float(num_cpus_per_bundle)
        self.placement_timeout_s = float(placement_timeout_s)
        self.pgs: list[PlacementGroup] | None = None
        #: Per placement group, the bundle that holds local rank 0 (non-zero when the
        #: pool is a slice of a placement group someone else made, e.g. a Serve replica's).
        self.bundle_offsets: list[int] = [0] * len(self._store)
        self._owns_pgs = True

    @classmethod
    def from_placement_group(
        cls,
        pg: PlacementGroup,
        process_count: int,
        first_bundle: int = 0,
        use_gpu: bool = False,
        name_prefix: str | None = None,
        max_colocate_count: int = 10,
    ) -> RayResourcePool:
        """A pool on bundles ``first_bundle .. first_bundle + process_count - 1`` of an
        existing placement group (one node), which the pool never removes. Serve
        deployments use it to run their workers in the replica's own placement group,
        so Serve sees, schedules and releases those resources with the replica."""
        bundles = placement_group_table(pg).get("bundles", {})
        wanted = range(first_bundle, first_bundle + process_count)
        if bundles and any(index not in bundles for index in wanted):
            raise ValueError(
                f"placement group has bundles {sorted(bundles)}, a pool of {process_count} from "
                f"bundle {first_bundle} needs {list(wanted)}"
            )
        cpus = min((bundles.get(i, {}).get("CPU", 0.0) for i in wanted), default=0.0)
        pool = cls(
            [process_count],
            use_gpu=use_gpu,
            name_prefix=name_prefix,
            max_colocate_count=max_colocate_count,
            num_cpus_per_bundle=cpus,
        )
        pool.pgs = [pg]
        pool.bundle_offsets = [first_bundle]
        pool._owns_pgs = False
        return pool

    # -- what each actor asks of its bundle -----------------------------------------
    def bundle(self) -> dict[str, float]:
        bundle: dict[str, float] = {"CPU": self.num_cpus_per_bundle}
        if self.use_gpu:
            bundle["GPU"] = 1.0
        if self.accelerator_type:
            bundle[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return bundle

    def actor_num_cpus(self) -> float:
        return self.num_cpus_per_bundle / self.max_colocate_count

    def actor_num_gpus(self) -> float:
        return 1.0 / self.max_colocate_count if self.use_gpu else 0.0

    # -- placement ------------------------------------------------------------------
    def get_placement_groups(
        self, strategy: str = "STRICT_PACK", name: str | None = None, device_name: str | None = None
    ) -> list[PlacementGroup]:
        """Create (once) and return the placement groups, ordered by node. They are
        named ``<name_prefix>sc_pool_<token>_<count>:<index>`` (or ``<name>_<count>:<index>``
        when ``name`` is given, which the caller then keeps unique). ``device_name`` is
        verl's and changes nothing: bundles take a GPU when the pool ``use_gpu``."""
        if self.pgs is not None:
            return self.pgs
        if not self._store:
            raise ValueError("resource pool has no processes: process_on_nodes is empty")
        self._check_feasible()
        prefix = name or f"{self.name_prefix}sc_pool_{self.pool_token}"
        lifetime = "detached" if self.detached else None
        bundle = self.bundle()

        def entry_group(index: int, count: int, avoid: list[str]) -> PlacementGroup:
            # Ray labels every node with its id: an entry placed after others avoids their nodes.
            selector = [{NODE_ID_LABEL: f"!in({','.join(avoid)})"}] * count if avoid else None
            return placement_group(
                bundles=[dict(bundle) for _ in range(count)],
                strategy=strategy,
                name=f"{prefix}_{count}:{index}",
                lifetime=lifetime,
                bundle_label_selector=selector,
            )

        pgs: list[PlacementGroup] = []
        if self._distinct_nodes_possible():
            # One entry per node: each waits for the ones before it, to know their nodes.
            used: list[str] = []
            for index, count in enumerate(self._store):
                pgs.append(entry_group(index, count, used))
                if not self._wait_placed(pgs[-1:]):
                    self._give_up(pgs)
                used.append(placement_group_table(pgs[-1]).get("bundles_to_node_id", {}).get(0, ""))
        else:
            # Fewer nodes than entries (one machine, say): entries may share a node.
            pgs = [entry_group(index, count, []) for index, count in enumerate(self._store)]
            if not self._wait_placed(pgs):
                self._give_up(pgs)
        self._order_by_node(pgs)
        return self.pgs

    def _wait_placed(self, pgs: list[PlacementGroup]) -> bool:
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=self.placement_timeout_s)
        return len(ready) == len(pgs)

    def _give_up(self, pgs: list[PlacementGroup]) -> None:
        for pg in pgs:
            remove_placement_group(pg)
        raise ResourceUnavailableError(
            f"{self._asked()} could not be placed within {self.placement_timeout_s:g} s; "
            f"{self._cluster_has()}; available now {_fmt(ray.available_resources())} "
            "(other pools or actors may hold the rest)"
        )

    def _distinct_nodes_possible(self) -> bool:
        """Whether the cluster has a node of its own for every entry (by total resources)."""
        if len(self._store) < 2:
            return False
        largest = max(self._store)
        roomy = [n for n in ray.nodes() if n.get("Alive") and self._node_holds(n.get("Resources", {}), largest)]
        return len(roomy) >= len(self._store)

    def _node_holds(self, resources: dict[str, float], count: int) -> bool:
        """Whether a node with these total resources could hold ``count`` bundles."""
        return all(resources.get(k, 0.0) + 1e-9 >= v * count for k, v in self.bundle().items())

    def _order_by_node(self, pgs: list[PlacementGroup]) -> None:
        """Order placement groups (and their process counts) by node address, so ranks
        are numbered node by node."""
        addresses = {n["NodeID"]: n.get("NodeManagerAddress", "") for n in ray.nodes()}

        def node_key(item: tuple[int, PlacementGroup]) -> tuple[str, str, int]:
            index, pg = item
            node_id = placement_group_table(pg).get("bundles_to_node_id", {}).get(0, "")
            return addresses.get(node_id, ""), node_id, index

        order = sorted(enumerate(pgs), key=node_key)
        self.pgs = [pg for _, pg in order]
        self._store = [self._store[index] for index, _ in order]
        self.bundle_offsets = [0] * len(self.pgs)

    def _asked(self) -> str:
        return (
            f"resource pool {self.name_prefix or '(unnamed)'} with process_on_nodes={self._store} "
            f"(bundles of {_fmt(self.bundle())}, one node each entry)"
        )

    def _cluster_has(self) -> str:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        per_node = ", ".join(_fmt(n.get("Resources", {})) for n in nodes)
        return f"the cluster has {_fmt(ray.cluster_resources())} on {len(nodes)} node(s): [{per_node}]"

    def _check_feasible(self) -> None:
        """Fail now when no node could ever hold an entry, or the cluster's total is short."""
        bundle = self.bundle()
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        totals = ray.cluster_resources()
        problems = []
        for key, amount in bundle.items():
            needed = amount * self.world_size
            if totals.get(key, 0.0) + 1e-9 < needed:
                problems.append(f"{needed:g} {key} in all")
        for count in set(self._store):
            if not any(self._node_holds(res, count) for res in nodes):
                problems.append(f"{count} bundles on one node")
        if problems:
            hint = (
                " Use use_gpu=False on a cluster without GPUs."
                if self.use_gpu and not totals.get("GPU")
                else ""
            )
            raise ResourceUnavailableError(
                f"{self._asked()} needs {' and '.join(problems)}, but {self._cluster_has()}.{hint}"
            )

    def bundles(self) -> list[tuple[PlacementGroup, int]]:
        """Every rank's bundle, in rank order: ``(placement group, bundle index)``. Creates
        the placement groups if the pool has none yet."""
        pgs = self.get_placement_groups()
        return [
            (pg, first + local)
            for pg, first, count in zip(pgs, self.bundle_offsets, self._store, strict=True)
            for local in range(count)
        ]

    def remove(self) -> None:
        """Release the placement groups it made (and with them any actor still in them)."""
        for pg in (self.pgs or []) if self._owns_pgs else []:
            try:
                remove_placement_group(pg)
            except Exception:  # already gone with the cluster
                pass
        self.pgs = None


def merge_resource_pool(rp1: RayResourcePool, rp2: RayResourcePool) -> RayResourcePool:
    """A pool spanning both pools' bundles: groups on it share their GPUs with groups on
    ``rp1`` (ranks ``0..n1-1``) and ``rp2`` (the rest)."""
    if rp1.use_gpu != rp2.use_gpu:
        raise ValueError("cannot merge a GPU pool with a CPU pool (use_gpu differs)")
    if rp1.max_colocate_count != rp2.max_colocate_count:
        raise ValueError("cannot merge pools with different max_colocate_count")
    pgs = rp1.get_placement_groups() + rp2.get_placement_groups()
    merged = RayResourcePool(
        rp1.store + rp2.store,
        use_gpu=rp1.use_gpu,
        name_prefix=f"{rp1.name_prefix}_{rp2.name_prefix}",
        max_colocate_count=rp1.max_colocate_count,
        detached=rp1.detached,
        num_cpus_per_bundle=rp1.num_cpus_per_bundle,
    )
    merged.pgs = pgs
    merged.bundle_offsets = rp1.bundle_offsets + rp2.bundle_offsets
    merged._owns_pgs = False  # the parts own them
    return merged


class SubRayResourcePool(RayResourcePool):
    """``subgroup_world_size`` consecutive bundles of another pool, from its
    ``start_bundle_index``-th in rank order (``split_resource_pool`` makes them). A group
    on it has one rank per bundle, and shares each bundle (its GPU) with groups on the
    parent pool. The bundles may span several placement groups (nodes); each span is one
    node entry, so local ranks count within it. It never creates or removes placement
    groups: its parent owns them. ``start_bundle_index`` counts from the first bundle of
    the pool that was split first, so a split of a split knows where it lies."""

    def __init__(self, parent: RayResourcePool, start_bundle_index: int, subgroup_world_size: int) -> None:
        bundles = parent.bundles()
        if not 0 <= start_bundle_index < start_bundle_index + subgroup_world_size <= len(bundles):
            raise ValueError(
                f"a sub-pool of {subgroup_world_size} bundles from bundle {start_bundle_index} does not fit "
                f"in a pool of {len(bundles)}"
            )
        segments: list[list[Any]] = []  # [placement group, first bundle, count]
        for pg, index in bundles[start_bundle_index : start_bundle_index + subgroup_world_size]:
            last = segments[-1] if segments else None
            if last is not None and last[0] is pg and last[1] + last[2] == index:
                last[2] += 1
            else:
                segments.append([pg, index, 1])
        super().__init__(
            [count for _, _, count in segments],
            use_gpu=parent.use_gpu,
            name_prefix=parent.name_prefix,
            max_colocate_count=parent.max_colocate_count,
            detached=parent.detached,
            accelerator_type=parent.accelerator_type,
            num_cpus_per_bundle=parent.num_cpus_per_bundle,
        )
        self.pgs = [pg for pg, _, _ in segments]
        self.bundle_offsets = [first for _, first, _ in segments]
        self._owns_pgs = False
        self.parent = parent
        self.start_bundle_index = getattr(parent, "start_bundle_index", 0) + start_bundle_index
        self.subgroup_world_size = subgroup_world_size


def split_resource_pool(
    resource_pool: RayResourcePool, split_size: int | Sequence[int]
) -> list[SubRayResourcePool]:
    """Cut a pool (or a sub-pool, to split again) into consecutive sub-pools: of
    ``split_size`` bundles each, or of the sizes listed, which must add up to the pool's
    world size. Creates the pool's placement groups if it has none yet. ``ValueError``
    for a size that does not divide the pool or sizes that do not add up."""
    world = resource_pool.world_size
    if isinstance(split_size, (bool, str, bytes)) or not isinstance(split_size, (int, Sequence)):
        raise ValueError(f"split_size is a positive integer or a list of them, got {split_size!r}")
    if isinstance(split_size, int):
        if split_size <= 0 or world % split_size:
            raise ValueError(f"split_size {split_size} does not divide the pool's world size {world}")
        sizes = [split_size] * (world // split_size)
    else:
        sizes = list(split_size)
        if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in sizes):
            raise ValueError(f"split sizes must be positive integers, got {sizes!r}")
        if sum(sizes) != world:
            raise ValueError(f"split sizes {sizes} add up to {sum(sizes)}, not the pool's world size {world}")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [SubRayResourcePool(resource_pool, start, size) for start, size in zip(starts, sizes, strict=True)]


def cluster_gpu_count() -> float:
    """GPUs (real or logical) the connected cluster declares."""
    return float(ray.cluster_resources().get("GPU", 0.0))


def pool_kwargs_for_cluster() -> dict[str, Any]:
    """``use_gpu`` chosen from what the cluster has."""
    return {"use_gpu": cluster_gpu_count() > 0}

"""Multi-node pools on Ray's own multi-node test cluster (two nodes, 2 logical GPUs each).

Run by tests/test_multinode.py in a process of its own (a second cluster cannot share the
test session's process); prints one JSON line of what it saw.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# This script's folder (tests/) holds a package named 'ray' (tests/ray), which would hide
# Ray itself: the repository root takes the folder's place on the path.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import ray  # noqa: E402
import torch  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from single_controller.models.mlp_worker import MLPLayerWorker  # noqa: E402
from single_controller.models.tutorial_workers import GPUAccumulator  # noqa: E402
from single_controller.ray import (  # noqa: E402
    MegatronRayWorkerGroup,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    ResourceUnavailableError,
    merge_resource_pool,
)


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2, num_gpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    out: dict = {"nodes": len([n for n in ray.nodes() if n["Alive"]])}
    try:
        pool = RayResourcePool([2, 2], use_gpu=True, max_colocate_count=4)
        group = RayWorkerGroup(pool, RayClassWithInitArgs(cls=GPUAccumulator))
        info = group.rank_info()
        out["world_size"] = group.world_size
        out["ranks"] = [i["rank"] for i in info]
        out["nodes_by_rank"] = [i["node_id"] for i in info]
        out["local_ranks"] = [i["local_rank"] for i in info]
        out["local_world_sizes"] = [i["local_world_size"] for i in info]
        out["pool_local_rank_list"] = pool.local_rank_list()
        out["pool_local_world_size_list"] = pool.local_world_size_list()
        out["cuda_visible_devices"] = [i["cuda_visible_devices"] for i in info]
        out["add"] = [t.item() for t in group.execute_all_sync("add", x=[1, 1, 1, 1])]

        # a pool per node, merged across the two nodes
        pool_a = RayResourcePool([1], use_gpu=False, name_prefix="na", num_cpus_per_bundle=1.5)
        pool_b = RayResourcePool([1], use_gpu=False, name_prefix="nb", num_cpus_per_bundle=1.5)
        merged = merge_resource_pool(pool_a, pool_b)
        merged_group = RayWorkerGroup(merged, RayClassWithInitArgs(cls=GPUAccumulator))
        merged_info = merged_group.rank_info()
        out["merged_nodes"] = [i["node_id"] for i in merged_info]
        out["merged_local_ranks"] = merged.local_rank_list()
        merged_group.shutdown()
        pool_a.remove()
        pool_b.remove()

        # tp=2 x dp=2: one tensor-parallel group per node
        layer = MegatronRayWorkerGroup(
            pool, RayClassWithInitArgs(cls=MLPLayerWorker),
            default_megatron_kwargs={"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1},
        )
        out["megatron"] = [vars(layer.get_megatron_rank_info(r)) for r in range(layer.world_size)]
        out["megatron_sizes"] = [layer.tp_size, layer.dp_size, layer.pp_size]
        layer.init_model({"hidden_size": 64, "intermediate_size": 128, "hidden_act": "silu", "pretraining_tp": 1})
        shards = layer.get_weights()
        x0, x1 = torch.rand(6, 2, 64), torch.rand(5, 3, 64)
        y0, y1 = layer.run_layer([x0, x1])
        tp_group = [shards[r] for r in range(4) if layer.get_megatron_rank_info(r).dp_rank == 0]
        gate = torch.cat([s["gate_up_proj.weight"].double().chunk(2)[0] for s in tp_group])
        up = torch.cat([s["gate_up_proj.weight"].double().chunk(2)[1] for s in tp_group])
        down = torch.cat([s["down_proj.weight"].double() for s in tp_group], dim=1)

        def ref(x):
            return (torch.nn.functional.silu(x.double() @ gate.T) * (x.double() @ up.T)) @ down.T

        out["megatron_rel_err"] = max(
            float((y.double() - ref(x)).norm() / ref(x).norm()) for x, y in ((x0, y0), (x1, y1))
        )
        layer.shutdown()
        group.shutdown()
        pool.remove()

        try:
            RayResourcePool([3, 3], use_gpu=True, name_prefix="big").get_placement_groups()
            out["oversized_pool"] = "placed"
        except ResourceUnavailableError as exc:
            out["oversized_pool"] = str(exc)
        out.update(uneven_nodes(cluster))
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(out))


def uneven_nodes(cluster: Cluster) -> dict:
    """The same cluster with an 8-CPU node added: a CPU pool [2, 2] whose four bundles any
    one node could hold (Ray's scheduler alone packs both entries on one node), and each
    entry still gets a node of its own."""
    cluster.add_node(num_cpus=8)
    cluster.wait_for_nodes()
    pool = RayResourcePool([2, 2], use_gpu=False, name_prefix="uneven", num_cpus_per_bundle=0.25)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(cls=GPUAccumulator))
    seen = {"uneven_nodes_by_rank": [i["node_id"] for i in group.rank_info()]}
    group.shutdown()
    pool.remove()
    return seen


if __name__ == "__main__":
    main()

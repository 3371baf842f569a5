"""The tutorial's TestActor(x=2) group on a pool of 4: foo, foo_custom (custom
dispatch), foo_rank_zero (rank zero), and the per-rank history used to check ordering."""

from __future__ import annotations

from ray import serve

from deployments.group_controller import GroupSpec
from deployments.served_controller import ServedController, replica_pool
from single_controller.models.tutorial_workers import TestActor
from single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

WORKER_BUNDLES = 4


@serve.deployment(name="test_actor", max_ongoing_requests=256)
class TestActorDeployment(ServedController):
    __test__ = False  # not a pytest class

    def __init__(self, use_gpu: bool = False, request_timeout_s: float = 120.0, x: int = 2) -> None:
        pool = replica_pool(first_bundle=1, process_count=WORKER_BUNDLES, use_gpu=use_gpu)
        spec = GroupSpec(
            "test_actor",
            lambda: RayWorkerGroup(pool, RayClassWithInitArgs(TestActor, x=x)),
            TestActor,
            "pool [4]",
            read_only=frozenset({"foo", "foo_custom", "foo_rank_zero", "history", "echo", "checksum"}),
        )
        super().__init__([spec], request_timeout_s=request_timeout_s)

    async def handle_io_spec(self, group: str, method: str) -> dict:
        """Two inference models: ``echo`` (FP32 ``x`` of any 3-D shape back as ``y``) and
        ``checksum`` (its float64 sum as FP64 ``y`` of shape [1])."""
        x = {"name": "x", "datatype": "FP32", "shape": [-1, -1, -1]}
        if method == "echo":
            return {"inputs": [x], "outputs": [{**x, "name": "y"}]}
        if method == "checksum":
            return {"inputs": [x], "outputs": [{"name": "y", "datatype": "FP64", "shape": [1]}]}
        return {}

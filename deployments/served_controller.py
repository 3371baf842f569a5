"""Where a GroupController meets Ray Serve: async entry points for the ingress's
handle calls, Serve's health check, and release of the workers on shutdown."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

from deployments.group_controller import GroupController
from single_controller.ray import RayResourcePool

# Tensors from the ingress arrive zero-copy, read-only (deployments.application's
# INGRESS_RUNTIME_ENV); the controller only reads and forwards them, so torch's warning
# about non-writable arrays says nothing here.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", module="ray._private")

#: Threads for blocking calls per controller replica (beyond max_ongoing_requests they queue).
CALL_THREADS = 64


def replica_pool(
    first_bundle: int, process_count: int, use_gpu: bool, name_prefix: str | None = None
) -> RayResourcePool:
    """A pool on the replica's own placement group when Serve gave it one (the deployment
    declared ``placement_group_bundles``), else a pool with placement groups of its own."""
    pg = ray.util.get_current_placement_group()
    if pg is None:
        return RayResourcePool([process_count], use_gpu=use_gpu, name_prefix=name_prefix)
    return RayResourcePool.from_placement_group(
        pg, process_count, first_bundle=first_bundle, use_gpu=use_gpu, name_prefix=name_prefix
    )


class ServedController(GroupController):
    """Base of the Serve deployments. Blocking work runs in a thread pool of its own, so
    a slow call never stalls the replica's event loop (or its health check), and calls
    waiting on one group never use up the threads other groups need."""

    def _run(self, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        if not hasattr(self, "_executor"):
            self._executor = ThreadPoolExecutor(max_workers=CALL_THREADS, thread_name_prefix="controller")
        return asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def handle_call(
        self, group: str, method: str, args: list, kwargs: dict, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        outcome = await self._run(self.call, group, method, tuple(args), kwargs, idempotency_key)
        return dict(vars(outcome))  # shallow: outputs may be hundreds of MiB

    async def handle_io_spec(self, group: str, method: str) -> dict[str, Any]:
        """Input and output tensors of a group's method served as an inference model
        (none here)."""
        return {}

    async def handle_describe(self) -> list[dict[str, Any]]:
        return await self._run(self.describe)

    async def handle_describe_group(self, group: str) -> dict[str, Any] | None:
        return await self._run(self.describe_group, group)

    async def handle_ready(self) -> dict[str, bool]:
        return self.ready()

    async def check_health(self) -> None:
        """Serve's health check: ping every worker (with a timeout); a group that does not
        answer is rebuilt in the background. The replica itself stays up, so the other
        groups keep serving."""
        await self._run(self.check_groups)

    def __del__(self) -> None:
        self.shutdown()

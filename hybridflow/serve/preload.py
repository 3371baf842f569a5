"""What a replica imports in its constructor, before it serves requests.

The batch types (TensorDict, and DataProto's module) cost a second or more of CPU to
import the first time (tensordict imports torch._dynamo), and that import holds the GIL
for long stretches even in a thread of its own. Imported lazily, the first request that
carries a batch would pay it while the replica's event loop waits, its health checks
and every other request with it. The jobs replica, which starts torch-free and only
passes batches through, does not call this.
"""

from __future__ import annotations


def load_batch_types() -> None:
    """Import the batch types now: call it in a replica's constructor."""
    import single_controller.protocol  # noqa: F401 - and tensordict with it
    import single_controller.tensordict_utils  # noqa: F401

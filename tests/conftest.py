"""One Ray cluster for the whole test session: worker processes import torch and take
seconds each to start, so tests share the cluster and, where they can, the groups."""

from __future__ import annotations

import gc
import os
import sys

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# torch looks up out-of-tree device backends (entry points of every installed package) at
# import: 0.15 CPU-s of the 1.3 each of the suite's few hundred processes spends importing
# torch, for backends (NPU, HPU, ...) the tests never use. Inherited by the Ray workers and
# the serve runs the tests start.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

#: Logical GPUs the test cluster declares, so GPU scheduling and sharing run on CPU.
TEST_CLUSTER_GPUS = 8
TEST_CLUSTER_CPUS = 4


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",  # never attach to a cluster another test or a user started
            num_cpus=TEST_CLUSTER_CPUS,
            num_gpus=TEST_CLUSTER_GPUS,
            include_dashboard=False,
            log_to_driver=False,
            namespace="single_controller_tests",
        )
    yield ray
    # Ray ends the process (exit 1, nothing printed) when any thread touches it after
    # ray.shutdown(): a handle's destructor, or a start thread a controller left running
    # on a call that only returns at shutdown. So the cluster stays up until pytest has
    # written its report and summary, and goes down last (pytest_unconfigure).
    _SESSION_CLUSTER.append(ray)


#: The session's Ray cluster, shut down by pytest_unconfigure.
_SESSION_CLUSTER: list = []
_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


def pytest_unconfigure(config):
    if not _SESSION_CLUSTER:
        return
    ray = _SESSION_CLUSTER.pop()
    gc.collect()  # garbage holding Ray handles goes while Ray is up
    ray.shutdown()
    # Nothing may touch Ray from here: end the process with pytest's own status at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_STATUS[-1] if _EXIT_STATUS else 0)


@pytest.fixture
def no_global_padding():
    """DataProto auto padding off process-wide for the test (restored after), so each
    DataProto's own flag decides."""
    from single_controller.protocol import DataProtoConfig

    before = DataProtoConfig.auto_padding
    DataProtoConfig.auto_padding = False
    yield
    DataProtoConfig.auto_padding = before


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium (tests/browser.py): the test skips without it, or fails under
    HYBRIDFLOW_REQUIRE_SYSTEM_DEPS=1."""
    from tests.browser import chromium

    with chromium() as opened:
        yield opened


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "own_cluster: the test starts a Ray cluster (a `serve run`) of its own instead of using the session's; "
        "`make test` runs these beside the others",
    )
    config.addinivalue_line(
        "markers",
        "fresh_start: the module reads the services it uses as a fresh start leaves them (the README's answers): "
        "it runs before the other modules on the same services, and resets the groups it calls where they are not",
    )

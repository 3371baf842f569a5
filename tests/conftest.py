"""One Ray cluster for the whole test session: worker processes import torch and take
seconds each to start, so tests share the cluster and, where they can, the groups."""

from __future__ import annotations

import os

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
    ray.shutdown()


@pytest.fixture
def no_global_padding():
    """DataProto auto padding off process-wide for the test (restored after), so each
    DataProto's own flag decides."""
    from single_controller.protocol import DataProtoConfig

    before = DataProtoConfig.auto_padding
    DataProtoConfig.auto_padding = False
    yield
    DataProtoConfig.auto_padding = before


@pytest.fixture(scope="session")
def service(tmp_path_factory):
    """`serve run serve_config.yaml` as a user would start it, shared by the session
    (its cold start is the most expensive step of the suite), with fresh state in a file
    of its own (not the checkout's .hybridflow/state.db)."""
    from tests.serve_process import ServeProcess

    # Ray exports recorded metrics every 10 s by default; every 2 s here, so the tests that
    # wait for a metric to show wait less (the service is otherwise as shipped).
    proc = ServeProcess(
        state_path=tmp_path_factory.mktemp("service-state") / "state.db",
        env={"RAY_metrics_report_interval_ms": "2000"},
    ).start()
    try:
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def http(service):
    import httpx

    # A module before this one may have left groups rebuilding (a killed worker or replica):
    # every module starts on a service whose groups all serve.
    service.wait_ready(timeout_s=300)
    with httpx.Client(base_url=service.url, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium (tests/browser.py): the test skips without it, or fails under
    SC_REQUIRE_SYSTEM_DEPS=1."""
    from tests.browser import chromium

    with chromium() as opened:
        yield opened

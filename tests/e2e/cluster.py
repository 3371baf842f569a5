"""Reaching a ``serve run``'s own Ray cluster from a test: with Ray's API through the
driver attached to it (tests/cluster_driver.py: the test process may hold a Ray cluster
of its own), and its metrics as Prometheus scrapes them from every node's metrics
endpoint."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.serve_app import ServeApp
from tests.serve_process import ServeProcess


def kill_actor(service: ServeProcess | ServeApp, namespace: str, name: str) -> None:
    """Kill a named actor of the service's cluster (a worker, as a crash would)."""
    service.driver().request("kill", namespace, name)


def kill_replica(service: ServeProcess | ServeApp, deployment: str) -> str:
    """Kill the one Serve replica of ``deployment`` (as a crash would); its actor name."""
    return service.driver().request("kill_replica", service.app_name, deployment)


def replicas(service: ServeProcess | ServeApp, deployment: str | None = None) -> list[str]:
    """The actor names of Serve's replicas of the service's application (of one deployment
    if named), from Ray's actor list."""
    return service.driver().request("replicas", service.app_name, deployment)


def wait_until_noticed(client: httpx.Client, group: str, probe: str, rebuilds: int, timeout_s: float = 30) -> bool:
    """Call the read-only method ``probe`` of a group whose worker was killed until the
    group shows it noticed: a 503 with Retry-After, or a rebuild count above ``rebuilds``
    (the rebuild takes seconds and can be over before the first probe, since the kill's own
    process takes seconds to exit). Returns whether it answered 503."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = client.post(f"/v1/groups/{group}/{probe}", json={})
        if answer.status_code != 200:
            assert answer.status_code == 503 and answer.headers.get("retry-after"), answer.text
            return True
        if client.get(f"/v1/groups/{group}").json()["rebuilds"] > rebuilds:
            return False
        time.sleep(0.1)
    raise AssertionError(f"{group} never noticed its dead worker within {timeout_s:g} s")


def wait_until_ready(client: httpx.Client, groups: list[str], timeout_s: float = 60) -> None:
    """Wait until every one of ``groups`` reports status ready."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(client.get(f"/v1/groups/{g}").json()["status"] == "ready" for g in groups):
            return
        time.sleep(0.5)
    raise AssertionError(f"{groups} were not ready again within {timeout_s:g} s")


def metrics_endpoints(service: ServeProcess | ServeApp) -> list[str]:
    """Every live node's Prometheus endpoint (``MetricsExportPort`` in ``ray.nodes()``)."""
    return service.driver().request("metrics_endpoints")


#: The Serve application whose metrics the tests read (serve_config.yaml's): the session's
#: cluster serves others beside it, whose series carry the same names.
SHIPPED_APPLICATION = "hybridflow"


class Samples:
    """One scrape of every endpoint: samples by name, each with its labels, those of one
    Serve application (and those of no application, such as a node's)."""

    def __init__(self, endpoints: list[str], application: str = SHIPPED_APPLICATION) -> None:
        self.samples: list[tuple[str, dict[str, str], float]] = []
        for url in endpoints:
            text = httpx.get(url, timeout=30).text
            for family in text_string_to_metric_families(text):
                self.samples.extend((s.name, s.labels, s.value) for s in family.samples
                                    if s.labels.get("application", application) == application)

    def matching(self, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
        return [
            (found, value)
            for sample, found, value in self.samples
            if sample == name and all(found.get(key) == wanted for key, wanted in labels.items())
        ]

    def total(self, name: str, **labels: str) -> float:
        """The sum over every series of ``name`` with these labels (replicas, workers); 0 when none."""
        return sum(v for _, v in self.matching(name, **labels))


def scrape_until(endpoints: list[str], done: Callable[[Samples], bool], timeout_s: float = 60.0,
                 application: str = SHIPPED_APPLICATION) -> Samples:
    """Scrape ``application``'s metrics until ``done`` holds: Ray exports what a process
    recorded every few seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = Samples(endpoints, application)
        if done(samples):
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"the metrics did not show it within {timeout_s:g} s")
        time.sleep(1)


def _named_application(application: str):
    """A gRPC client interceptor adding ``application: <name>`` to every call's metadata."""
    import collections

    import grpc

    fields = ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")

    class Details(collections.namedtuple("Details", fields), grpc.ClientCallDetails):
        pass

    class NamedApplication(grpc.UnaryUnaryClientInterceptor):
        def intercept_unary_unary(self, continuation, details, request):
            metadata = [*(details.metadata or ()), ("application", application)]
            named = Details(details.method, details.timeout, metadata, details.credentials,
                            getattr(details, "wait_for_ready", None), getattr(details, "compression", None))
            return continuation(named, request)

    return NamedApplication()


def triton_grpc(address: str, application: str = SHIPPED_APPLICATION):
    """A ``tritonclient.grpc`` client whose calls name ``application``: Serve's gRPC proxy
    routes by it when the cluster serves several applications (with one, it needs none)."""
    import grpc
    from tritonclient.grpc import InferenceServerClient, service_pb2_grpc

    client = InferenceServerClient(address)
    channel = grpc.intercept_channel(client._channel, _named_application(application))
    client._client_stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    return client

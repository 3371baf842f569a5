"""Another application of this service in the Ray cluster of a running ``serve run``: the
end-to-end tests that need other settings than ``serve_config.yaml``'s (a token, other
limits, other groups) share the session service's cluster instead of starting one of
their own. Each is deployed with ``serve.run(build(args), name=..., route_prefix=...)``
from the driver attached to that cluster (tests/cluster_driver.py), answers under
``/<name>`` on the same port, and is deleted with ``serve.delete`` after its last test.
"""

from __future__ import annotations

import time
from typing import Any

import yaml

from tests.cluster_driver import ClusterDriver
from tests.serve_process import CONFIG, ServeProcess, answers_200


def shipped_args() -> dict[str, Any]:
    """serve_config.yaml's application ``args``."""
    return yaml.safe_load(CONFIG.read_text())["applications"][0]["args"]


class ServeApp:
    """An application named ``name`` (its ``args`` as serve_config.yaml's application takes
    them) in ``host``'s cluster, answering at ``host.url/name``."""

    def __init__(self, host: ServeProcess, name: str, args: dict[str, Any]) -> None:
        self.host = host
        self.name = name
        self.args = args
        self.url = f"{host.url}/{name}"
        self.app_name = name
        self.deployed = False

    @property
    def grpc_address(self) -> str | None:
        """The cluster's gRPC proxy; a call names this application in its ``application``
        metadata (Serve routes gRPC by it when a cluster serves several)."""
        return self.host.grpc_address

    def gcs_address(self) -> str:
        return self.host.gcs_address()

    def driver(self) -> ClusterDriver:
        return self.host.driver()

    def deploy(self) -> ServeApp:
        """Deploy it (not waiting for its groups: :meth:`wait_ready`)."""
        if not self.deployed:
            self.driver().request("deploy", self.name, self.args)
            self.deployed = True
        return self

    def wait_ready(self, timeout_s: float = 600.0, ready_path: str = "/readyz") -> ServeApp:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if answers_200(f"{self.url}{ready_path}"):
                return self
            time.sleep(0.5)
        raise TimeoutError(f"application {self.name} not ready within {timeout_s:g} s:\n{self.host.tail()}")

    def start(self, timeout_s: float = 600.0) -> ServeApp:
        return self.deploy().wait_ready(timeout_s)

    def kill(self) -> None:
        """Delete the application (its replicas, and with them its workers)."""
        if self.deployed and self.host.proc is not None and self.host.proc.poll() is None:
            self.deployed = False
            self.driver().request("delete", self.name)

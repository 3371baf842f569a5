"""One Ray driver attached to a running ``serve run``'s cluster, kept for the life of that
cluster, through which the tests reach it with Ray's API: deploy and delete applications,
list Serve's replicas, kill actors, read every node's metrics endpoint. The test process
may hold a Ray cluster of its own, so the driver is a subprocess; one per cluster, since
a driver's start (Python, Ray, the service's modules) costs more CPU than the operations
a test asks of it.

The driver reads one JSON request per line on stdin and answers one line on stdout,
marked with ``ANSWER`` (Ray itself may print to stdout too).
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ANSWER = "@@cluster-driver@@ "

DRIVER = """
import json, sys, traceback
import ray
from ray import serve
from ray.util import list_named_actors

ANSWER = sys.argv[2]
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)


def replicas(app, deployment=None):
    # Serve names a replica's actor SERVE_REPLICA::<app>#<deployment>#<id>.
    prefix = "SERVE_REPLICA::" + app + "#" + ("" if deployment is None else deployment + "#")
    return sorted((a["name"], a["namespace"]) for a in list_named_actors(all_namespaces=True)
                  if a["name"].startswith(prefix) and a["name"].count("#") == 2)


def kill(namespace, name):
    ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)


def kill_replica(app, deployment):
    found = replicas(app, deployment)
    if len(found) != 1:
        raise RuntimeError(f"{len(found)} replicas of {app}#{deployment}: {found}")
    name, namespace = found[0]
    kill(namespace, name)
    return name


def metrics_endpoints():
    return [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics" for n in ray.nodes() if n["Alive"]]


def deploy(name, args):
    from hybridflow.serve.application import build
    serve.run(build(args), name=name, route_prefix="/" + name, blocking=False)


OPS = {"replicas": lambda app, deployment=None: [n for n, _ in replicas(app, deployment)], "kill": kill,
       "kill_replica": kill_replica, "metrics_endpoints": metrics_endpoints, "deploy": deploy,
       "delete": serve.delete}

for line in sys.stdin:
    request = json.loads(line)
    try:
        answer = {"result": OPS[request["op"]](*request["args"])}
    except Exception:
        answer = {"error": traceback.format_exc()[-3000:]}
    print(ANSWER + json.dumps(answer), flush=True)
"""


class ClusterDriver:
    """The driver subprocess of the cluster at ``gcs_address`` (started at once)."""

    def __init__(self, gcs_address: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER, gcs_address, ANSWER], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, bufsize=1)
        self._answers: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(ANSWER):
                self._answers.put(line[len(ANSWER):])
        self._answers.put(None)  # the driver exited

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self._stderr = [*self._stderr[-40:], line]

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def request(self, op: str, *args: Any, timeout_s: float = 300) -> Any:
        """Run ``op`` in the driver; its result, or RuntimeError with the driver's traceback."""
        with self._lock:
            self.proc.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
            self.proc.stdin.flush()
            try:
                line = self._answers.get(timeout=timeout_s)
            except queue.Empty:
                self.close()
                raise TimeoutError(f"the cluster driver did not answer {op} within {timeout_s:g} s") from None
        if line is None:
            raise RuntimeError(f"the cluster driver exited during {op}:\n{''.join(self._stderr)}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"{op} failed in the cluster driver:\n{answer['error']}")
        return answer["result"]

    def close(self) -> None:
        if self.alive:
            self.proc.kill()
        self.proc.wait(timeout=30)

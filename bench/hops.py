"""Where the milliseconds of an HTTP call go, read from Serve's and Ray's own records.

Each request carries an ``X-Request-Id`` that Serve writes on its access-log line in
the proxy, in the ingress replica and in the controller replica (with the time each
spent on it); Ray's timeline (task events, ``ray.timeline``) has every rank's execution
of the method. For one request, the differences are the hops:

    client - proxy          HTTP client and the proxy's own HTTP server (uvicorn)
    proxy - ingress         the proxy's routing and its hop to the ingress replica
    ingress - controller    the ingress's route (body, table, answer) and the handle hop
    controller - workers    the controller's own work and the group call's Ray hops
    workers                 first rank's start to last rank's end (the method itself)

``python -m bench.hops`` compares Serve's transport settings on a small service (the
4-rank accumulator and a no-op app, one ``serve run`` per setting).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.serve_process import ROOT, ServeProcess

#: ``... <request id> -- POST /v1/groups/{group}/{method} 200 12.3ms`` (proxy and replicas).
ACCESS_LINE = re.compile(r" (?P<rid>[0-9a-f-]{36}) -- (?P<what>.+) (?P<status>\S+) (?P<ms>[0-9.]+)ms$")


def access_latencies(session_dir: Path, request_ids: set[str]) -> dict[str, dict[str, float]]:
    """``{component: {request id: ms}}`` from the Serve access logs of one session;
    components are ``proxy`` and the replicas' deployment names."""
    found: dict[str, dict[str, float]] = defaultdict(dict)
    for path in (session_dir / "logs" / "serve").glob("*.log"):
        name = path.name
        if name.startswith("proxy_"):
            component = "proxy"
        elif name.startswith("replica_"):
            component = name[len("replica_"):].rsplit("_", 1)[0]
        else:
            continue
        for line in path.read_text(errors="replace").splitlines():
            match = ACCESS_LINE.search(line)
            if match and match["rid"] in request_ids:
                found[component][match["rid"]] = float(match["ms"])
    return found


def worker_spans(gcs_address: str, method: str, since_us: float, ranks: int = 4) -> list[float]:
    """Ms from the first rank's start to the last rank's end of each call of ``method``
    (the timeline names an actor task by its method) since ``since_us``, from Ray's
    timeline. Calls are told apart by time: a call's ranks start before the next call's."""
    import ray

    ray.init(address=gcs_address, log_to_driver=False)
    try:
        with tempfile.NamedTemporaryFile(suffix=".json") as handle:
            ray.timeline(filename=handle.name)
            events = json.loads(Path(handle.name).read_text())
    finally:
        ray.shutdown()
    if os.environ.get("HOPS_TIMELINE_DUMP"):
        Path(os.environ["HOPS_TIMELINE_DUMP"]).write_text(json.dumps(events[-200:], indent=1))
    runs = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        for e in events
        if e.get("ph") == "X" and e.get("name") == method and float(e["ts"]) >= since_us
    )
    spans, group = [], []
    for start, end in runs:
        group.append((start, end))
        if len(group) == ranks:
            spans.append((max(e for _, e in group) - min(s for s, _ in group)) / 1e3)
            group = []
    return spans


def breakdown(proc: ServeProcess, http: httpx.Client, path: str, body: dict | bytes, deployments: dict[str, str],
              worker_method: str | None, n: int, headers: dict[str, str] | None = None,
              ranks: int = 4) -> dict[str, Any]:
    """Send ``n`` calls of ``path`` with request ids, then split their p50 by hop.
    ``deployments`` names the ingress and controller deployments' log names; ``body`` is
    sent as JSON, or as it is when bytes (with ``headers``)."""
    ids, client_ms = [], []
    since_us = time.time() * 1e6
    for _ in range(n):
        rid = str(uuid.uuid4())
        start = time.perf_counter()
        sent = {"content": body} if isinstance(body, bytes) else {"json": body}
        response = http.post(path, **sent, headers={**(headers or {}), "X-Request-Id": rid})
        client_ms.append((time.perf_counter() - start) * 1e3)
        response.raise_for_status()
        ids.append(rid)
    time.sleep(2)  # Serve's log handlers and Ray's task events flush on their own
    logs = access_latencies(proc.session_dir(), set(ids))
    out: dict[str, Any] = {"client_ms": statistics.median(client_ms), "requests": n}
    for label, component in (("proxy", "proxy"), *deployments.items()):
        seen = list(logs.get(component, {}).values())
        out[f"{label}_ms"] = statistics.median(seen) if seen else None
        out[f"{label}_logged"] = len(seen)
    if worker_method is not None:
        try:
            spans = worker_spans(proc.gcs_address(), worker_method, since_us, ranks)
            out["workers_ms"] = statistics.median(spans) if spans else None
            out["workers_logged"] = len(spans)
        except Exception as exc:  # the timeline is a diagnosis: report, do not fail
            out["workers_error"] = f"{type(exc).__name__}: {exc}"
    chain = ["client", "proxy", *deployments, "workers"]
    for outer, inner in zip(chain, chain[1:], strict=False):
        if out.get(f"{outer}_ms") is not None and out.get(f"{inner}_ms") is not None:
            out[f"{outer}_minus_{inner}_ms"] = out[f"{outer}_ms"] - out[f"{inner}_ms"]
    return out


# -- Serve's transport settings, compared ------------------------------------------------

#: Each setting is the environment of its own ``serve run`` (Serve reads these at import in
#: every process it starts), on top of the shipped path (tests/serve_process.py, which
#: gives each run HAProxy files and ports of its own). One is a setting of the application
#: instead (``CONFIG_SETTINGS``).
SETTINGS: dict[str, dict[str, str]] = {
    "default (controllers in the ingress, HAProxy in front)": {},
    "Serve's Python proxy in place of HAProxy": {"RAY_SERVE_ENABLE_HA_PROXY": "0"},
    "controllers in replicas of their own (controllers_in_ingress: false)": {},
    "user code and router on the replica's loop": {
        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    },
    "gRPC between deployments": {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"},
    "throughput optimized (Serve's proxy)": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "0",
                                             "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"},
}


#: Settings that are the application's args rather than Serve's environment.
CONFIG_SETTINGS: dict[str, dict[str, Any]] = {
    "controllers in replicas of their own (controllers_in_ingress: false)": {"controllers_in_ingress": False},
}


def small_config(directory: Path, args: dict[str, Any] | None = None) -> Path:
    """serve_config.yaml with only the 4-rank accumulator, plus the no-op app at /noop."""
    document = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    app = document["applications"][0]
    app["args"].update(args or {})
    app["args"]["deployments"] = [{
        "name": "accumulators",
        "groups": [g for d in app["args"]["deployments"] for g in d["groups"] if g["name"] == "gpu_accumulator"],
    }]
    document["applications"].append({"name": "noop", "route_prefix": "/noop", "import_path": "bench.noop_app:app"})
    path = directory / "hops_config.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def compare_settings(n: int, names: list[str], rounds: int = 5) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir=ROOT / "bench" / "results") as scratch:
        directory = Path(scratch)
        for name, env in SETTINGS.items():
            if names and name not in names:
                continue
            config = small_config(directory, CONFIG_SETTINGS.get(name))  # ServeProcess removes it when it stops
            proc = ServeProcess(config=config, env=env)
            start = time.perf_counter()
            try:
                proc.start(timeout_s=600, ready_path="/readyz")
                entry: dict[str, Any] = {"ready_s": time.perf_counter() - start}
                with httpx.Client(base_url=proc.url, timeout=60) as http:
                    adds, noops = [], []
                    add = {"kwargs": {"x": [1, 1, 1, 1]}}
                    for _ in range(rounds):  # interleaved, so machine noise hits both alike
                        for samples, path, body in ((adds, "/v1/groups/gpu_accumulator/add", add),
                                                    (noops, "/noop/call", {"kwargs": {"x": 1}})):
                            for _ in range(n // rounds):
                                t = time.perf_counter()
                                http.post(path, json=body).raise_for_status()
                                samples.append((time.perf_counter() - t) * 1e3)
                    entry["add_p50_ms"] = statistics.median(adds)
                    entry["noop_p50_ms"] = statistics.median(noops)
                    entry["add_over_noop_ms"] = entry["add_p50_ms"] - entry["noop_p50_ms"]
                    logged = {"ingress": "hybridflow_ingress"}
                    if CONFIG_SETTINGS.get(name, {}).get("controllers_in_ingress") is False:
                        logged["controller"] = "hybridflow_accumulators"  # else the ingress is the controller
                    entry["hops"] = breakdown(
                        proc, http, "/v1/groups/gpu_accumulator/add", add, logged,
                        "add", n // 2,
                    )
            except Exception as exc:
                entry = {"error": f"{type(exc).__name__}: {exc}", "log": proc.tail(20)}
            finally:
                proc.kill()
            results[name] = entry
            print(name, json.dumps(entry, indent=1), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=200, help="calls per figure")
    parser.add_argument("settings", nargs="*", help=f"which of {list(SETTINGS)} (default: all)")
    options = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    results = compare_settings(options.n, options.settings)
    out = ROOT / "bench" / "results" / "serve_settings.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

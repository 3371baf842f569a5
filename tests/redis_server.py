"""A real redis-server for the tests (the state store's shared backend): on a free port,
its files in a temp dir, append-only file on; started, SIGKILLed and started again by
the tests, only this process, by its pid. Missing redis-server skips the test, or fails
it when HYBRIDFLOW_REQUIRE_SYSTEM_DEPS=1."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

from hybridflow.config.environment import setting
from single_controller.rendezvous import free_port


class RedisServer:
    def __init__(self, binary: str, directory: Path) -> None:
        self.binary, self.directory = binary, directory
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, appendonly: bool = True) -> RedisServer:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--appendonly", "yes" if appendonly else "no", "--appendfsync", "always", "--save", "",
             "--daemonize", "no", "--logfile", str(self.directory / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        deadline = time.monotonic() + 15
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"redis-server did not start on port {self.port}:\n{log}") from None
                time.sleep(0.05)
        client.close()
        return self

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL: no shutdown save, only what the append-only file holds
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        message = "redis-server is not installed (Debian: apt-get install -y redis-server)"
        if setting("HYBRIDFLOW_REQUIRE_SYSTEM_DEPS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return binary


def start_redis(directory: Path) -> RedisServer:
    """A started server (skips or fails the calling test when there is no redis-server)."""
    return RedisServer(redis_binary(), directory).start()

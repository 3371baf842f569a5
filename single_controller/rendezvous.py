"""Rendezvous address and port for torch.distributed; imports nothing heavy, because a
Ray task runs it in a fresh process before any worker of the group exists."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port() -> int:
    """A TCP port free on this host right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


#: Rendezvous ports are drawn from here up to the kernel's ephemeral range: above Ray's
#: worker ports (10002-19999 by default), and out of the range that every outgoing
#: connection (Ray's gRPC channels among them) takes a port from. A port the OS picked as
#: free (``free_port``) lies in that range and could be taken between the pick and rank
#: 0's listen, which failed a group's start with EADDRINUSE.
RENDEZVOUS_PORT_LOW = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the IANA range's start
        return 49152


def rendezvous_port(attempts: int = 64) -> int:
    """A port free on this host now, outside the kernel's ephemeral range when it leaves
    room below it (else any free port)."""
    high = _ephemeral_low()
    if high - RENDEZVOUS_PORT_LOW >= 1000:
        for _ in range(attempts):
            port = random.randrange(RENDEZVOUS_PORT_LOW, high)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("", port))
                except OSError:  # in use: draw another
                    continue
            return port
    return free_port()


def node_ip_address() -> str:
    """This node's address as Ray reports it, or loopback outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # no usable Ray here: a plain process on this host
        pass
    return "127.0.0.1"


def pick_rendezvous() -> tuple[str, int]:
    """``(MASTER_ADDR, MASTER_PORT)`` for a group whose rank 0 runs on this node."""
    return node_ip_address(), rendezvous_port()

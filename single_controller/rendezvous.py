"""Rendezvous address and port for torch.distributed; imports nothing heavy, because a
Ray task runs it in a fresh process before any worker of the group exists."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on this host right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


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
    return node_ip_address(), free_port()

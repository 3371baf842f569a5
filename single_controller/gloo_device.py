"""One gloo transport device per process, shared by every gloo process group it makes.

Torch gives each gloo process group a device of its own, and each device runs a loop
thread that wakes every 10 ms while nothing is sent. megatron-core makes about twenty
groups per rank (on CPU every one of them is gloo; on GPU its ``*_gloo`` groups are), so
an idle rank spends most of its CPU in those wakeups. gloo carries any number of groups
over one device, each group keeping its own connections, so sharing changes the thread
count and nothing else.
"""

from __future__ import annotations

import atexit
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_device: Any = None


def _gloo_class() -> type | None:
    gloo = getattr(dist, "ProcessGroupGloo", None)
    options = getattr(gloo, "_Options", None)
    if gloo is None or options is None or not hasattr(gloo, "create_default_device"):
        return None  # a torch built without gloo, or without the options this needs
    return gloo


def shared_device() -> Any:
    """This process's gloo device, made on first use."""
    global _device
    gloo = _gloo_class()
    if gloo is None:
        raise RuntimeError("this torch has no gloo backend with device options")
    if _device is None:
        _device = gloo.create_default_device()
        atexit.register(_release_device)
    return _device


def _release_device() -> None:
    # Once the groups are destroyed this reference is the device's last: let it go (and
    # join its loop thread) while the interpreter is whole. A device still alive when the
    # process exits may abort it ("terminate called without an active exception"), as
    # torch's own per-group devices do when their groups are never destroyed.
    global _device
    _device = None


def gloo_options(timeout: timedelta) -> Any:
    """Options for a ``ProcessGroupGloo`` built by hand: the shared device, ``timeout``."""
    device = shared_device()  # raises where this torch has no such options
    options = dist.ProcessGroupGloo._Options()
    options._devices = [device]
    options._timeout = timeout
    return options


def share_gloo_device() -> bool:
    """From now on, the gloo groups torch makes in this process (``init_process_group``,
    ``new_group``, megatron-core's groups) share :func:`shared_device`. Call it before
    the groups are made; calling it again does nothing. False where this torch lacks what
    it needs (the groups then keep a device each, as before)."""
    gloo = _gloo_class()
    if gloo is None:
        return False
    if getattr(c10d.ProcessGroupGloo, "_shares_device", False):
        return True

    class SharedDeviceGloo(gloo):
        """Torch's gloo group, on the process's shared device unless given options."""

        _shares_device = True

        def __init__(self, store: Any, rank: int, size: int, timeout: Any = c10d.default_pg_timeout) -> None:
            if not isinstance(timeout, gloo._Options):
                timeout = gloo_options(timeout)
            super().__init__(store, rank, size, timeout)

    # torch builds its gloo groups through this module-level name.
    c10d.ProcessGroupGloo = SharedDeviceGloo
    return True

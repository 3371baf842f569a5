"""megatron.core imported without the compiler it does not need yet.

megatron-core decorates its fused kernels with ``torch.compile`` when its package is
imported, and ``torch.compile`` imports TorchDynamo and Inductor on the spot: most of the
import's CPU time, paid by every rank process though the parallel layers and process
groups never call those kernels. :func:`import_megatron_core` imports the package with
``torch.compile`` deferred to each decorated function's first call, which then compiles
it exactly as ``torch.compile`` would have.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

_lock = threading.Lock()


def deferred_compile(compile_now: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for ``compile_now`` (``torch.compile``) that takes the same arguments,
    as a call or as a decorator, and for a plain function returns a wrapper that calls
    ``compile_now`` on the first call and the compiled function from then on. Anything
    else (a module) is compiled at once."""

    def compile_later(model: Any = None, **options: Any) -> Any:
        if model is None:
            return lambda fn: compile_later(fn, **options)
        if not inspect.isfunction(model):
            return compile_now(model, **options)
        compiled: Callable[..., Any] | None = None

        @functools.wraps(model)
        def compiles_on_first_call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(model, **options)
            return compiled(*args, **kwargs)

        return compiles_on_first_call

    return compile_later


def import_megatron_core() -> ModuleType:
    """``megatron.core``, imported (once per process) with ``torch.compile`` deferred
    for the functions it decorates; ``torch.compile`` itself is left as it was."""
    with _lock:
        if "megatron.core" not in sys.modules:
            import torch

            real = torch.compile
            torch.compile = deferred_compile(real)
            try:
                importlib.import_module("megatron.core")
            finally:
                torch.compile = real
    return sys.modules["megatron.core"]

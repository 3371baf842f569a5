"""How a rank's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...) reaches its actor.

A ``runtime_env`` with ``env_vars`` would set the variables before Python starts, but Ray
starts a worker process with a runtime_env through its ``setup_worker`` (one Python
start more per rank) and never hands it one of the idle workers it
prestarts. So a group starts each rank from a subclass of the worker class whose
``__init__`` first puts the rank's variables into ``os.environ`` (and has a ``Worker`` read
its place from them again) and then runs the class's own ``__init__``: the worker's code
sees the same environment it would have had from a runtime_env, and so do the processes
it starts.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

import ray

from single_controller.base.worker_methods import user_class

#: The constructor keyword that carries a rank's environment (removed before the class sees it).
RANK_ENV_KWARG = "_single_controller_rank_env"
#: "1" in a rank's environment: the rank sends plain CPU tensors, its return values
#: included, to Ray out of band (single_controller.ray.tensor_transport), provided its
#: class's module loaded torch by the time the actor starts.
TENSORS_OUT_OF_BAND_ENV = "HYBRIDFLOW_TENSORS_OUT_OF_BAND"

#: What a group sets on each of its ranks (rank, layout, rendezvous, the group's identity,
#: the tensor transport); a group's ``worker_env`` may add variables but not set these.
GROUP_ENV_NAMES = frozenset({
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RAY_LOCAL_RANK", "RAY_LOCAL_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "WG_PREFIX", "WG_BACKEND", TENSORS_OUT_OF_BAND_ENV,
})


def check_worker_env(worker_env: Mapping[str, str] | None) -> dict[str, str]:
    """A group's ``worker_env`` (variables for every rank) as a dict; ``ValueError`` for
    a name or value that is not a string, an empty name or one with ``=``, or a name the
    group sets itself (:data:`GROUP_ENV_NAMES`), naming them."""
    if worker_env is None:
        return {}
    if not isinstance(worker_env, Mapping):
        raise ValueError(f"worker_env is a mapping of variable names to strings, got {type(worker_env).__name__}")
    bad = [
        repr(name) for name, value in worker_env.items()
        if not isinstance(name, str) or not name or "=" in name or not isinstance(value, str)
    ]
    if bad:
        raise ValueError(f"worker_env takes non-empty string names (without '=') and string values; bad: {bad}")
    clash = sorted(set(worker_env) & GROUP_ENV_NAMES)
    if clash:
        raise ValueError(f"worker_env may not set {clash}: the group sets them on every rank")
    return dict(worker_env)


_lock = threading.Lock()
_classes: dict[Any, Any] = {}  # worker class -> its actor class with rank env


def _subclass(base: type) -> type:
    # Ray makes the instance with a bare __new__ and runs __init__ as the actor's first
    # task, so __init__ is where the variables arrive; a Worker then reads its place again.
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        os.environ.update(kwargs.pop(RANK_ENV_KWARG, None) or {})
        # Only where the worker's code loaded torch: a class without tensors stays torch-free.
        if os.environ.get(TENSORS_OUT_OF_BAND_ENV) == "1" and "torch" in sys.modules:
            from single_controller.ray.tensor_transport import send_tensors_out_of_band

            send_tensors_out_of_band()
        configure = getattr(self, "_configure_from_env", None)
        if configure is not None:
            configure()
        super(subclass, self).__init__(*args, **kwargs)

    namespace = {"__init__": __init__, "__doc__": base.__doc__, "__module__": base.__module__,
                 "__qualname__": base.__qualname__}
    subclass = type(base.__name__, (base,), namespace)
    return subclass


def with_rank_env(cls: Any) -> Any:
    """``cls`` (a ``@ray.remote`` actor class or a plain class) as an actor class whose
    constructor also takes ``RANK_ENV_KWARG``: a dict put into ``os.environ`` first. The
    ``@ray.remote`` options of ``cls`` carry over; one actor class per ``cls``, so Ray
    exports it once for all ranks."""
    with _lock:
        if cls in _classes:
            return _classes[cls]
        options = dict(getattr(cls, "_default_options", None) or {}) if hasattr(cls, "remote") else {}
        subclass = _subclass(user_class(cls))
        actor_cls = ray.remote(**options)(subclass) if options else ray.remote(subclass)
        _classes[cls] = actor_cls
        return actor_cls

"""The environment variables the service, its build and its tests read: one prefix,
``HYBRIDFLOW_``. Each earlier ``SC_`` name is still read for one release, with a warning
naming its replacement, when the new one is not set."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

#: Each variable's earlier name.
RENAMED = {
    "HYBRIDFLOW_TOKEN": "SC_AUTH_TOKEN",
    "HYBRIDFLOW_STATE_PATH": "SC_STATE_PATH",
    "HYBRIDFLOW_STATE_FRESH": "SC_STATE_FRESH",
    "HYBRIDFLOW_REQUIRE_SYSTEM_DEPS": "SC_REQUIRE_SYSTEM_DEPS",
    "HYBRIDFLOW_SERVE_HAPROXY": "SC_SERVE_HAPROXY",
    "HYBRIDFLOW_STATUS_SCREENSHOT": "SC_STATUS_SCREENSHOT",
}


def setting(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """``name``'s value in ``env`` (the process's environment by default), or its earlier
    name's, with a ``FutureWarning``; None when neither is set."""
    env = os.environ if env is None else env
    value = env.get(name)
    if value is not None:
        return value
    old = RENAMED.get(name)
    if old is not None and old in env:
        warnings.warn(f"{old} is read for one more release: set {name} instead", FutureWarning, stacklevel=2)
        return env[old]
    return None

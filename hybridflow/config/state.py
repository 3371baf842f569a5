"""Where the controllers keep their durable state, and how groups restore from it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator

from hybridflow.config.environment import setting
from hybridflow.config.groups import _Strict
from hybridflow.state.backends import open_store
from hybridflow.state.store import (
    DEFAULT_MAX_ANSWER_BYTES,
    DEFAULT_MAX_ANSWERS,
    DEFAULT_STATE_PATH,
    REDIS_SCHEMES,
    StateStore,
)

#: Environment variables read where ``serve run`` starts (``build(args)``): a state path
#: that overrides ``state.path`` (``null`` or ``:memory:`` for in-memory state), and a
#: fresh start (``1``) as ``state.fresh: true`` would (``make serve-fresh`` sets it).
STATE_PATH_ENV = "HYBRIDFLOW_STATE_PATH"
STATE_FRESH_ENV = "HYBRIDFLOW_STATE_FRESH"
#: Where weight syncs keep their shards with a Redis store, relative to where ``serve run`` starts.
DEFAULT_WEIGHTS_DIR = ".hybridflow/weights"


class StateConfig(_Strict):
    """Where acknowledged calls, snapshots and idempotency answers are kept
    (``hybridflow.state.store``), and how groups restore from them."""

    path: str | None = Field(
        DEFAULT_STATE_PATH,
        description="SQLite file (relative to the directory serve run starts from), a redis:// URL, "
        "or null: in memory only (state dies with the controller replica)",
    )
    redis_url: str | None = Field(
        None, description="redis://host:port/db: a store every node reaches, used instead of path when set"
    )
    snapshot_every: int = Field(
        1000, ge=0, description="snapshot a group that has state_dict()/load_state_dict() every N acknowledged "
        "mutating calls and truncate its journal (0: never)"
    )
    replay_timeout_s: float = Field(
        600.0, gt=0, description="how long restoring a group (its snapshot and journal replay) may take; a group "
        "whose restore runs longer, or raises, stays failed until POST /v1/admin/groups/{group}/reset"
    )
    fresh: bool = Field(
        False, description="discard the stored state once per Ray session (a replica Serve restarts keeps its state)"
    )
    on_mismatch: Literal["error", "reset"] = Field(
        "error", description="stored state that no longer fits a group (world size, worker class, init arguments): "
        "refuse to start, or discard that group's state"
    )
    synchronous: Literal["NORMAL", "FULL"] = Field(
        "NORMAL", description="SQLite: NORMAL survives process crashes, FULL also power loss (an fsync per call)"
    )
    busy_timeout_s: float = Field(10.0, gt=0, description="SQLite: how long a write waits for another process's")
    max_answers: int = Field(DEFAULT_MAX_ANSWERS, ge=1, description="idempotency answers kept in the store per group")
    max_answer_bytes: int = Field(DEFAULT_MAX_ANSWER_BYTES, ge=1, description="their bytes per group")
    namespace: str = Field("hybridflow", min_length=1, description="Redis key prefix (one per application)")
    weights_dir: str | None = Field(
        None, description="where the shards of weight syncs are kept (docs/weight-sync.md); default: 'weights' "
        "beside the SQLite file, .hybridflow/weights with redis_url, a temporary directory with state in memory. "
        "On a cluster, a shared directory every node mounts at this path"
    )
    weights_kept: int = Field(
        2, ge=1, description="per group, the latest weight syncs whose shard files stay on disk (the latest is what "
        "a restore loads); older ones are deleted unless a restore needs them (docs/weight-sync.md)"
    )

    @field_validator("path", "redis_url", "weights_dir")
    @classmethod
    def _not_empty(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty (null means in memory)")
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(REDIS_SCHEMES):
            raise ValueError(f"must start with one of {', '.join(REDIS_SCHEMES)}, got {value!r}")
        return value

    def weights_directory(self) -> str | None:
        """Where weight syncs keep their shards (None: state in memory, so a temporary
        directory of the controller's)."""
        if self.weights_dir is not None:
            return self.weights_dir
        location = self.location
        if location is None:
            return None
        if location.startswith(REDIS_SCHEMES):
            return os.path.abspath(DEFAULT_WEIGHTS_DIR)
        return os.path.join(os.path.dirname(location), "weights")

    @property
    def location(self) -> str | None:
        """What the store opens: the Redis URL when set, else the path (None: in memory)."""
        return self.redis_url or self.path

    def resolved(self, env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None) -> StateConfig:
        """This config as a replica must get it: ``HYBRIDFLOW_STATE_PATH`` and
        ``HYBRIDFLOW_STATE_FRESH`` applied, and a file path (and ``weights_dir``) made absolute against ``cwd``
        (default: this process's working directory). Called where ``serve run`` starts (``build(args)``), never in a
        replica, whose working directory may be another."""
        env = os.environ if env is None else env
        update: dict[str, Any] = {}
        override = setting(STATE_PATH_ENV, env)
        if override:
            path = None if override in (":memory:", "null") else override
            update = {"path": path, "redis_url": None}
        else:
            path = self.location
        base = os.fspath(cwd) if cwd is not None else os.getcwd()
        if path is not None and not path.startswith(REDIS_SCHEMES):
            update.update(path=os.path.abspath(os.path.join(base, os.path.expanduser(path))), redis_url=None)
        if self.weights_dir is not None:
            update["weights_dir"] = os.path.abspath(os.path.join(base, os.path.expanduser(self.weights_dir)))
        elif path is not None and path.startswith(REDIS_SCHEMES):
            update["weights_dir"] = os.path.abspath(os.path.join(base, DEFAULT_WEIGHTS_DIR))
        if (setting(STATE_FRESH_ENV, env) or "").strip().lower() in ("1", "true", "yes"):
            update["fresh"] = True
        return self.model_copy(update=update)

    def open(self) -> StateStore:
        """The :class:`~hybridflow.state.store.StateStore` this (resolved) config names."""
        return open_store(
            self.location, namespace=self.namespace, synchronous=self.synchronous,
            busy_timeout_s=self.busy_timeout_s, max_answers=self.max_answers, max_answer_bytes=self.max_answer_bytes,
        )

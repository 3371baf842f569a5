"""The state store's contract: per group (a *scope*), the journal of acknowledged mutating
calls, the latest snapshot, and the idempotency answers, kept outside the controller's
process so that a restarted replica, or a new ``serve run``, rebuilds every group to the
acknowledged state. Values are opaque bytes here (``hybridflow.state.codec`` makes them).

Backends: ``hybridflow.state.sqlite_store`` (the embedded default, and the in-memory
store) and ``hybridflow.state.redis_store`` (shared by every node); :func:`open_store`
(``hybridflow.state.backends``) picks one from a location. docs/state.md describes the guarantees: every write returns
only after its transaction committed, a journal entry and its idempotency answer commit
together, and a snapshot replaces the entries it covers in one step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

#: Where the state file goes, relative to the directory ``serve run`` starts from.
DEFAULT_STATE_PATH = ".hybridflow/state.db"
#: Locations that name a Redis server instead of a SQLite file.
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


#: Idempotency answers kept per scope: count and bytes (oldest evicted first).
DEFAULT_MAX_ANSWERS = 10_000
DEFAULT_MAX_ANSWER_BYTES = 256 << 20
#: Snapshots and large journal entries are stored in parts of at most this size, each
#: written on its own: SQLite and Redis cap one value (SQLite's blob limit is 1e9 bytes,
#: Redis's bulk length 512 MB by default), and a part is what other writers may have to
#: wait for. A backend whose server caps values lower uses smaller parts.
SNAPSHOT_PART_BYTES = 16 << 20
#: What a value needs beside an answer's bytes (its key, fingerprint and row).
VALUE_OVERHEAD_BYTES = 64 << 10
#: Sequence numbers stay exact in Redis's Lua numbers and sorted-set scores.
MAX_SEQ = 2**53


class StateMismatchError(ValueError):
    """Stored state does not fit the group as configured now (world size, worker class or
    config fingerprint changed): replaying it would rebuild the wrong shape."""


class StateStoreUnavailable(RuntimeError):
    """The backend could not be reached or written in time (database locked past the
    busy timeout, disk error, Redis down). SQLite: nothing was written. Redis: nothing was
    written, unless the connection broke after the server ran the write (then it is case 2
    of the module docstring). Either way the controller must not acknowledge the call:
    it answers 503 and restores the group from the store, whose workers applied a call
    the store may not hold."""


@dataclass(frozen=True)
class ScopeMeta:
    """What a scope's state was written for; checked at start by :meth:`StateStore.open_scope`."""

    world_size: int
    worker_class: str
    config_fingerprint: str

    def differences(self, other: ScopeMeta) -> list[str]:
        return [
            f"{name}: stored {getattr(other, name)!r}, configured {getattr(self, name)!r}"
            for name in ("world_size", "worker_class", "config_fingerprint")
            if getattr(self, name) != getattr(other, name)
        ]


@dataclass(frozen=True)
class StoredAnswer:
    """An idempotency answer. ``answer`` is None when the call was applied but its answer
    was larger than the store's ``max_answer_bytes``: a retry must not apply the call
    again, and cannot be given the body either (the controller answers it with an error
    saying so)."""

    key: str
    fingerprint: str
    answer: bytes | None


@dataclass(frozen=True)
class ScopeState:
    """What a rebuild needs: load ``snapshot`` (taken after call ``snapshot_seq``; None
    when there is none and ``snapshot_seq`` is 0), then replay ``entries`` (all numbered
    above ``snapshot_seq``, in sequence order). ``last_seq`` is the highest number
    stored; a restarted controller numbers its calls from ``last_seq + 1``."""

    snapshot: bytes | None
    snapshot_seq: int
    entries: list[tuple[int, bytes]]

    @property
    def last_seq(self) -> int:
        return self.entries[-1][0] if self.entries else self.snapshot_seq


def scope_name(deployment: str, group: str) -> str:
    """The scope of one group of one deployment."""
    for label, part in (("deployment", deployment), ("group", group)):
        if not isinstance(part, str) or not part or "/" in part:
            raise ValueError(f"{label} name must be a non-empty str without '/', got {part!r}")
    return _check_scope(f"{deployment}/{group}")


def _check_scope(scope: Any) -> str:
    if not isinstance(scope, str) or not scope or len(scope) > 256 or not scope.isprintable():
        raise ValueError(f"scope must be a printable str of 1 to 256 characters, got {scope!r}")
    return scope


def _check_seq(seq: Any) -> int:
    if type(seq) is not int or not 0 < seq < MAX_SEQ:
        raise ValueError(f"sequence number must be an int in 1..2**53-1, got {seq!r}")
    return seq


def _check_bytes(label: str, value: Any) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)) or not len(value):
        raise ValueError(f"{label} must be non-empty bytes, got {type(value).__name__}")
    return bytes(value)


def _check_answer(answer: Any) -> StoredAnswer:
    if not isinstance(answer, StoredAnswer):
        raise ValueError(f"answer must be a StoredAnswer, got {type(answer).__name__}")
    if not isinstance(answer.key, str) or not answer.key or not isinstance(answer.fingerprint, str):
        raise ValueError("an answer needs a non-empty str key and a str fingerprint")
    if answer.answer is not None:
        _check_bytes("answer.answer", answer.answer)
    return answer


class StateStore(ABC):
    """One application's durable state, shared by its controller replicas. Every
    method is safe to call from several threads. Writes are durable when they return
    (see the module docstring for what that means per backend) and raise
    :class:`StateStoreUnavailable` when the backend cannot be written, ``ValueError`` for
    bad arguments; nothing is written in either case."""

    def __init__(self, max_answers: int = DEFAULT_MAX_ANSWERS, max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES):
        if type(max_answers) is not int or max_answers < 1:
            raise ValueError(f"max_answers must be a positive int, got {max_answers!r}")
        if type(max_answer_bytes) is not int or max_answer_bytes < 1:
            raise ValueError(f"max_answer_bytes must be a positive int, got {max_answer_bytes!r}")
        self.max_answers = max_answers
        self.max_answer_bytes = max_answer_bytes
        #: The largest value the backend stores (set by :meth:`_value_limit`).
        self.max_value_bytes = SNAPSHOT_PART_BYTES + VALUE_OVERHEAD_BYTES

    def _value_limit(self, limit: int, what: str) -> None:
        """Take the backend's bound on one value (``what`` names it and where it is set):
        parts are cut to fit it, and an idempotency answer, kept whole, must fit in it, so a
        configuration that could produce a larger one is refused before anything is stored."""
        self.max_value_bytes = limit
        if self.max_answer_bytes + VALUE_OVERHEAD_BYTES > limit:
            raise ValueError(
                f"state.max_answer_bytes is {self.max_answer_bytes} bytes, but {what} is {limit} bytes: an answer "
                f"that large could not be stored. Set state.max_answer_bytes to at most "
                f"{limit - VALUE_OVERHEAD_BYTES}, or raise the store's limit"
            )

    def _parts(self, data: bytes) -> list[bytes | memoryview]:
        """``data`` in parts that each fit the backend's values (views: no copy of it)."""
        size = max(1, min(SNAPSHOT_PART_BYTES, self.max_value_bytes - VALUE_OVERHEAD_BYTES))
        if len(data) <= size:
            return [data]
        view = memoryview(data)
        return [view[i:i + size] for i in range(0, len(data), size)]

    # -- the contract -------------------------------------------------------------------
    def open_scope(self, scope: str, meta: ScopeMeta) -> ScopeState:
        """Start using a scope: store ``meta`` on first use, or check it against what is
        stored (:class:`StateMismatchError` naming every difference, and the fix, when
        they differ), then return :meth:`load`."""
        _check_scope(scope)
        if not isinstance(meta, ScopeMeta):
            raise ValueError(f"meta must be a ScopeMeta, got {type(meta).__name__}")
        if type(meta.world_size) is not int or meta.world_size < 1:
            raise ValueError(f"meta.world_size must be a positive int, got {meta.world_size!r}")
        stored = self._claim_meta(scope, meta)
        if stored is not None and stored != meta:
            raise StateMismatchError(
                f"stored state of {scope!r} does not fit the group as configured ("
                + "; ".join(meta.differences(stored))
                + "): start with a fresh state for it (make serve-fresh) to discard the stored state"
            )
        return self.load(scope)

    def meta(self, scope: str) -> ScopeMeta | None:
        """The scope's stored metadata (None before :meth:`open_scope` or after :meth:`reset`)."""
        return self._meta(_check_scope(scope))

    def load(self, scope: str) -> ScopeState:
        """The scope's latest snapshot and the journal after it, read consistently."""
        return self._load(_check_scope(scope))

    def record_call(self, scope: str, seq: int, entry: bytes, answer: StoredAnswer | None = None) -> None:
        """Record an acknowledged mutating call (``seq``: its submission number; gaps are
        fine, duplicates are not) and, when given, its idempotency answer, in one
        transaction. An answer whose key is already stored leaves the stored one (the
        first answer wins) but the entry is still recorded: the workers applied it.
        An entry of any size is stored: one larger than a part is written a part at a
        time, out of sight until that transaction makes it part of the journal.
        ``ValueError`` when ``seq`` is already recorded or not above the snapshot's."""
        _check_scope(scope)
        _check_seq(seq)
        entry = _check_bytes("entry", entry)
        if answer is not None:
            _check_answer(answer)
        self._record(scope, seq, self._parts(entry), answer)

    def store_snapshot(self, scope: str, seq: int, snapshot: bytes) -> None:
        """Store the group's state after every call numbered ``<= seq`` (replacing the
        previous snapshot) and delete those journal entries, in one transaction. Take it
        when no call ``<= seq`` is in flight. ``ValueError`` when ``seq`` is below the
        stored snapshot's."""
        _check_scope(scope)
        _check_seq(seq)
        snapshot = _check_bytes("snapshot", snapshot)
        self._snapshot(scope, seq, self._parts(snapshot))

    def get_answer(self, scope: str, key: str) -> StoredAnswer | None:
        """The answer stored under an Idempotency-Key, or None."""
        _check_scope(scope)
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty str, got {key!r}")
        return self._get_answer(scope, key)

    def reset(self, scope: str, once_per: str | None = None) -> bool:
        """Delete everything of a scope (journal, snapshot, answers, metadata): the
        ``--fresh`` start. With ``once_per`` (e.g. the Ray session's name) the scope is
        reset only if it was not already reset with that token, so a replica that Serve
        restarts inside the same ``serve run`` keeps the state written since the fresh
        start; a reset without ``once_per`` keeps that token for the same reason.
        Returns whether it reset."""
        _check_scope(scope)
        if once_per is not None and (not isinstance(once_per, str) or not once_per):
            raise ValueError(f"once_per must be a non-empty str or None, got {once_per!r}")
        return self._reset(scope, once_per)

    def scopes(self) -> list[str]:
        """Every scope that holds state (or a ``once_per`` reset marker), sorted."""
        return sorted(self._scopes())

    @abstractmethod
    def close(self) -> None:
        """Release the connection; the store must not be used after."""

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _as_kept(self, answer: StoredAnswer) -> StoredAnswer:
        """The answer as the store keeps it: without its body when that is too large."""
        if answer.answer is not None and len(answer.answer) > self.max_answer_bytes:
            return StoredAnswer(answer.key, answer.fingerprint, None)
        return answer

    # -- what a backend implements (arguments already checked) ---------------------------
    @abstractmethod
    def _claim_meta(self, scope: str, meta: ScopeMeta) -> ScopeMeta | None:
        """Store ``meta`` if the scope has none; return what was stored before (or None)."""

    @abstractmethod
    def _meta(self, scope: str) -> ScopeMeta | None: ...

    @abstractmethod
    def _load(self, scope: str) -> ScopeState: ...

    @abstractmethod
    def _record(self, scope: str, seq: int, parts: list[bytes], answer: StoredAnswer | None) -> None:
        """Record the entry made of ``parts`` (one, or several written one at a time)."""

    @abstractmethod
    def _snapshot(self, scope: str, seq: int, parts: list[bytes]) -> None: ...

    @abstractmethod
    def _get_answer(self, scope: str, key: str) -> StoredAnswer | None: ...

    @abstractmethod
    def _reset(self, scope: str, once_per: str | None) -> bool: ...

    @abstractmethod
    def _scopes(self) -> list[str]: ...


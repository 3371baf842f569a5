"""The embedded state store: one SQLite file in WAL mode shared by every controller process
of the application (writers in other processes wait for each other, readers never block),
and the same code on a private in-memory database for ``state: {path: null}``."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from hybridflow.state.store import (
    DEFAULT_MAX_ANSWER_BYTES,
    DEFAULT_MAX_ANSWERS,
    ScopeMeta,
    ScopeState,
    StateStore,
    StateStoreUnavailable,
    StoredAnswer,
)

#: 2: journal entries may be stored in parts (journal.generation, journal_parts).
_SCHEMA_VERSION = 2
_SCHEMA = """
CREATE TABLE IF NOT EXISTS scopes (
    scope TEXT PRIMARY KEY,
    world_size INTEGER,
    worker_class TEXT,
    config_fingerprint TEXT,
    snapshot_seq INTEGER NOT NULL DEFAULT 0,
    snapshot_generation TEXT,
    answer_count INTEGER NOT NULL DEFAULT 0,
    answer_bytes INTEGER NOT NULL DEFAULT 0,
    reset_token TEXT
);
CREATE TABLE IF NOT EXISTS journal (
    scope TEXT NOT NULL,
    seq INTEGER NOT NULL,
    entry BLOB NOT NULL,
    generation TEXT,
    PRIMARY KEY (scope, seq)
);
CREATE TABLE IF NOT EXISTS journal_parts (
    scope TEXT NOT NULL,
    seq INTEGER NOT NULL,
    generation TEXT NOT NULL,
    part INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (scope, generation, part)
);
CREATE INDEX IF NOT EXISTS journal_parts_by_seq ON journal_parts (scope, seq);
CREATE TABLE IF NOT EXISTS snapshot_parts (
    scope TEXT NOT NULL,
    generation TEXT NOT NULL,
    part INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (scope, generation, part)
);
CREATE TABLE IF NOT EXISTS answers (
    id INTEGER PRIMARY KEY,
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    answer BLOB,
    size INTEGER NOT NULL,
    UNIQUE (scope, key)
);
CREATE INDEX IF NOT EXISTS answers_by_age ON answers (scope, id);
"""


def _use_wal(conn: sqlite3.Connection, timeout_s: float) -> None:
    """Put the file in WAL mode (persistent: the first opener of a new file sets it).
    While other processes open the same new file at once, SQLite may refuse the switch as
    locked without waiting out the busy timeout: it is tried again until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if ("locked" not in str(exc) and "busy" not in str(exc)) or time.monotonic() >= deadline:
                raise
        time.sleep(0.01)


class SQLiteStateStore(StateStore):
    """The embedded backend: one SQLite file in WAL mode, shared by every controller
    process of the application. One connection per store, used under a lock; writes take
    the database's write lock at once (``BEGIN IMMEDIATE``) and wait up to
    ``busy_timeout_s`` for another process's transaction, which lasts a fraction of a
    millisecond for a call. A snapshot, and a journal entry larger than a part, is written a
    part (:data:`SNAPSHOT_PART_BYTES`) per transaction, out of sight until one short
    transaction makes it the scope's snapshot (or a journal entry), so other writers wait
    for one part at most and no value reaches SQLite's blob limit; a large read
    (:meth:`load`) runs on a connection of its own, as WAL readers never block writers."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
        busy_timeout_s: float = 10.0,
        max_answers: int = DEFAULT_MAX_ANSWERS,
        max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
    ) -> None:
        super().__init__(max_answers, max_answer_bytes)
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be NORMAL or FULL, got {synchronous!r}")
        self.path = str(path)
        self.busy_timeout_s = busy_timeout_s
        memory = self.path == ":memory:"
        if not memory:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        try:
            self._conn = sqlite3.connect(
                self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            if not memory:
                _use_wal(self._conn, busy_timeout_s)
                # the WAL is cut back to this after a checkpoint (a snapshot's parts grow it)
                self._conn.execute(f"PRAGMA journal_size_limit={64 << 20}")
            self._conn.execute(f"PRAGMA synchronous={synchronous}")
            with self._write() as conn:
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                if version > _SCHEMA_VERSION:
                    raise ValueError(
                        f"{self.path} holds state schema {version}; this code knows {_SCHEMA_VERSION}"
                    )
                if version == 1:  # journal entries in one value only: the column parts need
                    conn.execute("ALTER TABLE journal ADD COLUMN generation TEXT")
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")
        except sqlite3.Error as exc:
            raise StateStoreUnavailable(f"cannot open the state file {self.path}: {exc}") from exc
        try:
            self._value_limit(self._conn.getlimit(sqlite3.SQLITE_LIMIT_LENGTH), "SQLite's largest value")
        except ValueError:
            self._conn.close()
            raise
        self.synchronous = synchronous

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; any failure rolls it back."""
        with self._transaction("BEGIN IMMEDIATE") as conn:
            yield conn

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """One read transaction: its statements see one consistent state."""
        with self._transaction("BEGIN") as conn:
            yield conn

    @contextmanager
    def _transaction(self, begin: str) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                self._conn.execute(begin)
            except sqlite3.Error as exc:
                raise StateStoreUnavailable(f"state file {self.path}: {exc}") from exc
            try:
                yield self._conn
                self._conn.execute("COMMIT")
            except BaseException as exc:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.IntegrityError):
                    raise ValueError(str(exc)) from exc
                if isinstance(exc, sqlite3.Error):
                    raise StateStoreUnavailable(f"state file {self.path}: {exc}") from exc
                raise

    @contextmanager
    def _reader(self) -> Iterator[sqlite3.Connection]:
        """A read transaction on a connection of its own, so that reading a large snapshot
        holds up neither this process's writes nor anyone else's (an in-memory database
        has only its one connection)."""
        if self.path == ":memory:":
            with self._read() as conn:
                yield conn
            return
        try:
            conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None)
        except sqlite3.Error as exc:
            raise StateStoreUnavailable(f"state file {self.path}: {exc}") from exc
        try:
            conn.execute("BEGIN")
            yield conn
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            raise StateStoreUnavailable(f"state file {self.path}: {exc}") from exc
        finally:
            conn.close()

    @staticmethod
    def _snapshot_seq(conn: sqlite3.Connection, scope: str) -> int | None:
        row = conn.execute("SELECT snapshot_seq FROM scopes WHERE scope = ?", (scope,)).fetchone()
        return None if row is None else row[0]

    def _claim_meta(self, scope: str, meta: ScopeMeta) -> ScopeMeta | None:
        with self._write() as conn:
            stored = self._meta_of(conn, scope)
            if stored is None:
                conn.execute(
                    "INSERT INTO scopes (scope, world_size, worker_class, config_fingerprint) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT (scope) DO UPDATE SET world_size = excluded.world_size, "
                    "worker_class = excluded.worker_class, config_fingerprint = excluded.config_fingerprint",
                    (scope, meta.world_size, meta.worker_class, meta.config_fingerprint),
                )
            return stored

    def _meta(self, scope: str) -> ScopeMeta | None:
        with self._read() as conn:
            return self._meta_of(conn, scope)

    @staticmethod
    def _meta_of(conn: sqlite3.Connection, scope: str) -> ScopeMeta | None:
        row = conn.execute(
            "SELECT world_size, worker_class, config_fingerprint FROM scopes WHERE scope = ?", (scope,)
        ).fetchone()
        return None if row is None or row[0] is None else ScopeMeta(*row)

    def _load(self, scope: str) -> ScopeState:
        with self._reader() as conn:
            row = conn.execute(
                "SELECT snapshot_seq, snapshot_generation FROM scopes WHERE scope = ?", (scope,)
            ).fetchone()
            snapshot_seq, generation = row if row is not None else (0, None)
            parts = [row[0] for row in conn.execute(
                "SELECT data FROM snapshot_parts WHERE scope = ? AND generation = ? ORDER BY part",
                (scope, generation),
            )]
            rows = conn.execute(
                "SELECT seq, entry, generation FROM journal WHERE scope = ? AND seq > ? ORDER BY seq",
                (scope, snapshot_seq),
            ).fetchall()
            entries = [(seq, bytes(entry) if generation is None else b"".join(row[0] for row in conn.execute(
                "SELECT data FROM journal_parts WHERE scope = ? AND generation = ? ORDER BY part", (scope, generation)
            ))) for seq, entry, generation in rows]
        return ScopeState(b"".join(parts) if parts else None, snapshot_seq, entries)

    def _record(self, scope: str, seq: int, parts: list[bytes], answer: StoredAnswer | None) -> None:
        if len(parts) == 1:
            with self._write() as conn:
                self._insert_entry(conn, scope, seq, parts[0], None, answer)
            return
        with self._read() as conn:  # refuse before writing what would be refused
            self._check_entry_seq(conn, scope, seq)
        generation = uuid.uuid4().hex
        try:
            for index, part in enumerate(parts):  # out of sight until the journal row names them
                with self._write() as conn:
                    conn.execute(
                        "INSERT INTO journal_parts (scope, seq, generation, part, data) VALUES (?, ?, ?, ?, ?)",
                        (scope, seq, generation, index, part),
                    )
            with self._write() as conn:
                self._insert_entry(conn, scope, seq, b"", generation, answer)
        except BaseException:
            self._drop_parts("journal_parts", scope, generation)
            raise

    def _check_entry_seq(self, conn: sqlite3.Connection, scope: str, seq: int) -> int | None:
        snapshot_seq = self._snapshot_seq(conn, scope)
        if snapshot_seq is not None and seq <= snapshot_seq:
            raise ValueError(f"call {seq} of {scope!r} is covered by the snapshot at {snapshot_seq}")
        if conn.execute("SELECT 1 FROM journal WHERE scope = ? AND seq = ?", (scope, seq)).fetchone():
            raise ValueError(f"call {seq} of {scope!r} is already recorded")
        return snapshot_seq

    def _insert_entry(
        self, conn: sqlite3.Connection, scope: str, seq: int, entry: bytes, generation: str | None,
        answer: StoredAnswer | None,
    ) -> None:
        if self._check_entry_seq(conn, scope, seq) is None:
            conn.execute("INSERT INTO scopes (scope) VALUES (?)", (scope,))
        conn.execute(
            "INSERT INTO journal (scope, seq, entry, generation) VALUES (?, ?, ?, ?)", (scope, seq, entry, generation)
        )
        if answer is not None:
            self._insert_answer(conn, scope, answer)

    def _insert_answer(self, conn: sqlite3.Connection, scope: str, answer: StoredAnswer) -> bool:
        kept = self._as_kept(answer)
        size = len(kept.answer) if kept.answer is not None else 0
        inserted = conn.execute(
            "INSERT INTO answers (scope, key, fingerprint, answer, size) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT (scope, key) DO NOTHING",
            (scope, kept.key, kept.fingerprint, kept.answer, size),
        ).rowcount
        if not inserted:
            return False
        count, total = conn.execute(
            "INSERT INTO scopes (scope, answer_count, answer_bytes) VALUES (?, 1, ?) "
            "ON CONFLICT (scope) DO UPDATE SET answer_count = answer_count + 1, "
            "answer_bytes = answer_bytes + excluded.answer_bytes RETURNING answer_count, answer_bytes",
            (scope, size),
        ).fetchone()
        if count > self.max_answers or total > self.max_answer_bytes:
            oldest = conn.execute("SELECT id, size FROM answers WHERE scope = ? ORDER BY id", (scope,))
            cutoff = None
            for row_id, row_size in oldest:  # the newest answer alone fits, so this stops before it
                if count <= self.max_answers and total <= self.max_answer_bytes:
                    break
                cutoff, count, total = row_id, count - 1, total - row_size
            oldest.close()
            conn.execute("DELETE FROM answers WHERE scope = ? AND id <= ?", (scope, cutoff))
            conn.execute(
                "UPDATE scopes SET answer_count = ?, answer_bytes = ? WHERE scope = ?", (count, total, scope)
            )
        return True

    def _get_answer(self, scope: str, key: str) -> StoredAnswer | None:
        with self._read() as conn:
            row = conn.execute(
                "SELECT fingerprint, answer FROM answers WHERE scope = ? AND key = ?", (scope, key)
            ).fetchone()
        return None if row is None else StoredAnswer(key, row[0], None if row[1] is None else bytes(row[1]))

    def _check_snapshot_seq(self, conn: sqlite3.Connection, scope: str, seq: int) -> None:
        snapshot_seq = self._snapshot_seq(conn, scope)
        if snapshot_seq is not None and seq < snapshot_seq:
            raise ValueError(f"a snapshot of {scope!r} at {snapshot_seq} is newer than {seq}")

    def _snapshot(self, scope: str, seq: int, parts: list[bytes]) -> None:
        with self._read() as conn:  # refuse before writing what would be refused
            self._check_snapshot_seq(conn, scope, seq)
        generation = uuid.uuid4().hex
        try:
            for index, part in enumerate(parts):  # invisible until the generation is switched to
                with self._write() as conn:
                    conn.execute(
                        "INSERT INTO snapshot_parts (scope, generation, part, data) VALUES (?, ?, ?, ?)",
                        (scope, generation, index, part),
                    )
            with self._write() as conn:
                self._check_snapshot_seq(conn, scope, seq)
                conn.execute(
                    "INSERT INTO scopes (scope, snapshot_seq, snapshot_generation) VALUES (?, ?, ?) "
                    "ON CONFLICT (scope) DO UPDATE SET snapshot_seq = excluded.snapshot_seq, "
                    "snapshot_generation = excluded.snapshot_generation",
                    (scope, seq, generation),
                )
                conn.execute("DELETE FROM journal WHERE scope = ? AND seq <= ?", (scope, seq))
                # the previous snapshot, and any that a crash left half written
                stale = [("snapshot_parts", row[0]) for row in conn.execute(
                    "SELECT DISTINCT generation FROM snapshot_parts WHERE scope = ? AND generation != ?",
                    (scope, generation),
                )]
                # the parts of the entries it covers (and of any a crash left unrecorded)
                stale += [("journal_parts", row[0]) for row in conn.execute(
                    "SELECT DISTINCT generation FROM journal_parts WHERE scope = ? AND seq <= ?", (scope, seq)
                )]
        except BaseException:
            self._drop_parts("snapshot_parts", scope, generation)
            raise
        for table, old in stale:
            self._drop_parts(table, scope, old)

    def _drop_parts(self, table: str, scope: str, generation: str) -> None:
        """Delete parts that nothing refers to, a part per transaction. Best effort: what
        a failure leaves is dropped by the next snapshot."""
        try:
            with self._read() as conn:
                parts = [row[0] for row in conn.execute(
                    f"SELECT part FROM {table} WHERE scope = ? AND generation = ?", (scope, generation)
                )]
            for part in parts:
                with self._write() as conn:
                    conn.execute(
                        f"DELETE FROM {table} WHERE scope = ? AND generation = ? AND part = ?",
                        (scope, generation, part),
                    )
        except StateStoreUnavailable:
            pass

    def _reset(self, scope: str, once_per: str | None) -> bool:
        with self._write() as conn:
            row = conn.execute("SELECT reset_token FROM scopes WHERE scope = ?", (scope,)).fetchone()
            token = row[0] if row is not None else None
            if once_per is not None and token == once_per:
                return False
            for table in ("journal", "journal_parts", "snapshot_parts", "answers", "scopes"):
                conn.execute(f"DELETE FROM {table} WHERE scope = ?", (scope,))
            token = once_per or token
            if token is not None:  # the marker that makes the next reset with this token a no-op
                conn.execute("INSERT INTO scopes (scope, reset_token) VALUES (?, ?)", (scope, token))
            return True

    def _scopes(self) -> list[str]:
        with self._read() as conn:
            return [row[0] for row in conn.execute("SELECT scope FROM scopes")]


class MemoryStateStore(SQLiteStateStore):
    """``state: {path: null}``: the SQLite backend on a private in-memory database. State
    lives as long as this object (today's behaviour: a restarted replica starts empty),
    with the same contract as the durable backends."""

    def __init__(self, *, max_answers: int = DEFAULT_MAX_ANSWERS, max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES):
        super().__init__(":memory:", max_answers=max_answers, max_answer_bytes=max_answer_bytes)

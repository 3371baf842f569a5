"""hybridflow.state.store: the same contract tests against every backend (in memory,
SQLite, Redis on a real redis-server this module starts), plus what only a durable or a
shared backend can show: other processes writing at once, a writer SIGKILLed mid-write,
a restarted Redis server. No Ray."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from hybridflow.config import StateConfig
from hybridflow.state import store as state_store
from hybridflow.state.backends import open_store
from hybridflow.state.codec import (
    decode_answer,
    decode_call,
    decode_snapshot,
    encode_answer,
    encode_call,
    encode_snapshot,
    fingerprint,
)
from hybridflow.state.redis_store import RedisStateStore
from hybridflow.state.sqlite_store import MemoryStateStore, SQLiteStateStore
from hybridflow.state.store import (
    DEFAULT_STATE_PATH,
    ScopeMeta,
    StateMismatchError,
    StateStore,
    StateStoreUnavailable,
    StoredAnswer,
    scope_name,
)
from tests.redis_server import RedisServer, redis_binary
from tests.unit.state_store_child import SNAPSHOT_EVERY, answer_for, payload

REPO = Path(__file__).resolve().parents[2]
META = ScopeMeta(world_size=4, worker_class="tutorial_workers.GPUAccumulator", config_fingerprint="cfg-1")
SCOPE = "accumulators/gpu_accumulator"


# -- a real redis-server, one per module ------------------------------------------------


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(redis_binary(), tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


# -- backends ---------------------------------------------------------------------------


@dataclass
class Backend:
    """Where a test's state lives; ``open()`` is a new store on it (for the durable
    backends, the same state a restarted controller would see)."""

    name: str
    location: str | None
    namespace: str

    def open(self, **options) -> StateStore:
        return open_store(self.location, namespace=self.namespace, **options)


def _backend(name: str, request, tmp_path) -> Backend:
    namespace = f"test-{uuid.uuid4().hex[:12]}"  # Redis: every test in keys of its own
    if name == "memory":
        return Backend(name, None, namespace)
    if name == "sqlite":
        return Backend(name, str(tmp_path / "state" / "state.db"), namespace)
    return Backend(name, request.getfixturevalue("redis_server").url, namespace)


@pytest.fixture(params=["memory", "sqlite", "redis"])
def backend(request, tmp_path) -> Backend:
    return _backend(request.param, request, tmp_path)


@pytest.fixture(params=["sqlite", "redis"])
def shared_backend(request, tmp_path) -> Backend:
    """Backends whose state outlives the store object and is shared between processes."""
    return _backend(request.param, request, tmp_path)


@pytest.fixture
def store(backend):
    opened = backend.open()
    yield opened
    opened.close()


def answer(key: str, body: bytes | None = b"answer") -> StoredAnswer:
    return StoredAnswer(key, f"fp-{key}", body)


# -- the contract, on every backend -----------------------------------------------------


def test_a_new_scope_is_empty_and_keeps_its_metadata(store):
    state = store.open_scope(SCOPE, META)
    assert (state.snapshot, state.snapshot_seq, state.entries, state.last_seq) == (None, 0, [], 0)
    assert store.meta(SCOPE) == META
    assert store.meta("accumulators/other") is None
    assert store.scopes() == [SCOPE]


def test_calls_come_back_in_submission_order_with_gaps(store):
    store.open_scope(SCOPE, META)
    # pipelined calls are acknowledged (recorded) out of order; 3 and 6 failed (gaps)
    for seq in (2, 1, 5, 4, 7):
        store.record_call(SCOPE, seq, f"call {seq}".encode())
    state = store.load(SCOPE)
    assert state.entries == [(seq, f"call {seq}".encode()) for seq in (1, 2, 4, 5, 7)]
    assert state.last_seq == 7


def test_a_recorded_call_cannot_be_recorded_again(store):
    store.record_call(SCOPE, 1, b"first", answer("k1"))
    with pytest.raises(ValueError, match="already recorded"):
        store.record_call(SCOPE, 1, b"second", answer("k2"))
    assert store.load(SCOPE).entries == [(1, b"first")]
    assert store.get_answer(SCOPE, "k2") is None  # the whole transaction was refused


def test_an_answer_is_recorded_with_its_call(store):
    entry = encode_call("add", (), {"x": [1, 1, 1, 1]})
    output = [torch.tensor([float(rank + 1)]) for rank in range(4)]
    store.record_call(SCOPE, 1, entry, StoredAnswer("key-1", fingerprint(entry), encode_answer(output)))
    stored = store.get_answer(SCOPE, "key-1")
    assert stored.fingerprint == fingerprint(entry)
    assert [t.item() for t in decode_answer(stored.answer)] == [1.0, 2.0, 3.0, 4.0]
    assert decode_call(store.load(SCOPE).entries[0][1]) == ("add", (), {"x": [1, 1, 1, 1]})
    assert store.get_answer(SCOPE, "key-2") is None
    assert store.get_answer("test_actor/test_actor", "key-1") is None  # answers are per scope


def test_the_first_answer_under_a_key_wins(store):
    store.record_call(SCOPE, 1, b"call 1", answer("same", b"first answer"))
    # another call reusing the key is still journaled (its workers applied it)
    store.record_call(SCOPE, 2, b"call 2", answer("same", b"second answer"))
    assert store.get_answer(SCOPE, "same").answer == b"first answer"
    assert [seq for seq, _ in store.load(SCOPE).entries] == [1, 2]


def test_a_snapshot_replaces_the_journal_it_covers(store):
    for seq in range(1, 11):
        store.record_call(SCOPE, seq, f"call {seq}".encode())
    store.store_snapshot(SCOPE, 6, b"state after 6")
    state = store.load(SCOPE)
    assert (state.snapshot, state.snapshot_seq) == (b"state after 6", 6)
    assert [seq for seq, _ in state.entries] == [7, 8, 9, 10]
    store.store_snapshot(SCOPE, 10, b"state after 10")
    state = store.load(SCOPE)
    assert (state.snapshot, state.snapshot_seq, state.entries, state.last_seq) == (b"state after 10", 10, [], 10)


def test_a_snapshot_may_precede_calls_already_recorded(store):
    # calls 4 and 5 were acknowledged before the snapshot at 3 was stored
    for seq in (1, 2, 3, 4, 5):
        store.record_call(SCOPE, seq, f"call {seq}".encode())
    store.store_snapshot(SCOPE, 3, b"state after 3")
    assert [seq for seq, _ in store.load(SCOPE).entries] == [4, 5]


def test_calls_and_snapshots_behind_the_snapshot_are_refused(store):
    store.record_call(SCOPE, 1, b"call 1")
    store.store_snapshot(SCOPE, 5, b"state after 5")
    with pytest.raises(ValueError, match="covered by the snapshot at 5"):
        store.record_call(SCOPE, 5, b"late", answer("late"))
    with pytest.raises(ValueError, match="newer than 4"):
        store.store_snapshot(SCOPE, 4, b"older state")
    state = store.load(SCOPE)
    assert (state.snapshot, state.snapshot_seq, state.entries) == (b"state after 5", 5, [])
    assert store.get_answer(SCOPE, "late") is None
    store.store_snapshot(SCOPE, 5, b"state after 5, again")  # the same number replaces it
    assert store.load(SCOPE).snapshot == b"state after 5, again"


def test_a_large_snapshot_is_stored_in_parts_and_comes_back_whole(store, monkeypatch):
    monkeypatch.setattr(state_store, "SNAPSHOT_PART_BYTES", 1000)
    blob = payload("big snapshot", 1, 4500)  # five parts
    store.store_snapshot(SCOPE, 3, blob)
    assert store.load(SCOPE).snapshot == blob
    store.store_snapshot(SCOPE, 4, b"small")  # fewer parts than before: none left over
    assert store.load(SCOPE).snapshot == b"small"


def test_calls_are_recorded_while_a_large_snapshot_is_written(shared_backend, monkeypatch):
    """A snapshot is written a part at a time: a call of another group (another thread
    here) is recorded between two parts instead of waiting for all of them."""
    store = shared_backend.open()
    monkeypatch.setattr(state_store, "SNAPSHOT_PART_BYTES", 64 << 10)
    blob = payload("snapshot", 1, 1 << 20)  # 16 parts
    recorded: list[int] = []

    def record_between_parts(index: int) -> None:
        # A store that held its lock from the first part to the last would block here.
        recorder = threading.Thread(target=store.record_call, args=("test_actor/test_actor", index, b"call"))
        recorder.start()
        recorder.join(timeout=20)
        assert not recorder.is_alive(), f"a call waited for the snapshot's part {index} and after"
        recorded.append(index)

    class PartsThatLetOthersIn(list):
        def __iter__(self):
            for index, part in enumerate(list.__iter__(self)):
                if index in (1, 8):
                    record_between_parts(index)
                yield part

    write = type(store)._snapshot
    monkeypatch.setattr(
        type(store), "_snapshot", lambda self, scope, seq, parts: write(self, scope, seq, PartsThatLetOthersIn(parts))
    )
    try:
        store.store_snapshot(SCOPE, 1, blob)
        assert recorded == [1, 8]
        assert store.load(SCOPE).snapshot == blob
        assert [seq for seq, _ in store.load("test_actor/test_actor").entries] == [1, 8]
    finally:
        store.close()


def test_a_group_rebuilds_from_snapshot_and_tail(store):
    """What a controller does: adds on 4 ranks, a snapshot of the ranks' state_dict()s
    after call 3, more adds, then a rebuild that loads the snapshot and replays the tail."""
    ranks = [torch.tensor([float(rank)]) for rank in range(4)]
    store.open_scope(SCOPE, META)
    for seq, x in enumerate([10.0, 1.5, -2.0, 7.0, 0.25], start=1):
        for rank in ranks:
            rank += x
        store.record_call(SCOPE, seq, encode_call("add", (), {"x": x}))
        if seq == 3:
            store.store_snapshot(SCOPE, seq, encode_snapshot([{"value": rank.clone()} for rank in ranks]))
    state = store.open_scope(SCOPE, META)
    rebuilt = [entry["value"] for entry in decode_snapshot(state.snapshot)]
    assert [float(v) for v in rebuilt] == [9.5, 10.5, 11.5, 12.5]
    for _, entry in state.entries:
        method, args, kwargs = decode_call(entry)
        assert method == "add"
        for rank in rebuilt:
            rank += kwargs["x"]
    assert [float(v) for v in rebuilt] == [float(v) for v in ranks] == [16.75, 17.75, 18.75, 19.75]


def test_answers_beyond_the_count_bound_evict_the_oldest(backend):
    store = backend.open(max_answers=5)
    for seq in range(1, 9):
        store.record_call(SCOPE, seq, f"call {seq}".encode(), answer(f"k{seq}"))
    assert [store.get_answer(SCOPE, f"k{seq}") is not None for seq in range(1, 9)] == [False] * 3 + [True] * 5
    store.record_call(SCOPE, 9, b"call 9", answer("k9"))
    assert store.get_answer(SCOPE, "k4") is None and store.get_answer(SCOPE, "k9") is not None
    assert len(store.load(SCOPE).entries) == 9  # the journal is not bounded by this
    store.record_call("test_actor/test_actor", 1, b"call", answer("other"))  # bounds are per scope
    assert store.get_answer(SCOPE, "k5") is not None
    store.close()


def test_answers_beyond_the_byte_bound_evict_the_oldest(backend):
    store = backend.open(max_answer_bytes=100)
    for seq in range(1, 5):
        store.record_call(SCOPE, seq, b"call", answer(f"k{seq}", bytes(40)))
    # 4 x 40 bytes: only the newest two fit in 100
    assert [store.get_answer(SCOPE, f"k{seq}") is not None for seq in range(1, 5)] == [False, False, True, True]
    # an answer larger than the bound alone is kept without its body, and evicts nothing
    store.record_call(SCOPE, 5, b"call", answer("huge", bytes(101)))
    assert store.get_answer(SCOPE, "huge") == StoredAnswer("huge", "fp-huge", None)
    assert store.get_answer(SCOPE, "k4").answer == bytes(40)
    store.record_call(SCOPE, 6, b"call", answer("huge too", bytes(500)))
    assert store.get_answer(SCOPE, "huge too").answer is None
    store.record_call(SCOPE, 7, b"call", answer("k6", bytes(70)))  # 40 + 70 > 100: k3 and k4 go
    assert store.get_answer(SCOPE, "k3") is None and store.get_answer(SCOPE, "k4") is None
    assert store.get_answer(SCOPE, "k6").answer == bytes(70)
    store.close()


@pytest.mark.parametrize(
    "changed, named",
    [
        (ScopeMeta(8, META.worker_class, META.config_fingerprint), "world_size: stored 4, configured 8"),
        (ScopeMeta(4, "tutorial_workers.Accumulator", META.config_fingerprint), "worker_class"),
        (ScopeMeta(4, META.worker_class, "cfg-2"), "config_fingerprint: stored 'cfg-1', configured 'cfg-2'"),
    ],
)
def test_state_that_does_not_fit_the_group_is_refused(store, changed, named):
    store.open_scope(SCOPE, META)
    store.record_call(SCOPE, 1, b"call 1")
    with pytest.raises(StateMismatchError, match=named) as refused:
        store.open_scope(SCOPE, changed)
    assert "fresh" in str(refused.value)
    assert store.meta(SCOPE) == META and store.load(SCOPE).entries == [(1, b"call 1")]  # nothing changed
    assert store.reset(SCOPE)
    assert store.open_scope(SCOPE, changed).entries == []
    assert store.meta(SCOPE) == changed


def test_reset_wipes_one_scope(store):
    other = "test_actor/test_actor"
    for scope in (SCOPE, other):
        store.open_scope(scope, META)
        store.record_call(scope, 1, b"call 1", answer("k1"))
        store.store_snapshot(scope, 1, b"state")
        store.record_call(scope, 2, b"call 2")
    assert store.reset(SCOPE) is True
    state = store.load(SCOPE)
    assert (state.snapshot, state.snapshot_seq, state.entries) == (None, 0, [])
    assert store.get_answer(SCOPE, "k1") is None and store.meta(SCOPE) is None
    assert store.scopes() == [other]
    assert store.load(other).entries == [(2, b"call 2")] and store.get_answer(other, "k1") is not None
    store.record_call(SCOPE, 1, b"numbering starts again")
    assert store.load(SCOPE).entries == [(1, b"numbering starts again")]


def test_a_fresh_start_resets_once_per_run(store):
    store.open_scope(SCOPE, META)
    store.record_call(SCOPE, 1, b"before the fresh start")
    assert store.reset(SCOPE, once_per="run-1") is True
    store.open_scope(SCOPE, META)
    store.record_call(SCOPE, 1, b"after the fresh start")
    # a replica Serve restarts inside the same run keeps what was written since
    assert store.reset(SCOPE, once_per="run-1") is False
    assert store.load(SCOPE).entries == [(1, b"after the fresh start")]
    assert store.meta(SCOPE) == META
    assert store.reset(SCOPE, once_per="run-2") is True  # a new run starts fresh again
    assert store.load(SCOPE).entries == []


@pytest.mark.parametrize(
    "call, problem",
    [
        (lambda s: s.record_call("", 1, b"x"), "scope"),
        (lambda s: s.record_call(SCOPE, 0, b"x"), "sequence number"),
        (lambda s: s.record_call(SCOPE, True, b"x"), "sequence number"),
        (lambda s: s.record_call(SCOPE, 1.0, b"x"), "sequence number"),
        (lambda s: s.record_call(SCOPE, 2**53, b"x"), "sequence number"),
        (lambda s: s.record_call(SCOPE, 1, b""), "entry"),
        (lambda s: s.record_call(SCOPE, 1, "text"), "entry"),
        (lambda s: s.record_call(SCOPE, 1, b"x", answer("")), "key"),
        (lambda s: s.record_call(SCOPE, 1, b"x", answer("k", b"")), "answer"),
        (lambda s: s.record_call(SCOPE, 1, b"x", ("k", "fp", b"a")), "StoredAnswer"),
        (lambda s: s.store_snapshot(SCOPE, 1, b""), "snapshot"),
        (lambda s: s.open_scope(SCOPE, ScopeMeta(0, "W", "f")), "world_size"),
        (lambda s: s.get_answer(SCOPE, ""), "key"),
        (lambda s: s.reset(SCOPE, once_per=""), "once_per"),
    ],
)
def test_bad_arguments_are_refused_without_writing(store, call, problem):
    with pytest.raises(ValueError, match=problem):
        call(store)
    assert store.scopes() == [] and store.load(SCOPE).entries == []


def test_scope_names():
    assert scope_name("accumulators", "gpu_accumulator") == "accumulators/gpu_accumulator"
    for bad in [("", "g"), ("a/b", "g"), ("d", None)]:
        with pytest.raises(ValueError):
            scope_name(*bad)


def test_threads_of_one_store_record_concurrently(store):
    def writer(first: int) -> None:
        for seq in range(first, 400, 4):
            store.record_call(SCOPE, seq, f"call {seq}".encode(), answer(f"k{seq}"))

    threads = [threading.Thread(target=writer, args=(first,)) for first in (1, 2, 3, 4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [seq for seq, _ in store.load(SCOPE).entries] == list(range(1, 400))
    assert all(store.get_answer(SCOPE, f"k{seq}") is not None for seq in (1, 200, 399))



def test_state_survives_a_new_store(shared_backend):
    """What a restarted replica or a new `serve run` sees: a new connection, same state."""
    with shared_backend.open() as first:
        first.open_scope(SCOPE, META)
        first.record_call(SCOPE, 1, b"call 1", answer("k1"))
        first.store_snapshot(SCOPE, 1, b"state after 1")
        first.record_call(SCOPE, 2, b"call 2", answer("k2"))
    with shared_backend.open() as second:
        state = second.open_scope(SCOPE, META)
        assert (state.snapshot, state.snapshot_seq, state.entries) == (b"state after 1", 1, [(2, b"call 2")])
        assert second.get_answer(SCOPE, "k1").answer == b"answer"  # idempotency across restarts
        with pytest.raises(StateMismatchError):
            second.open_scope(SCOPE, ScopeMeta(2, META.worker_class, META.config_fingerprint))


def test_memory_state_is_private_to_its_store():
    first, second = MemoryStateStore(), MemoryStateStore()
    first.record_call(SCOPE, 1, b"call 1")
    assert second.load(SCOPE).entries == [] and first.load(SCOPE).entries == [(1, b"call 1")]


def _child(backend: Backend, *args: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.unit.state_store_child", args[0], backend.location, backend.namespace,
         *map(str, args[1:])],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_writers_in_two_processes_share_the_store(shared_backend):
    count = 150
    # each process has a scope of its own, and both write one shared scope (odd / even calls)
    children = [
        _child(shared_backend, "write", "deployment-a/group", 1, 1, count),
        _child(shared_backend, "write", "deployment-b/group", 1, 1, count),
        _child(shared_backend, "write", SCOPE, 1, 2, count),
        _child(shared_backend, "write", SCOPE, 2, 2, count),
    ]
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0 and out.strip() == "done", err[-2000:]
    with shared_backend.open() as store:
        assert store.scopes() == sorted(["deployment-a/group", "deployment-b/group", SCOPE])
        for scope, last in (("deployment-a/group", count), ("deployment-b/group", count), (SCOPE, 2 * count)):
            entries = store.load(scope).entries
            assert entries == [(seq, payload("entry", seq, 256)) for seq in range(1, last + 1)]
            assert all(store.get_answer(scope, f"key-{seq}") == answer_for(seq) for seq in range(1, last + 1))


def test_a_writer_killed_mid_write_loses_no_acknowledged_record(shared_backend):
    """SIGKILL a process that records calls (64 KiB each, with answers) and snapshots as
    fast as it can, at three points: every call it acknowledged is there, intact, or
    covered by a snapshot it acknowledged (or a later one); a call's entry and answer are
    there together or not at all; nothing is torn."""
    size = 64 << 10
    for kill_after in (40, 61, 83):
        scope = f"{SCOPE}-{kill_after}"
        child = _child(shared_backend, "until-killed", scope, size)
        acknowledged: list[str] = []
        while len(acknowledged) < kill_after:
            line = child.stdout.readline()
            assert line, child.stderr.read()[-2000:]
            acknowledged.append(line.strip())
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        # what it printed before it died (through the same buffered reader as above)
        acknowledged += child.stdout.read().split("\n")
        child.stdout.close()
        child.stderr.close()
        calls = [int(line.split()[1]) for line in acknowledged if line.startswith("call ")]
        snapshots = [int(line.split()[1]) for line in acknowledged if line.startswith("snapshot ")]
        last_call, last_snapshot = max(calls), max(snapshots)
        with shared_backend.open() as store:
            state = store.load(scope)
            # the last acknowledged snapshot, or one taken after the last acknowledged call
            # but not yet reported when the process died
            assert state.snapshot_seq in (last_snapshot, last_call)
            assert state.snapshot == payload("snapshot", state.snapshot_seq, 4 * size)
            seqs = [seq for seq, _ in state.entries]
            assert seqs == list(range(state.snapshot_seq + 1, state.snapshot_seq + 1 + len(seqs)))
            last_stored = max([state.snapshot_seq, *seqs])
            assert last_stored in (last_call, last_call + 1)  # + the one in flight, if it committed
            for seq, entry in state.entries:
                assert entry == payload("entry", seq, size)
            for seq in range(last_snapshot - SNAPSHOT_EVERY + 1, last_call + 2):
                expected = answer_for(seq) if seq <= last_stored else None
                assert store.get_answer(scope, f"key-{seq}") == expected
            if shared_backend.name == "sqlite":
                assert store._conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            # and the store takes the next call and snapshot as if nothing had happened
            store.record_call(scope, last_stored + 1, b"after the crash")
            store.store_snapshot(scope, last_stored + 1, b"state after the crash")
            assert store.load(scope).snapshot == b"state after the crash"
            assert _snapshot_generations(shared_backend, store, scope) == 1  # half-written ones are gone


def _snapshot_generations(backend: Backend, store: StateStore, scope: str) -> int:
    """How many snapshots a scope holds that will not go away on their own."""
    if backend.name == "sqlite":
        return store._conn.execute(
            "SELECT COUNT(DISTINCT generation) FROM snapshot_parts WHERE scope = ?", (scope,)
        ).fetchone()[0]
    keys = store._redis.keys(f"{backend.namespace}:scope:{scope}:snapshot:*")
    return sum(1 for key in keys if store._redis.ttl(key) == -1)  # staged parts expire


# -- SQLite only --------------------------------------------------------------------------


def test_sqlite_file_is_created_in_wal_mode(tmp_path):
    path = tmp_path / "nested" / "dir" / "state.db"
    with SQLiteStateStore(path) as store:
        store.record_call(SCOPE, 1, b"x")
    connection = sqlite3.connect(path)
    assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    connection.close()
    with SQLiteStateStore(path, synchronous="FULL") as store:
        assert store._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        assert store.load(SCOPE).entries == [(1, b"x")]


def test_sqlite_writer_waits_for_another_process_and_gives_up_after_the_busy_timeout(tmp_path):
    path = tmp_path / "state.db"
    store = SQLiteStateStore(path, busy_timeout_s=1.0)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sqlite3, sys, time\n"
         f"c = sqlite3.connect({str(path)!r}, isolation_level=None)\n"
         "c.execute('BEGIN IMMEDIATE'); print('locked', flush=True)\n"
         "time.sleep(float(sys.argv[1])); c.execute('COMMIT')\n", "0.2"],
        stdout=subprocess.PIPE, text=True,
    )
    assert holder.stdout.readline().strip() == "locked"
    started = time.monotonic()
    store.record_call(SCOPE, 1, b"waited")  # waits for the other writer, then commits
    assert time.monotonic() - started < 5 and holder.wait(timeout=10) == 0
    holder = subprocess.Popen(holder.args[:-1] + ["2.5"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(StateStoreUnavailable, match="locked"):
        store.record_call(SCOPE, 2, b"gave up", answer("k2"))
    holder.wait(timeout=10)
    assert store.load(SCOPE).entries == [(1, b"waited")] and store.get_answer(SCOPE, "k2") is None
    store.close()


def test_sqlite_opens_a_new_file_while_another_writer_holds_it(tmp_path):
    """Processes that open one new file at once: the switch to WAL mode, which SQLite
    refuses at once while another connection writes, waits for it instead (as a write
    does, up to the busy timeout)."""
    path = tmp_path / "state.db"
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("CREATE TABLE other (x)")
    other.execute("BEGIN IMMEDIATE")
    other.execute("INSERT INTO other VALUES (1)")
    opened: list = []
    opener = threading.Thread(target=lambda: opened.append(SQLiteStateStore(path, busy_timeout_s=10.0)))
    opener.start()
    time.sleep(0.3)
    assert opener.is_alive(), "the store did not wait for the other writer"
    other.execute("COMMIT")
    opener.join(timeout=20)
    assert len(opened) == 1, "the store failed to open"
    with opened[0] as store:
        assert store._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        store.record_call(SCOPE, 1, b"x")
        assert store.load(SCOPE).entries == [(1, b"x")]
    assert other.execute("SELECT x FROM other").fetchall() == [(1,)]
    other.close()


def test_sqlite_refuses_a_file_that_is_not_a_state_store(tmp_path):
    path = tmp_path / "state.db"
    path.write_bytes(b"not a database" * 100)
    with pytest.raises(StateStoreUnavailable, match="state.db"):
        SQLiteStateStore(path)


# -- Redis only ---------------------------------------------------------------------------


def test_redis_keeps_acknowledged_records_when_the_server_is_killed(redis_server):
    namespace = f"test-{uuid.uuid4().hex[:12]}"
    store = RedisStateStore(redis_server.url, namespace=namespace)
    for seq in range(1, 51):
        store.record_call(SCOPE, seq, payload("entry", seq, 1000), answer_for(seq))
    store.store_snapshot(SCOPE, 40, b"state after 40")
    redis_server.kill()
    with pytest.raises(StateStoreUnavailable):
        store.record_call(SCOPE, 51, b"server is down")
    redis_server.start()
    with RedisStateStore(redis_server.url, namespace=namespace) as again:
        state = again.load(SCOPE)
        assert (state.snapshot, state.snapshot_seq) == (b"state after 40", 40)
        assert state.entries == [(seq, payload("entry", seq, 1000)) for seq in range(41, 51)]
        assert again.get_answer(SCOPE, "key-50") == answer_for(50)
    store.close()


def test_redis_without_an_append_only_file_is_refused(tmp_path):
    server = RedisServer(redis_binary(), tmp_path).start(appendonly=False)
    try:
        with pytest.raises(ValueError, match="appendonly yes"):
            RedisStateStore(server.url)
        RedisStateStore(server.url, require_aof=False).close()
    finally:
        server.stop()


# -- configuration ------------------------------------------------------------------------


def test_state_config_defaults_and_resolution(tmp_path):
    config = StateConfig()
    assert (config.path, config.snapshot_every, config.synchronous) == (DEFAULT_STATE_PATH, 1000, "NORMAL")
    resolved = config.resolved(env={}, cwd=tmp_path)
    assert resolved.path == str(tmp_path / ".hybridflow" / "state.db")
    store = resolved.open()
    assert isinstance(store, SQLiteStateStore) and (tmp_path / ".hybridflow" / "state.db").exists()
    store.close()
    assert StateConfig(path=None).resolved(env={}).path is None
    assert isinstance(StateConfig(path=None).open(), MemoryStateStore)
    url = "redis://cache.internal:6379/2"
    assert StateConfig(path=url).resolved(env={}, cwd=tmp_path).path == url


def test_sc_state_path_overrides_the_config(tmp_path):
    config = StateConfig(path="config.db")
    assert config.resolved(env={"HYBRIDFLOW_STATE_PATH": "env.db"}, cwd=tmp_path).path == str(tmp_path / "env.db")
    assert config.resolved(env={"HYBRIDFLOW_STATE_PATH": str(tmp_path / "abs.db")}, cwd="/elsewhere").path == str(
        tmp_path / "abs.db"
    )
    assert config.resolved(env={"HYBRIDFLOW_STATE_PATH": ":memory:"}).path is None
    assert config.resolved(env={"HYBRIDFLOW_STATE_PATH": ""}, cwd=tmp_path).path == str(tmp_path / "config.db")
    assert StateConfig(path=None).resolved(env={"HYBRIDFLOW_STATE_PATH": "redis://h:1/0"}).path == "redis://h:1/0"


def test_state_config_rejects_unknown_and_bad_fields():
    with pytest.raises(ValueError, match="snapshot_evry"):
        StateConfig.model_validate({"snapshot_evry": 5})
    with pytest.raises(ValueError, match="synchronous"):
        StateConfig(synchronous="OFF")
    with pytest.raises(ValueError, match="empty"):
        StateConfig(path="").resolved(env={})


def test_open_store_picks_the_backend(tmp_path, redis_server):
    assert isinstance(open_store(None), MemoryStateStore)
    sqlite_store = open_store(tmp_path / "s.db", synchronous="FULL", max_answers=3)
    assert isinstance(sqlite_store, SQLiteStateStore) and sqlite_store.max_answers == 3
    sqlite_store.close()
    redis_store = open_store(redis_server.url, namespace="ns-open")
    assert isinstance(redis_store, RedisStateStore) and redis_store.namespace == "ns-open"
    redis_store.close()

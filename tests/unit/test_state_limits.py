"""What the state store holds whatever the service accepts, and the servers it refuses:
journal entries larger than one value (in parts, on SQLite, in memory and on a real
redis-server whose value limit is lowered), a v1 state file opened by this code, the
answers' bound checked against the backend's, and Redis policies that would evict
journal keys. No Ray."""

from __future__ import annotations

import sqlite3
import uuid

import pytest
import redis

from hybridflow.state import store as state_store
from hybridflow.state.backends import open_store
from hybridflow.state.redis_store import RedisStateStore
from hybridflow.state.sqlite_store import SQLiteStateStore
from hybridflow.state.store import ScopeMeta, StoredAnswer
from tests.redis_server import RedisServer, redis_binary

META = ScopeMeta(world_size=2, worker_class="W", config_fingerprint="cfg")
SCOPE = "d/g"
MIB = 1 << 20


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(redis_binary(), tmp_path).start()
    yield server
    server.stop()


def configure(server: RedisServer, **settings: str) -> None:
    client = redis.Redis.from_url(server.url)
    for name, value in settings.items():
        client.config_set(name.replace("_", "-"), value)
    client.close()


def blob(size: int, seed: int = 0) -> bytes:
    return bytes((seed + i * 7) % 251 for i in range(size))


@pytest.fixture(params=["memory", "sqlite"])
def local_store(request, tmp_path, monkeypatch):
    monkeypatch.setattr(state_store, "SNAPSHOT_PART_BYTES", 1000)  # entries of several parts, quickly
    opened = open_store(None if request.param == "memory" else str(tmp_path / "state.db"))
    yield opened
    opened.close()


def test_an_entry_larger_than_a_part_round_trips_and_a_snapshot_drops_its_parts(local_store):
    local_store.open_scope(SCOPE, META)
    local_store._conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 3000)  # SQLite's blob limit, scaled down
    large, small = blob(3500, 1), b"call 2"
    local_store.record_call(SCOPE, 1, large, StoredAnswer("k", "fp", b"answer"))
    local_store.record_call(SCOPE, 2, small)
    local_store.record_call(SCOPE, 3, blob(2001, 3))
    assert local_store.load(SCOPE).entries == [(1, large), (2, small), (3, blob(2001, 3))]
    assert local_store.get_answer(SCOPE, "k").answer == b"answer"  # in the entry's transaction
    with pytest.raises(ValueError, match="already recorded"):
        local_store.record_call(SCOPE, 1, blob(2500))
    local_store.store_snapshot(SCOPE, 2, b"state after 2")
    state = local_store.load(SCOPE)
    assert (state.snapshot, state.entries) == (b"state after 2", [(3, blob(2001, 3))])
    with local_store._read() as conn:  # only call 3's parts are left
        assert conn.execute("SELECT COUNT(*) FROM journal_parts").fetchone()[0] == 3
    with pytest.raises(ValueError, match="covered by the snapshot"):
        local_store.record_call(SCOPE, 2, blob(2500))
    assert local_store.reset(SCOPE)
    with local_store._read() as conn:
        assert conn.execute("SELECT COUNT(*) FROM journal_parts").fetchone()[0] == 0


def test_a_failed_parted_write_leaves_no_entry_and_no_parts(tmp_path, monkeypatch):
    monkeypatch.setattr(state_store, "SNAPSHOT_PART_BYTES", 1000)
    store = SQLiteStateStore(str(tmp_path / "state.db"))
    store.open_scope(SCOPE, META)
    insert = store._insert_entry

    def refuse(*args):
        raise state_store.StateStoreUnavailable("disk full")

    monkeypatch.setattr(store, "_insert_entry", refuse)
    with pytest.raises(state_store.StateStoreUnavailable):
        store.record_call(SCOPE, 1, blob(3500))
    monkeypatch.setattr(store, "_insert_entry", insert)
    assert store.load(SCOPE).entries == []
    with store._read() as conn:
        assert conn.execute("SELECT COUNT(*) FROM journal_parts").fetchone()[0] == 0
    store.record_call(SCOPE, 1, blob(3500))  # the number is free
    assert store.load(SCOPE).entries == [(1, blob(3500))]
    store.close()


V1_SCHEMA = """
CREATE TABLE scopes (scope TEXT PRIMARY KEY, world_size INTEGER, worker_class TEXT, config_fingerprint TEXT,
    snapshot_seq INTEGER NOT NULL DEFAULT 0, snapshot_generation TEXT, answer_count INTEGER NOT NULL DEFAULT 0,
    answer_bytes INTEGER NOT NULL DEFAULT 0, reset_token TEXT);
CREATE TABLE journal (scope TEXT NOT NULL, seq INTEGER NOT NULL, entry BLOB NOT NULL, PRIMARY KEY (scope, seq));
CREATE TABLE snapshot_parts (scope TEXT NOT NULL, generation TEXT NOT NULL, part INTEGER NOT NULL,
    data BLOB NOT NULL, PRIMARY KEY (scope, generation, part));
CREATE TABLE answers (id INTEGER PRIMARY KEY, scope TEXT NOT NULL, key TEXT NOT NULL, fingerprint TEXT NOT NULL,
    answer BLOB, size INTEGER NOT NULL, UNIQUE (scope, key));
INSERT INTO scopes (scope, world_size, worker_class, config_fingerprint) VALUES ('d/g', 2, 'W', 'cfg');
INSERT INTO journal VALUES ('d/g', 1, x'63616c6c2031');
PRAGMA user_version = 1;
"""


def test_a_state_file_of_the_first_schema_is_upgraded_in_place(tmp_path, monkeypatch):
    path = tmp_path / "state.db"
    old = sqlite3.connect(path)
    old.executescript(V1_SCHEMA)
    old.close()
    monkeypatch.setattr(state_store, "SNAPSHOT_PART_BYTES", 1000)
    store = SQLiteStateStore(str(path))
    assert store.open_scope(SCOPE, META).entries == [(1, b"call 1")]
    store.record_call(SCOPE, 2, blob(2500))
    assert store.load(SCOPE).entries == [(1, b"call 1"), (2, blob(2500))]
    store.close()
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 2


def test_redis_stores_entries_and_snapshots_larger_than_its_value_limit(redis_server):
    configure(redis_server, proto_max_bulk_len=str(MIB))  # the least Redis allows
    store = RedisStateStore(redis_server.url, namespace=f"t-{uuid.uuid4().hex[:8]}", max_answer_bytes=MIB // 2)
    store.open_scope(SCOPE, META)
    entry, snapshot = blob(3 * MIB + 5, 1), blob(2 * MIB + 3, 2)
    store.record_call(SCOPE, 1, entry, StoredAnswer("k", "fp", b"answer"))
    store.record_call(SCOPE, 2, b"small")
    assert store.load(SCOPE).entries == [(1, entry), (2, b"small")]
    assert store.max_value_bytes == MIB  # the server's bound, read at start
    store.store_snapshot(SCOPE, 1, snapshot)
    store.record_call(SCOPE, 3, entry)
    state = store.load(SCOPE)
    assert (state.snapshot, state.entries) == (snapshot, [(2, b"small"), (3, entry)])
    client = redis.Redis.from_url(redis_server.url)
    prefix = f"{store.namespace}:scope:{SCOPE}:entry:"
    assert len(client.keys(prefix + "*")) == 1  # call 1's parts went with the snapshot
    assert store.reset(SCOPE)
    assert client.keys(f"{store.namespace}:*") == []
    store.close()


def test_an_answer_bound_the_backend_cannot_store_is_refused_naming_both(redis_server, tmp_path):
    configure(redis_server, proto_max_bulk_len=str(MIB))
    with pytest.raises(ValueError) as refused:
        RedisStateStore(redis_server.url)  # the default bound: 256 MiB answers
    message = str(refused.value)
    assert f"max_answer_bytes is {256 * MIB} bytes" in message and f"{MIB} bytes" in message
    assert f"at most {MIB - state_store.VALUE_OVERHEAD_BYTES}" in message
    with pytest.raises(ValueError, match="SQLite's largest value is 1000000000 bytes"):
        SQLiteStateStore(str(tmp_path / "state.db"), max_answer_bytes=10**9)


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru", "allkeys-random"])
def test_a_redis_that_evicts_keys_is_refused(redis_server, policy):
    configure(redis_server, maxmemory_policy=policy)
    with pytest.raises(ValueError, match=f"maxmemory-policy {policy}.*noeviction"):
        RedisStateStore(redis_server.url)
    configure(redis_server, maxmemory_policy="noeviction")
    RedisStateStore(redis_server.url).close()


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
def test_a_reset_keeps_the_fresh_start_token(backend, tmp_path, request):
    location = str(tmp_path / "state.db") if backend == "sqlite" else request.getfixturevalue("redis_server").url
    store = open_store(location, namespace=f"t-{uuid.uuid4().hex[:8]}")
    assert store.reset(SCOPE, once_per="run-1")
    store.open_scope(SCOPE, META)
    store.record_call(SCOPE, 1, b"before the reset")
    assert store.reset(SCOPE)  # an operator's reset of the group
    store.open_scope(SCOPE, META)
    store.record_call(SCOPE, 1, b"after the reset")
    # a replica Serve restarts in the same run does not start fresh a second time
    assert not store.reset(SCOPE, once_per="run-1")
    assert store.load(SCOPE).entries == [(1, b"after the reset")]
    store.close()

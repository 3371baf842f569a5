"""The shared state store: a Redis server (standalone or a managed primary, with
``appendonly yes``) that every node reaches; each write is one Lua script, so it is atomic."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hybridflow.state.store import (
    DEFAULT_MAX_ANSWER_BYTES,
    DEFAULT_MAX_ANSWERS,
    SNAPSHOT_PART_BYTES,
    ScopeMeta,
    ScopeState,
    StateStore,
    StateStoreUnavailable,
    StoredAnswer,
)

# Each operation is one Lua script: Redis runs a script whole, with no other command in
# between, and appends it to the append-only file as one unit. Keys of a scope: meta
# (hash), journal (hash seq -> entry), seqs (sorted set of seq), answer fingerprints and
# bodies (hashes by key), answer order (sorted set), snapshot:<generation> (hash part ->
# bytes), parted (hash seq -> generation) and entry:<generation> (hash part -> bytes). A
# snapshot's parts, and those of a journal entry larger than a part, are written one
# command each under a new generation, with an expiry so that parts a crash leaves behind
# go away; one script then makes them the scope's snapshot (or a journal entry, whose
# value in journal is then empty) and removes the expiry. A snapshot's script truncates
# the journal, with the parts of the entries it covers, and drops the old snapshot.

_RECORD_LUA = """
local meta, journal, seqs, fingerprints, bodies, order, scopes, parted, staged = unpack(KEYS)
local seq, entry, scope, generation = ARGV[1], ARGV[2], ARGV[3], ARGV[10]
if seq ~= '' then
  local covered = tonumber(redis.call('HGET', meta, 'snapshot_seq') or '0')
  if tonumber(seq) <= covered then
    return redis.error_reply('COVERED call ' .. seq .. ' is covered by the snapshot at ' .. covered)
  end
  if redis.call('HEXISTS', journal, seq) == 1 then
    return redis.error_reply('DUPLICATE call ' .. seq .. ' is already recorded')
  end
  if generation ~= '' then
    if redis.call('EXISTS', staged) == 0 then
      return redis.error_reply('LOST the parts of call ' .. seq .. ' expired before they were complete')
    end
    redis.call('PERSIST', staged)
    redis.call('HSET', parted, seq, generation)
  end
  redis.call('HSET', journal, seq, entry)
  redis.call('ZADD', seqs, seq, seq)
end
redis.call('SADD', scopes, scope)
local key = ARGV[4]
if key == '' or redis.call('HEXISTS', fingerprints, key) == 1 then
  return 0
end
local size = 0
redis.call('HSET', fingerprints, key, ARGV[5])
if ARGV[6] == '1' then
  redis.call('HSET', bodies, key, ARGV[7])
  size = string.len(ARGV[7])
end
redis.call('ZADD', order, redis.call('HINCRBY', meta, 'answer_clock', 1), key)
local total = tonumber(redis.call('HINCRBY', meta, 'answer_bytes', size))
local count = redis.call('ZCARD', order)
local max_count, max_bytes = tonumber(ARGV[8]), tonumber(ARGV[9])
while count > max_count or total > max_bytes do
  local oldest = redis.call('ZPOPMIN', order)[1]
  total = total - redis.call('HSTRLEN', bodies, oldest)
  redis.call('HDEL', bodies, oldest)
  redis.call('HDEL', fingerprints, oldest)
  count = count - 1
end
redis.call('HSET', meta, 'answer_bytes', total)
return 1
"""

_SNAPSHOT_LUA = """
local meta, journal, seqs, staged, scopes, parted = unpack(KEYS)
local seq, scope, generation, prefix, entry_prefix = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local covered = tonumber(redis.call('HGET', meta, 'snapshot_seq') or '0')
if tonumber(seq) < covered then
  return redis.error_reply('OLDER a snapshot at ' .. covered .. ' is newer than ' .. seq)
end
if redis.call('EXISTS', staged) == 0 then
  return redis.error_reply('LOST the snapshot parts expired before they were complete')
end
redis.call('PERSIST', staged)
local previous = redis.call('HGET', meta, 'snapshot_generation')
if previous and previous ~= generation then
  redis.call('UNLINK', prefix .. previous)
end
redis.call('HSET', meta, 'snapshot_generation', generation)
local old = redis.call('ZRANGEBYSCORE', seqs, '-inf', seq)
for i = 1, #old, 1000 do
  redis.call('HDEL', journal, unpack(old, i, math.min(i + 999, #old)))
end
for _, covered_seq in ipairs(old) do
  local entry_generation = redis.call('HGET', parted, covered_seq)
  if entry_generation then
    redis.call('UNLINK', entry_prefix .. entry_generation)
    redis.call('HDEL', parted, covered_seq)
  end
end
redis.call('ZREMRANGEBYSCORE', seqs, '-inf', seq)
redis.call('HSET', meta, 'snapshot_seq', seq)
redis.call('SADD', scopes, scope)
return 0
"""

_LOAD_LUA = """
local meta, journal, parted = KEYS[1], KEYS[2], KEYS[3]
local state = redis.call('HMGET', meta, 'snapshot_seq', 'snapshot_generation')
local parts = {}
if state[2] then
  parts = redis.call('HGETALL', ARGV[1] .. state[2])
end
local entries = {}
local generations = redis.call('HGETALL', parted)
for i = 1, #generations, 2 do
  entries[#entries + 1] = generations[i]
  entries[#entries + 1] = redis.call('HGETALL', ARGV[2] .. generations[i + 1])
end
return {state[1] or '0', parts, redis.call('HGETALL', journal), entries}
"""

_CLAIM_META_LUA = """
local meta, scopes = KEYS[1], KEYS[2]
redis.call('SADD', scopes, ARGV[1])
local stored = redis.call('HMGET', meta, 'world_size', 'worker_class', 'config_fingerprint')
if stored[1] then
  return stored
end
redis.call('HSET', meta, 'world_size', ARGV[2], 'worker_class', ARGV[3], 'config_fingerprint', ARGV[4])
return {}
"""

_RESET_LUA = """
local scopes, parted = KEYS[#KEYS], KEYS[#KEYS - 1]
local token = redis.call('HGET', KEYS[1], 'reset_token')
if ARGV[2] == '1' and token == ARGV[3] then
  return 0
end
local generation = redis.call('HGET', KEYS[1], 'snapshot_generation')
if generation then
  redis.call('UNLINK', ARGV[4] .. generation)
end
for _, entry_generation in ipairs(redis.call('HVALS', parted)) do
  redis.call('UNLINK', ARGV[5] .. entry_generation)
end
for i = 1, #KEYS - 1 do
  redis.call('DEL', KEYS[i])
end
if ARGV[2] == '1' then
  token = ARGV[3]
end
if token then
  redis.call('HSET', KEYS[1], 'reset_token', token)
  redis.call('SADD', scopes, ARGV[1])
else
  redis.call('SREM', scopes, ARGV[1])
end
return 1
"""

#: Redis's defaults for proto-max-bulk-len and client-query-buffer-limit.
REDIS_MAX_BULK_BYTES = 512 << 20
REDIS_MAX_QUERY_BYTES = 1 << 30


class RedisStateStore(StateStore):
    """The shared backend: a Redis server (standalone, or a managed primary) that every
    node reaches, with ``appendonly yes``. Keys live under ``<namespace>:`` (one
    namespace per application). Each write is one Lua script, so it is atomic; a
    connection failure raises :class:`StateStoreUnavailable`."""

    _KEY_SUFFIXES = ("meta", "journal", "seqs", "fingerprints", "bodies", "order", "parted")
    #: How long the parts of a snapshot being written may take to be complete.
    STAGED_SNAPSHOT_TTL_S = 24 * 3600

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "hybridflow",
        max_answers: int = DEFAULT_MAX_ANSWERS,
        max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
        socket_timeout_s: float = 30.0,
        require_aof: bool = True,
    ) -> None:
        super().__init__(max_answers, max_answer_bytes)
        import redis  # the server extra's dependency; only this backend needs it

        self._errors = redis.exceptions
        if not isinstance(namespace, str) or not namespace or not namespace.isprintable():
            raise ValueError(f"namespace must be a non-empty printable str, got {namespace!r}")
        self.namespace = namespace
        self.url = url
        self._redis = redis.Redis.from_url(url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s)
        try:
            self._check_server(require_aof)
        except BaseException:
            self._redis.close()
            raise
        self._record_script = self._redis.register_script(_RECORD_LUA)
        self._snapshot_script = self._redis.register_script(_SNAPSHOT_LUA)
        self._load_script = self._redis.register_script(_LOAD_LUA)
        self._claim_script = self._redis.register_script(_CLAIM_META_LUA)
        self._reset_script = self._redis.register_script(_RESET_LUA)

    def _check_server(self, require_aof: bool) -> None:
        """Refuse a server that would lose acknowledged state (no append-only file, or a
        policy that evicts keys when memory runs short: journal keys would go), and take
        the server's bound on one value."""
        with self._calls():
            aof = self._redis.info("persistence").get("aof_enabled")
            policy = self._redis.info("memory").get("maxmemory_policy", "noeviction")
        if require_aof and not aof:
            raise ValueError(
                f"Redis at {self.url} runs without its append-only file, so a reply would not mean the state is "
                "written: start it with 'appendonly yes' (or pass require_aof=False knowingly)"
            )
        if policy != "noeviction":
            raise ValueError(
                f"Redis at {self.url} has maxmemory-policy {policy}: when its memory is full it evicts keys, the "
                "journal's among them, and acknowledged calls would be lost. Set 'maxmemory-policy noeviction' "
                "(then a full server refuses writes, which the service answers with 503)"
            )
        bulk = self._config_int("proto-max-bulk-len", REDIS_MAX_BULK_BYTES)
        query = self._config_int("client-query-buffer-limit", REDIS_MAX_QUERY_BYTES)
        self._value_limit(min(bulk, query - SNAPSHOT_PART_BYTES), f"the largest value Redis at {self.url} takes "
                          "(proto-max-bulk-len, or client-query-buffer-limit less a part)")

    def _config_int(self, name: str, default: int) -> int:
        """A server setting, or Redis's default where CONFIG is not allowed (managed servers)."""
        try:
            value = self._redis.config_get(name).get(name)
            return int(value) if value is not None else default
        except (self._errors.ResponseError, ValueError):
            return default

    def close(self) -> None:
        self._redis.close()

    @contextmanager
    def _calls(self) -> Iterator[None]:
        try:
            yield
        except self._errors.ResponseError as exc:
            text = str(exc)
            if text.split(" ", 1)[0] in ("COVERED", "DUPLICATE", "OLDER", "LOST"):
                raise ValueError(text.split(" ", 1)[1]) from None
            raise StateStoreUnavailable(f"Redis at {self.url}: {text}") from exc
        except self._errors.RedisError as exc:
            raise StateStoreUnavailable(f"Redis at {self.url}: {type(exc).__name__}: {exc}") from exc

    def _keys(self, scope: str) -> dict[str, str]:
        return {suffix: f"{self.namespace}:scope:{scope}:{suffix}" for suffix in self._KEY_SUFFIXES}

    def _snapshot_prefix(self, scope: str) -> str:
        return f"{self.namespace}:scope:{scope}:snapshot:"

    def _entry_prefix(self, scope: str) -> str:
        return f"{self.namespace}:scope:{scope}:entry:"

    @property
    def _scopes_key(self) -> str:
        return f"{self.namespace}:scopes"

    def _claim_meta(self, scope: str, meta: ScopeMeta) -> ScopeMeta | None:
        with self._calls():
            stored = self._claim_script(
                keys=[self._keys(scope)["meta"], self._scopes_key],
                args=[scope, meta.world_size, meta.worker_class, meta.config_fingerprint],
            )
        return self._parse_meta(stored) if stored else None

    def _meta(self, scope: str) -> ScopeMeta | None:
        with self._calls():
            stored = self._redis.hmget(self._keys(scope)["meta"], "world_size", "worker_class", "config_fingerprint")
        return self._parse_meta(stored) if stored[0] is not None else None

    @staticmethod
    def _parse_meta(stored: list[bytes]) -> ScopeMeta:
        return ScopeMeta(int(stored[0]), stored[1].decode(), stored[2].decode())

    def _load(self, scope: str) -> ScopeState:
        keys = self._keys(scope)
        with self._calls():  # one script: one consistent read
            snapshot_seq, parts, journal, parted = self._load_script(
                keys=[keys["meta"], keys["journal"], keys["parted"]],
                args=[self._snapshot_prefix(scope), self._entry_prefix(scope)],
            )
        snapshot = _joined(parts)
        by_seq = {int(journal[i]): journal[i + 1] for i in range(0, len(journal), 2)}
        for i in range(0, len(parted), 2):
            by_seq[int(parted[i])] = _joined(parted[i + 1]) or b""
        return ScopeState(snapshot, int(snapshot_seq), sorted(by_seq.items()))

    def _script_keys(self, scope: str, *suffixes: str) -> list[str]:
        keys = self._keys(scope)
        return [keys[suffix] for suffix in suffixes] + [self._scopes_key]

    def _answer_args(self, answer: StoredAnswer | None) -> list[Any]:
        if answer is None:
            return ["", "", "0", "", 0, 0]
        kept = self._as_kept(answer)
        has_body = kept.answer is not None
        return [kept.key, kept.fingerprint, "1" if has_body else "0", kept.answer if has_body else b"",
                self.max_answers, self.max_answer_bytes]

    def _record_keys(self, scope: str, staged: str) -> list[str]:
        keys = self._script_keys(scope, "meta", "journal", "seqs", "fingerprints", "bodies", "order")
        return [*keys, self._keys(scope)["parted"], staged]

    def _record(self, scope: str, seq: int, parts: list[bytes], answer: StoredAnswer | None) -> None:
        if len(parts) == 1:
            keys = self._record_keys(scope, self._entry_prefix(scope))
            with self._calls():
                self._record_script(keys=keys, args=[seq, parts[0], scope, *self._answer_args(answer), ""])
            return
        generation = uuid.uuid4().hex
        staged = self._entry_prefix(scope) + generation
        with self._staged(staged, parts):
            self._record_script(keys=self._record_keys(scope, staged),
                                args=[seq, b"", scope, *self._answer_args(answer), generation])

    @contextmanager
    def _staged(self, staged: str, parts: list[bytes]) -> Iterator[None]:
        """Write ``parts`` under the key ``staged`` a command each (other clients go
        between), expiring unless the block's script makes them permanent; on a failure
        they are removed at once (best effort: the expiry removes them otherwise)."""
        try:
            with self._calls():
                for index, part in enumerate(parts):
                    pipe = self._redis.pipeline(transaction=False)
                    pipe.hset(staged, str(index), part)
                    pipe.expire(staged, self.STAGED_SNAPSHOT_TTL_S)
                    pipe.execute()
                yield
        except BaseException:
            try:
                self._redis.unlink(staged)
            except self._errors.RedisError:
                pass
            raise

    def _get_answer(self, scope: str, key: str) -> StoredAnswer | None:
        keys = self._keys(scope)
        with self._calls():
            pipe = self._redis.pipeline(transaction=True)
            pipe.hget(keys["fingerprints"], key)
            pipe.hget(keys["bodies"], key)
            stored_fingerprint, body = pipe.execute()
        return None if stored_fingerprint is None else StoredAnswer(key, stored_fingerprint.decode(), body)

    def _snapshot(self, scope: str, seq: int, parts: list[bytes]) -> None:
        meta = self._keys(scope)["meta"]
        with self._calls():  # refuse before writing what would be refused
            covered = int(self._redis.hget(meta, "snapshot_seq") or 0)
        if seq < covered:
            raise ValueError(f"a snapshot of {scope!r} at {covered} is newer than {seq}")
        generation = uuid.uuid4().hex
        staged = self._snapshot_prefix(scope) + generation
        keys = self._keys(scope)
        script_keys = [meta, keys["journal"], keys["seqs"], staged, self._scopes_key, keys["parted"]]
        with self._staged(staged, parts):
            self._snapshot_script(keys=script_keys, args=[
                seq, scope, generation, self._snapshot_prefix(scope), self._entry_prefix(scope)])

    def _reset(self, scope: str, once_per: str | None) -> bool:
        keys = self._script_keys(scope, *self._KEY_SUFFIXES)
        flag = "0" if once_per is None else "1"
        with self._calls():
            done = self._reset_script(keys=keys, args=[
                scope, flag, once_per or "", self._snapshot_prefix(scope), self._entry_prefix(scope)])
        return bool(done)

    def _scopes(self) -> list[str]:
        with self._calls():
            return [member.decode() for member in self._redis.smembers(self._scopes_key)]


def _joined(parts: list[bytes]) -> bytes | None:
    """The value of a hash of parts (HGETALL's flat list: index, bytes, ...), or None."""
    by_index = {int(parts[i]): parts[i + 1] for i in range(0, len(parts), 2)}
    return b"".join(by_index[i] for i in range(len(by_index))) if by_index else None

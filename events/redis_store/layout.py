"""How a run's log is laid out in Redis: the keys and the server-side Lua scripts.

Pure data (no ``redis`` import): ``events.redis_store`` runs these scripts and is the
only module that talks to a server. Keys per run (the braces are a Redis Cluster hash
tag, so the append script's two keys always live in one slot)::

    rlc:{<run_id>}:events     stream; entry id 0-<position>, fields type / id / data / h
    rlc:{<run_id>}:meta       hash; epoch (the fencing token), chain_head, chain_len, chain_alg
    rlc:{<run_id>}:snapshot   hash; position, data, chain (newest snapshot only)

``h`` is the entry's hash-chain link (``events.chain``).
    rlc:runs                  set of run ids

An append is ONE script, so a batch is one round trip and one fsync under
``appendfsync always``, and the fencing check, the position check, the idempotent-retry
comparison and the XADDs are atomic. Works on Redis >= 6.2 (no FUNCTION).
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from events.chain import CHAIN_REFUSED
from events.errors import (
    ChainError,
    ConcurrencyError,
    EpochNotClaimedError,
    EventStoreError,
    FencedError,
)


class Script(NamedTuple):
    """A Lua script and its SHA1 (run with EVALSHA, EVAL when the server lacks it)."""

    source: str
    sha: str


def script(source: str) -> Script:
    return Script(source, hashlib.sha1(source.encode()).hexdigest())


RUNS_KEY = "rlc:runs"

# KEYS: stream, meta. ARGV: epoch, expected position, n, previous chain hash ('' for
# the first entry or a log without a chain), chain algorithm (recorded with the first
# chained entry), then (type, id, data, h) * n; h is '' when the log has no chain.
# Replies {appended(1)|replayed(0), first position} or an error "RLC_<KIND> <n>".
# The chain check sits with the epoch and position checks: one script.
APPEND_LUA = """
local epoch = tonumber(ARGV[1])
local expected = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local current = tonumber(redis.call('HGET', KEYS[2], 'epoch') or '0')
if epoch < current then return redis.error_reply('RLC_FENCED ' .. current) end
if epoch > current then return redis.error_reply('RLC_UNCLAIMED ' .. current) end
local len = redis.call('XLEN', KEYS[1])
if len == expected then
  local head = redis.call('HGET', KEYS[2], 'chain_head') or ''
  if ARGV[4] ~= head then return redis.error_reply('RLC_CHAIN ' .. len) end
  local h = ''
  for i = 1, n do
    local b = 5 + (i - 1) * 4
    h = ARGV[b + 4]
    if h == '' then
      redis.call('XADD', KEYS[1], '0-' .. (expected + i),
                 'type', ARGV[b + 1], 'id', ARGV[b + 2], 'data', ARGV[b + 3])
    else
      redis.call('XADD', KEYS[1], '0-' .. (expected + i),
                 'type', ARGV[b + 1], 'id', ARGV[b + 2], 'data', ARGV[b + 3], 'h', h)
    end
  end
  if h ~= '' then
    redis.call('HSET', KEYS[2], 'chain_head', h, 'chain_len', expected + n)
    if ARGV[4] == '' then redis.call('HSET', KEYS[2], 'chain_alg', ARGV[5]) end
  end
  return {1, expected + 1}
end
if len < expected then return redis.error_reply('RLC_BEHIND ' .. len) end
local entries = redis.call('XRANGE', KEYS[1], '0-' .. (expected + 1), '0-' .. (expected + n))
if #entries < n then return redis.error_reply('RLC_PARTIAL ' .. len) end
for i = 1, n do
  local fields = entries[i][2]
  local stored, h = false, ''
  for j = 1, #fields, 2 do
    if fields[j] == 'id' then stored = fields[j + 1] end
    if fields[j] == 'h' then h = fields[j + 1] end
  end
  if stored ~= ARGV[5 + (i - 1) * 4 + 2] then
    return redis.error_reply('RLC_MISMATCH ' .. len .. ' ' .. (expected + i))
  end
  if h ~= ARGV[5 + i * 4] then return redis.error_reply('RLC_CHAIN ' .. len) end
end
return {0, expected + 1}
"""

# KEYS: snapshot hash, stream. ARGV: position, data. Keeps the newest snapshot only,
# with the chain hash of the entry at its position ('' when none).
SNAPSHOT_LUA = """
local cur = redis.call('HGET', KEYS[1], 'position')
if cur and tonumber(cur) > tonumber(ARGV[1]) then return 0 end
local h = ''
local e = redis.call('XRANGE', KEYS[2], '0-' .. ARGV[1], '0-' .. ARGV[1])
if #e == 1 then
  local f = e[1][2]
  for j = 1, #f, 2 do if f[j] == 'h' then h = f[j + 1] end end
end
redis.call('HSET', KEYS[1], 'position', ARGV[1], 'data', ARGV[2], 'chain', h)
return 1
"""

# KEYS: stream. ARGV: type, id, data. Unchecked append, for tests and repair tools.
RAW_LUA = """
local pos = redis.call('XLEN', KEYS[1]) + 1
redis.call('XADD', KEYS[1], '0-' .. pos, 'type', ARGV[1], 'id', ARGV[2], 'data', ARGV[3])
return pos
"""


def events_key(run_id: str) -> str:
    return f"rlc:{{{run_id}}}:events"


def meta_key(run_id: str) -> str:
    return f"rlc:{{{run_id}}}:meta"


def snapshot_key(run_id: str) -> str:
    return f"rlc:{{{run_id}}}:snapshot"


# KEYS: stream. ARGV: first position, count. Reply: {first id, last id, msgpack array of
# the entries' data fields}. One bulk string per page: redis-py's pure-Python parser
# would otherwise spend more time on 20k bulk strings than the fold spends on them.
# Read-only: works on replicas and under EVAL_RO-only ACLs alike.
PAGE_LUA = """
local e = redis.call('XRANGE', KEYS[1], '0-' .. ARGV[1], '+', 'COUNT', tonumber(ARGV[2]))
if #e == 0 then return {'', '', ''} end
local out = {}
for i = 1, #e do
  local f = e[i][2]
  if f[5] == 'data' then
    out[i] = f[6]
  else
    local d = ''
    for j = 1, #f, 2 do if f[j] == 'data' then d = f[j + 1] end end
    out[i] = d
  end
end
return {e[1][1], e[#e][1], cmsgpack.pack(out)}
"""

APPEND = script(APPEND_LUA)
SNAPSHOT = script(SNAPSHOT_LUA)
RAW_APPEND = script(RAW_LUA)
PAGE = script(PAGE_LUA)


def append_error(run_id: str, epoch: int, expected: int, message: str) -> EventStoreError:
    """Turn the script's ``RLC_<KIND> <n> ...`` error reply into a typed error."""
    words = message.split()
    kind = words[0] if words else ""
    number = int(words[1]) if len(words) > 1 and words[1].isdigit() else -1
    if kind == "RLC_FENCED":
        return FencedError(run_id, epoch, number)
    if kind == "RLC_UNCLAIMED":
        return EpochNotClaimedError(run_id, epoch, number)
    if kind == "RLC_BEHIND":
        return ConcurrencyError(run_id, expected, number, "log is behind")
    if kind == "RLC_PARTIAL":
        return ConcurrencyError(
            run_id, expected, number, "log moved by fewer entries than the batch (partial overlap)"
        )
    if kind == "RLC_CHAIN":
        return ChainError(run_id, expected + 1, CHAIN_REFUSED)
    if kind == "RLC_MISMATCH":
        where = words[2] if len(words) > 2 else "?"
        return ConcurrencyError(
            run_id, expected, number, f"position {where} holds a different event id"
        )
    return EventStoreError(f"run {run_id!r}: append failed: {message}")

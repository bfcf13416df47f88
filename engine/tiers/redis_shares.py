"""Per-tenant shares of the shared Redis store: each tenant's bytes counted, and bounded, on the Redis server.

With ``redis_max_bytes_per_tenant`` set, every block written to the store is
charged to a tenant (the one whose request computed it on the writing server;
engine/block_manager.py ``Block.tenant``; ``default`` when none), and three
Lua scripts, each atomic on the server, keep the accounts::

    pdserve:kv:<ns>:<hash>                 the block (as without shares)
    pdserve:kvshare:<ns>:blocks            hash: <hash> -> "<tenant> <bytes>"  (who is charged, how much)
    pdserve:kvshare:<ns>:bytes             hash: <tenant> -> bytes charged now
    pdserve:kvshare:<ns>:lru:<tenant>      sorted set: the tenant's blocks, least recently used first
    pdserve:kvshare:<ns>:tick              the LRU's clock (INCR)

- ``WRITE``: a block the store holds already is left as it is, charged to
  whoever wrote it first (a prefix two tenants share costs the first one, once;
  the other's write is free, as its reads are). A block larger than the share
  is refused. Otherwise the tenant's own least recently used blocks are
  deleted until the new one fits in its share (never another tenant's), then
  the block is set, listed and counted.
- ``TOUCH`` (with each read): a hit moves the block to the end of its owner's
  LRU; a block listed but gone (deleted by hand, or evicted by Redis's own
  ``maxmemory`` policy) is unlisted and its bytes uncharged.
- ``DROP``: a corrupt block is deleted and uncharged together.

A store past its ``maxmemory`` refuses ``WRITE`` whole before it runs (counted as
the tenant's refused write); ``TOUCH`` and ``DROP`` only shrink it and run.

So the counters equal the bytes of the listed blocks after every script, and
every listed block whose key vanished under them is uncharged the next time a
server reads or writes it. For the accounts to be all there is, Redis should
not evict on its own: run it with ``maxmemory-policy noeviction`` (a write past
``maxmemory`` is then refused, counted as the tenant's refused write) or
``volatile-lru`` (the store's keys have no expiry, so nothing is evicted
either). ``allkeys-lru`` may evict the accounts themselves; the tier warns at
start when it sees that policy. Scripts name keys they compute (the evicted
blocks, another tenant's LRU), so the store is one Redis server, not a Redis
Cluster.
"""

from __future__ import annotations

import re

# Tenants' names are checked where they arrive (engine/request.py TENANT_NAME, at the servers' wire); a
# name going into a key and a record is checked again here, so no caller can break a record's format.
_SAFE = re.compile(r"[a-z0-9-]{1,63}")

_FORGET = """
local function forget(meta, member)
  local record = redis.call('HGET', meta .. 'blocks', member)
  if not record then return 0 end
  local tenant, size = string.match(record, '^(%S+) (%d+)$')
  size = tonumber(size)
  redis.call('HDEL', meta .. 'blocks', member)
  redis.call('ZREM', meta .. 'lru:' .. tenant, member)
  if redis.call('HINCRBY', meta .. 'bytes', tenant, -size) == 0 then
    redis.call('HDEL', meta .. 'bytes', tenant)
  end
  return size
end
"""

# KEYS[1]: the block's key. ARGV: meta prefix, block prefix, member, value, tenant, share.
# Returns {outcome, evicted, tenant, bytes, tenant, bytes, ...}: 1 stored, 0 held already, -1 refused.
WRITE = (
    "#!lua\n"  # flags none: refused whole, before it runs, when the store is past maxmemory
    + _FORGET
    + """
local meta, member, value, tenant, share = ARGV[1], ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6])
local function accounts(outcome, evicted)
  local out = {outcome, evicted}
  for _, v in ipairs(redis.call('HGETALL', meta .. 'bytes')) do table.insert(out, v) end
  return out
end
if redis.call('EXISTS', KEYS[1]) == 1 then return accounts(0, 0) end
forget(meta, member)
local size = string.len(value)
if size > share then return accounts(-1, 0) end
local lru = meta .. 'lru:' .. tenant
local held = tonumber(redis.call('HGET', meta .. 'bytes', tenant) or '0')
local evicted = 0
while held + size > share do
  local oldest = redis.call('ZPOPMIN', lru)
  if #oldest == 0 then return accounts(-1, evicted) end
  held = held - forget(meta, oldest[1])
  redis.call('DEL', ARGV[2] .. oldest[1])
  evicted = evicted + 1
end
redis.call('SET', KEYS[1], value)
redis.call('ZADD', lru, redis.call('INCR', meta .. 'tick'), member)
redis.call('HSET', meta .. 'blocks', member, tenant .. ' ' .. size)
redis.call('HINCRBY', meta .. 'bytes', tenant, size)
return accounts(1, evicted)
"""
)

# KEYS[1]: the block's key. ARGV: meta prefix, member. After a read: a listed block held moves to the end
# of its owner's LRU; one gone is unlisted.
TOUCH = (
    "#!lua flags=allow-oom\n"  # it only reorders or removes
    + _FORGET
    + """
local meta, member = ARGV[1], ARGV[2]
local record = redis.call('HGET', meta .. 'blocks', member)
if not record then return 0 end
if redis.call('EXISTS', KEYS[1]) == 0 then return -forget(meta, member) end
local tenant = string.match(record, '^(%S+) ')
redis.call('ZADD', meta .. 'lru:' .. tenant, 'XX', redis.call('INCR', meta .. 'tick'), member)
return 1
"""
)

# KEYS[1]: the block's key. ARGV: meta prefix, member. Deletes a block and its listing together.
DROP = (
    "#!lua flags=allow-oom\n"
    + _FORGET
    + """
redis.call('DEL', KEYS[1])
return forget(ARGV[1], ARGV[2])
"""
)


def safe_tenant(tenant: str) -> bool:
    """Whether ``tenant`` may go into a key name and a record (lowercase letters, digits, '-')."""
    return _SAFE.fullmatch(tenant) is not None


def accounts(flat: list) -> dict[str, int]:
    """The ``bytes`` hash as a script returns it (tenant, bytes, tenant, bytes, ...)."""
    return {_text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

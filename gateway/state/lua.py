"""The Redis scripts of the shared quota ledger and of fleet membership.

Owns the server-side half of ``gateway.state.redis``: each script runs atomically in Redis,
one round trip per call. The quota scripts apply the rules of ``gateway.core.quota``'s
``QuotaLedger`` (its module docstring is the specification: buckets, the full-bucket rule,
the class share as parent bucket, bounded borrowing, debt blocks borrowing, concurrency and
queued-work limits, live-token-ms, reserve -> start -> settle/release, idempotent closing),
with one addition the in-memory ledger does not need: every reservation is a *lease* that
expires unless its replica renews it, and an expired lease closes as settled at its
prediction (the request may have run; its replica is gone), so a dead replica's open
reservations, queued work and borrowing come back by themselves; and a second, that a
reservation may hold several units of concurrency (a replica's quota slice,
``gateway.state.redis_store``: one reservation of a share of the accelerator-ms bucket, of
the live-token-ms bucket and of the concurrency, taken by ``RESERVE`` in one atomic call and
closed by ``SETTLE`` at what its requests were charged of both, which returns the unused
rest of both). ``tests/test_state_quota.py`` runs the same cases through both ledgers (one
request per reservation) and compares every answer, and checks the slices' books against
the core ledger's.

Numbers travel as strings (``%.17g``): Lua would truncate a returned double to an integer.
The bucket parameters (rates, capacities, limits) come from the caller's resolved
``AccountTerms`` on every call, so every replica must run the same quota configuration.
Time is Redis's own clock (``TIME``) unless a caller passes ``now`` (the tests do), so
replicas' clocks never need to agree.

Keys of one request class share a hash tag (``{prefix:q:CLASS}``): each script touches one
class's keys only. Per account (tenant or the ``*`` pool): ``a:`` hash (bucket levels,
queued ms, queued count, borrowed ms), ``o:`` hash (open reservations: id -> record), ``l:``
sorted set (id -> lease expiry). Per class: ``c`` hash (the share's bucket), ``ids`` counter.
Open record: ``demand live borrowed started queued metered owner units`` (started -1: queued;
units: the concurrency it holds, 1 but for a replica's quota slice, whose extra units the
account's ``xu`` field sums so the concurrency limit counts them).
"""

from __future__ import annotations

from typing import Final

__all__ = ["HEARTBEAT", "OUTSTANDING", "RENEW", "RESERVE", "SETTLE", "SLOT_ACQUIRE", "SLOT_RELEASE", "START"]

_COMMON: Final = r"""
local EPS = 1e-6
local function num(x) return string.format('%.17g', x) end
local function clock(arg)
  if arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function bucket(key, p, rate, cap)
  local v = redis.call('HMGET', key, p .. 'lvl', p .. 'upd')
  local b = {key = key, p = p, rate = rate, cap = cap, lvl = cap, upd = nil}
  if v[1] then b.lvl = tonumber(v[1]) end
  if v[2] then b.upd = tonumber(v[2]) end
  return b
end
local function level_at(b, now)
  if b.upd == nil then return b.lvl end
  local e = now - b.upd
  if e < 0 then e = 0 end
  return math.min(b.cap, b.lvl + b.rate * e)
end
local function refill(b, now)
  b.lvl = level_at(b, now)
  if b.upd == nil or now > b.upd then b.upd = now end
end
local function credit(b, x) b.lvl = math.min(b.cap, b.lvl + x) end
local function save(b) redis.call('HSET', b.key, b.p .. 'lvl', num(b.lvl), b.p .. 'upd', num(b.upd)) end
local function wait_ms(b, need)
  local deficit = need - b.lvl - EPS
  if deficit <= 0 then return 0 end
  return math.max(1, math.ceil(deficit / b.rate * 1000))
end
local function parse(v)
  local f = {}
  for w in string.gmatch(v, '%S+') do f[#f + 1] = w end
  return {demand = tonumber(f[1]), live = tonumber(f[2]), borrowed = tonumber(f[3]),
          started = tonumber(f[4]), queued = tonumber(f[5]), metered = tonumber(f[6]), owner = f[7],
          units = tonumber(f[8] or '1')}
end
local function unparse(r)
  return table.concat({num(r.demand), num(r.live), num(r.borrowed), num(r.started),
                       tostring(r.queued), tostring(r.metered), r.owner, tostring(r.units)}, ' ')
end
-- Open reservations count one unit of concurrency each; a quota slice counts its units.
local function open_units(acct, open)
  return redis.call('HLEN', open) + tonumber(redis.call('HGET', acct, 'xu') or '0')
end
local function account_state(acct)
  local a = redis.call('HMGET', acct, 'queued', 'nq', 'borrowed')
  return tonumber(a[1] or '0'), tonumber(a[2] or '0'), tonumber(a[3] or '0')
end
-- Drop an open reservation's bookkeeping (the buckets are the caller's business).
local function forget(acct, open, leases, id, r)
  redis.call('HDEL', open, id)
  redis.call('ZREM', leases, id)
  if r.metered == 1 then
    local queued, nq, borrowed = account_state(acct)
    if r.queued == 1 then
      nq = nq - 1
      queued = queued - r.demand
    end
    if nq <= 0 then nq = 0; queued = 0 elseif queued < 0 then queued = 0 end
    local xu = tonumber(redis.call('HGET', acct, 'xu') or '0') - (r.units - 1)
    if redis.call('HLEN', open) == 0 then
      borrowed = 0; xu = 0
    else
      borrowed = math.max(0, borrowed - r.borrowed)
    end
    redis.call('HSET', acct, 'queued', num(queued), 'nq', tostring(nq), 'borrowed', num(borrowed),
               'xu', tostring(math.max(0, xu)))
  end
end
-- Expired leases close as settled at their prediction: no bucket moves.
local function reap(acct, open, leases, now)
  local ids = redis.call('ZRANGEBYSCORE', leases, '-inf', num(now))
  for _, id in ipairs(ids) do
    local v = redis.call('HGET', open, id)
    if v then forget(acct, open, leases, id, parse(v)) else redis.call('ZREM', leases, id) end
  end
  return #ids
end
"""

RESERVE: Final = (
    _COMMON
    + r"""
-- KEYS: acct, open, leases, class, ids
-- ARGV: now, ttl_s, metered, rate, cap, live_rate, live_cap, borrow_limit, max_concurrent,
--       max_queued_ms, class_rate, class_cap, demand, live_demand, owner, units   ('' = none)
-- units: the concurrency the reservation holds (a quota slice: several; '' = 1).
-- A quota slice is one reservation: demand and live_demand are its shares of the account's
-- accelerator-ms and live-token-ms buckets, both checked and debited here, atomically.
-- Answers: {'ok', id, borrowed, now, level, class level, account borrowed, open units, queued,
-- live level} or {'refused', rule, wait, need, level (the rule's), open units, queued, level,
-- live level}; levels after this call, '' where the account has no such bucket.
local acct, open, leases = KEYS[1], KEYS[2], KEYS[3]
local units = tonumber(ARGV[16] or '') or 1
local now = clock(ARGV[1])
local ttl = tonumber(ARGV[2])
reap(acct, open, leases, now)
local demand, live_demand = tonumber(ARGV[13]), tonumber(ARGV[14])
local parent = nil
if ARGV[11] ~= '' then
  parent = bucket(KEYS[4], '', tonumber(ARGV[11]), tonumber(ARGV[12]))
  refill(parent, now)
end
local function open_reservation(borrowed, metered)
  local id = redis.call('INCR', KEYS[5])
  local r = {demand = demand, live = live_demand, borrowed = borrowed, started = -1,
             queued = metered, metered = metered, owner = ARGV[15], units = units}
  redis.call('HSET', open, id, unparse(r))
  if units > 1 then redis.call('HINCRBY', acct, 'xu', units - 1) end
  redis.call('ZADD', leases, now + ttl, id)
  return id
end
if ARGV[3] == '0' then
  if parent then parent.lvl = parent.lvl - demand; save(parent) end
  local id = open_reservation(0, 0)
  return {'ok', tostring(id), '0', num(now), '', parent and num(parent.lvl) or '', '0', '0', '0', ''}
end
local acc = bucket(acct, 'a', tonumber(ARGV[4]), tonumber(ARGV[5]))
refill(acc, now)
local live = nil
if ARGV[6] ~= '' then
  live = bucket(acct, 'l', tonumber(ARGV[6]), tonumber(ARGV[7]))
  refill(live, now)
end
local borrow_limit = tonumber(ARGV[8])
local queued, nq, borrowed = account_state(acct)
local open_count = open_units(acct, open)
local best = nil
local function refuse(rule, wait, need, level)
  if best == nil or wait > best[2] then best = {rule, wait, need, level} end
end
if ARGV[9] ~= '' and open_count + units > tonumber(ARGV[9]) then
  local soonest = nil
  for _, v in ipairs(redis.call('HVALS', open)) do
    local r = parse(v)
    local remaining = r.demand
    if r.started >= 0 then
      remaining = r.demand - (now - r.started) * 1000
      if remaining <= 0 then remaining = r.demand end
    end
    if soonest == nil or remaining < soonest then soonest = remaining end
  end
  local wait = 1
  if soonest ~= nil then wait = math.max(1, math.ceil(soonest)) end
  refuse('quota.concurrency', wait, 0, 0)
end
if ARGV[10] ~= '' then
  local limit = tonumber(ARGV[10])
  if nq > 0 and queued + demand > limit + EPS then
    local excess = math.min(queued, queued + demand - limit)
    refuse('quota.queued_work', math.max(1, math.ceil((excess - EPS) / acc.rate * 1000)), 0, 0)
  end
end
if live then
  local need = math.min(live_demand, live.cap)
  if not (live.lvl >= need - EPS) then refuse('quota.live_token_ms', wait_ms(live, need), need, live.lvl) end
end
local need = math.min(demand, acc.cap)
local grant = nil
if acc.lvl >= need - EPS then
  grant = 0
elseif parent ~= nil and borrow_limit > 0 and acc.lvl >= -EPS then
  local b = demand - math.max(0, acc.lvl)
  if borrowed + b <= borrow_limit + EPS and parent.lvl >= demand - EPS then grant = b end
end
if grant == nil then refuse('quota.accelerator_ms', wait_ms(acc, need), need, acc.lvl) end
if best ~= nil then
  return {'refused', best[1], tostring(best[2]), num(best[3]), num(best[4]), tostring(open_count),
          num(queued), num(acc.lvl), live and num(live.lvl) or ''}
end
acc.lvl = acc.lvl - (demand - grant)
save(acc)
if parent then parent.lvl = parent.lvl - demand; save(parent) end
if live then live.lvl = live.lvl - live_demand; save(live) end
borrowed = borrowed + grant
queued = queued + demand
redis.call('HSET', acct, 'queued', num(queued), 'nq', tostring(nq + 1), 'borrowed', num(borrowed))
local id = open_reservation(grant, 1)
return {'ok', tostring(id), num(grant), num(now), num(acc.lvl), parent and num(parent.lvl) or '',
        num(borrowed), tostring(open_count + units), num(queued), live and num(live.lvl) or ''}
"""
)

SETTLE: Final = (
    _COMMON
    + r"""
-- KEYS: acct, open, leases, class
-- ARGV: now, id, charged_ms, charged_live_token_ms, rate, cap, live_rate, live_cap,
--       class_rate, class_cap
-- A quota slice closes charged what its requests were charged of both buckets: the unused
-- rest of its accelerator-ms and live-token-ms shares goes back.
local acct, open, leases = KEYS[1], KEYS[2], KEYS[3]
local now = clock(ARGV[1])
local id = ARGV[2]
local v = redis.call('HGET', open, id)
if not v then
  reap(acct, open, leases, now)
  return {'closed'}
end
local r = parse(v)
local charged = tonumber(ARGV[3])
local delta = charged - r.demand
local parent_level = ''
if ARGV[9] ~= '' then
  local parent = bucket(KEYS[4], '', tonumber(ARGV[9]), tonumber(ARGV[10]))
  refill(parent, now)
  if delta >= 0 then parent.lvl = parent.lvl - delta else credit(parent, -delta) end
  save(parent)
  parent_level = num(parent.lvl)
end
local level = ''
if r.metered == 1 then
  local acc = bucket(acct, 'a', tonumber(ARGV[5]), tonumber(ARGV[6]))
  refill(acc, now)
  if delta >= 0 then acc.lvl = acc.lvl - delta else credit(acc, math.min(r.demand - r.borrowed, -delta)) end
  save(acc)
  level = num(acc.lvl)
  if ARGV[7] ~= '' then
    local live = bucket(acct, 'l', tonumber(ARGV[7]), tonumber(ARGV[8]))
    refill(live, now)
    local live_delta = tonumber(ARGV[4]) - r.live
    if live_delta >= 0 then live.lvl = live.lvl - live_delta else credit(live, -live_delta) end
    save(live)
  end
end
forget(acct, open, leases, id, r)
reap(acct, open, leases, now)
local queued, _, borrowed = account_state(acct)
return {'ok', num(r.demand), num(charged), num(r.live), level, parent_level, num(borrowed),
        tostring(open_units(acct, open)), num(queued)}
"""
)

START: Final = (
    _COMMON
    + r"""
-- KEYS: acct, open; ARGV: now, id
local now = clock(ARGV[1])
local v = redis.call('HGET', KEYS[2], ARGV[2])
if not v then return 0 end
local r = parse(v)
if r.started >= 0 then return 0 end
r.started = now
local was_queued = r.queued
r.queued = 0
redis.call('HSET', KEYS[2], ARGV[2], unparse(r))
if r.metered == 1 and was_queued == 1 then
  local queued, nq, borrowed = account_state(KEYS[1])
  nq = nq - 1
  if nq > 0 then queued = math.max(0, queued - r.demand) else nq = 0; queued = 0 end
  redis.call('HSET', KEYS[1], 'queued', num(queued), 'nq', tostring(nq))
end
return 1
"""
)

RENEW: Final = r"""
-- KEYS: leases; ARGV: now ('' = TIME), ttl_s, ids...: push back the leases still open
local now
if ARGV[1] ~= '' then now = tonumber(ARGV[1]) else
  local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000 end
local n = 0
for i = 3, #ARGV do n = n + redis.call('ZADD', KEYS[1], 'XX', 'CH', now + tonumber(ARGV[2]), ARGV[i]) end
return n
"""

OUTSTANDING: Final = (
    _COMMON
    + r"""
-- KEYS: acct, open, leases; ARGV: now. Reaps, then: count, demand, live, borrowed, owner, n, ...
local now = clock(ARGV[1])
reap(KEYS[1], KEYS[2], KEYS[3], now)
local count, demand, live, borrowed = 0, 0, 0, 0
local owners = {}
for _, v in ipairs(redis.call('HVALS', KEYS[2])) do
  local r = parse(v)
  count = count + 1
  demand = demand + r.demand
  live = live + r.live
  borrowed = borrowed + r.borrowed
  owners[r.owner] = (owners[r.owner] or 0) + 1
end
local out = {tostring(count), num(demand), num(live), num(borrowed)}
for owner, n in pairs(owners) do out[#out + 1] = owner; out[#out + 1] = tostring(n) end
return out
"""
)

HEARTBEAT: Final = r"""
-- KEYS: members; ARGV: replica id, ttl_s. The live members (this one included), by name.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""

SLOT_ACQUIRE: Final = r"""
-- KEYS: leases (id -> expiry), ends (id -> predicted end); ARGV: now ('' = TIME), ttl_s, limit,
-- id, cost_ms, devices. Reaps expired leases; grants if fewer than limit are held, else answers
-- how long until the soonest predicted end (at least 5 ms: work running past its prediction).
-- A grant answers its predicted wait in the backend's queue: with as many leases held as the
-- D devices (or more), it starts when the first device frees, the soonest predicted end (work
-- past its prediction ends now), taken with the rest of the queue as one batch (the backend's
-- dynamic batcher, as the dispatch queue's own list schedule has it); its own predicted end is
-- that start plus its cost.
local now
if ARGV[1] ~= '' then now = tonumber(ARGV[1]) else
  local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000 end
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%.17g', now))) do
  redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[2], id)
end
local held = redis.call('ZCARD', KEYS[1])
if held < tonumber(ARGV[3]) then
  local ends = {}
  for _, v in ipairs(redis.call('HVALS', KEYS[2])) do ends[#ends + 1] = tonumber(v) end
  local devices = tonumber(ARGV[6])
  local start = now
  if devices > 0 and #ends >= devices then
    local frees = math.min(unpack(ends))
    if frees > now then start = frees end
  end
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[4])
  redis.call('HSET', KEYS[2], ARGV[4], string.format('%.17g', start + tonumber(ARGV[5]) / 1000))
  return {1, held + 1, string.format('%.17g', start - now)}
end
local soonest = nil
for _, v in ipairs(redis.call('HVALS', KEYS[2])) do
  local t = tonumber(v)
  if soonest == nil or t < soonest then soonest = t end
end
local wait = 0.005
if soonest ~= nil and soonest - now > wait then wait = soonest - now end
return {0, string.format('%.17g', wait)}
"""

SLOT_REEND: Final = r"""
-- KEYS: leases, ends; ARGV: id, predicted_ms. A lingering lease bound again by its replica: its
-- new predicted end, only while the lease is still held (a late call leaves no end behind).
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('HSET', KEYS[2], ARGV[1], string.format('%.17g', now + tonumber(ARGV[2]) / 1000))
return 1
"""

SLOT_RELEASE: Final = r"""
-- KEYS: leases, ends; ARGV: id
redis.call('HDEL', KEYS[2], ARGV[1])
return redis.call('ZREM', KEYS[1], ARGV[1])
"""

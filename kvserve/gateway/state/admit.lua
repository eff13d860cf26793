-- Admit a request against every check or none, in one atomic step (Redis runs a script alone).
-- KEYS, per check: rpm -> window hash (second -> amount); tpm -> that, and a hash request -> the
-- second it was admitted in (settle.lua corrects that bucket); parallel -> slot zset (request ->
-- expiry ms); budget -> budget hash {period, spent}, reservation zset, reservation amounts hash.
-- ARGV: request_id, ttl_ms, n, then per check: kind, limit, amount, period_ms.
-- Returns {1, remaining..., reset_ms...} or {0, failed check index, retry_after_ms (-1: never),
-- reset_ms, a budget's spend in its period as text ('' for other checks)}, or {-1, check index, now_ms} for a budget hash never seeded from the spend log
-- (seed.lua), changing nothing. reset_ms: until an rpm / tpm window's newest second has left it
-- (0 for other checks).
-- The last KEY records an admission for a minute: the same request admitted again (the client
-- resent the script after a connection lost its reply) gets that answer and counts nothing twice.
local memo = KEYS[#KEYS]
local seen = redis.call('GET', memo)
if seen then return cjson.decode(seen) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local sec = math.floor(now / 1000)
local rid, ttl, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local eps = 1e-9
local checks, ki, ai = {}, 1, 4
for i = 1, n do
  local c = {kind = ARGV[ai], limit = tonumber(ARGV[ai + 1]), amount = tonumber(ARGV[ai + 2]),
             period = tonumber(ARGV[ai + 3]), k = ki}
  ai = ai + 4
  if c.kind == 'budget' then ki = ki + 3 elseif c.kind == 'tpm' then ki = ki + 2 else ki = ki + 1 end
  checks[i] = c
end
for i, c in ipairs(checks) do
  local retry = 1000
  if c.kind == 'rpm' or c.kind == 'tpm' then
    local h = redis.call('HGETALL', KEYS[c.k])
    local used, buckets = 0, {}
    c.newest = nil
    for j = 1, #h, 2 do
      local s, v = tonumber(h[j]), tonumber(h[j + 1])
      if s <= sec - 60 then redis.call('HDEL', KEYS[c.k], h[j])
      else
        used = used + v; buckets[#buckets + 1] = {s, v}
        if c.newest == nil or s > c.newest then c.newest = s end
      end
    end
    c.used = used
    if used + c.amount > c.limit then
      table.sort(buckets, function(a, b) return a[1] < b[1] end)
      local need = used + c.amount - c.limit
      retry = 60000
      for _, b in ipairs(buckets) do
        need = need - b[2]
        if need <= 0 then retry = (b[1] + 60) * 1000 - now; break end
      end
    end
  elseif c.kind == 'parallel' then
    redis.call('ZREMRANGEBYSCORE', KEYS[c.k], '-inf', now)
    c.used = redis.call('ZCARD', KEYS[c.k])
  else
    local b, z, a = KEYS[c.k], KEYS[c.k + 1], KEYS[c.k + 2]
    -- A budget without 'seeded' is one this Redis never held, or lost (restarted without
    -- persistence): a spend of 0 would let the key spend its whole budget again.
    if redis.call('HGET', b, 'seeded') ~= '1' then return {-1, i, now} end
    -- One an earlier version held counted a `7d` or `30d` period from the epoch: its spend
    -- belongs to another window, so it is seeded again for the calendar one (seed.lua).
    if calendar_aligned(c.period) and redis.call('HGET', b, 'calendar') ~= '1' then return {-1, i, now} end
    local idx = period_index(now, c.period)
    if tonumber(redis.call('HGET', b, 'period') or '-1') ~= idx then
      redis.call('HSET', b, 'period', idx, 'spent', 0)
    end
    -- No TTL: a volatile key is one Redis may evict under maxmemory (volatile-lru), and an
    -- evicted budget forgot the period's spend; the period index above resets it instead.
    redis.call('PERSIST', b)  -- (a hash an earlier version wrote with a TTL)
    local expired = redis.call('ZRANGEBYSCORE', z, '-inf', now)
    if #expired > 0 then
      redis.call('ZREMRANGEBYSCORE', z, '-inf', now)
      redis.call('HDEL', a, unpack(expired))
    end
    local reserved = 0
    for _, v in ipairs(redis.call('HVALS', a)) do reserved = reserved + tonumber(v) end
    local spent = tonumber(redis.call('HGET', b, 'spent'))
    c.used, c.spent = spent + reserved, spent
    if spent + c.amount > c.limit * (1 + eps) then  -- the spend alone: only a reset makes room
      if c.period > 0 then retry = period_start(idx + 1, c.period) - now else retry = -1 end  -- -1: never
    end
  end
  if c.used + c.amount > c.limit * (1 + eps) then
    local reset = 0
    if c.newest ~= nil then reset = math.max((c.newest + 60) * 1000 - now, 0) end
    local spent = ''  -- (text: Redis would truncate a Lua number to an integer)
    if c.spent ~= nil then spent = tostring(c.spent) end
    if retry < 0 then return {0, i, -1, reset, spent} end
    return {0, i, math.max(math.floor(retry), 1), reset, spent}
  end
end
local out = {1}
for i, c in ipairs(checks) do
  if c.kind == 'rpm' or c.kind == 'tpm' then
    redis.call('HINCRBY', KEYS[c.k], sec, c.amount)
    redis.call('PEXPIRE', KEYS[c.k], 61000)
    if c.kind == 'tpm' then
      redis.call('HSET', KEYS[c.k + 1], rid, sec)
      redis.call('PEXPIRE', KEYS[c.k + 1], 61000)
    end
  elseif c.kind == 'parallel' then
    redis.call('ZADD', KEYS[c.k], now + ttl, rid)
    redis.call('PEXPIRE', KEYS[c.k], ttl + 1000)
  else
    redis.call('ZADD', KEYS[c.k + 1], now + ttl, rid)
    redis.call('HSET', KEYS[c.k + 2], rid, tostring(c.amount))
    redis.call('PEXPIRE', KEYS[c.k + 1], ttl + 1000)
    redis.call('PEXPIRE', KEYS[c.k + 2], ttl + 1000)
  end
  out[#out + 1] = tostring(c.limit - c.used - c.amount)
end
for i, c in ipairs(checks) do
  if c.kind == 'rpm' or c.kind == 'tpm' then out[#out + 1] = (sec + 60) * 1000 - now else out[#out + 1] = 0 end
end
redis.call('SET', memo, cjson.encode(out), 'PX', 60000)
return out

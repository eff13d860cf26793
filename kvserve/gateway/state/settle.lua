-- Settle a finished (or failed) request atomically: release parallel slots, move budget
-- reservations to spend at the actual cost, correct tpm by (actual - reserved) tokens.
-- KEYS as in admit.lua, then one that marks the request settled for a minute: a settlement sent
-- again (after a connection lost the first one's reply) changes nothing, so spend is charged once.
-- ARGV: request_id, n, then per check: kind, reserved, actual, period_ms.
if not redis.call('SET', KEYS[#KEYS], '1', 'NX', 'PX', 60000) then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local sec = math.floor(now / 1000)
local rid, n = ARGV[1], tonumber(ARGV[2])
local ki, ai = 1, 3
for i = 1, n do
  local kind, reserved, actual, period = ARGV[ai], tonumber(ARGV[ai + 1]), ARGV[ai + 2], tonumber(ARGV[ai + 3])
  ai = ai + 4
  if kind == 'tpm' then
    -- More tokens than reserved count now; fewer come off the bucket the reservation is in, if
    -- it is still in the window (taken off the current one, the window went below what it
    -- held once that bucket left it, and admitted more than the limit for that long).
    local delta = math.floor(tonumber(actual) - reserved)
    local at = redis.call('HGET', KEYS[ki + 1], rid)
    redis.call('HDEL', KEYS[ki + 1], rid)
    if delta > 0 then
      redis.call('HINCRBY', KEYS[ki], sec, delta)
      redis.call('PEXPIRE', KEYS[ki], 61000)
    elseif delta < 0 and at and tonumber(at) > sec - 60 and redis.call('HEXISTS', KEYS[ki], at) == 1 then
      redis.call('HINCRBY', KEYS[ki], at, delta)
    end
  elseif kind == 'parallel' then
    redis.call('ZREM', KEYS[ki], rid)
  elseif kind == 'budget' then
    local b = KEYS[ki]
    redis.call('ZREM', KEYS[ki + 1], rid)
    redis.call('HDEL', KEYS[ki + 2], rid)
    local idx = period_index(now, period)
    if tonumber(redis.call('HGET', b, 'period') or '-1') ~= idx then
      redis.call('HSET', b, 'period', idx, 'spent', 0)
      redis.call('PERSIST', b)  -- no TTL: see admit.lua
    end
    redis.call('HINCRBYFLOAT', b, 'spent', actual)
  end
  if kind == 'budget' then ki = ki + 3 elseif kind == 'tpm' then ki = ki + 2 else ki = ki + 1 end
end
return 1

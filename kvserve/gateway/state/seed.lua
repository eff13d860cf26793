-- Give a budget the spend this Redis does not hold (rebuilt by the gateway from its spend log),
-- once: the first gateway to get here seeds it, the others change nothing. Spend settled into
-- the same period since (a request in flight across a restart) counts if it is larger.
-- KEYS: the budget hash. ARGV: period index, spent, '1' for a calendar-aligned period (a hash
-- an earlier version seeded for it counted the period from the epoch: seeded again).
local b, idx, spent = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2])
local calendar = ARGV[3] == '1'
if redis.call('HGET', b, 'seeded') == '1' and (not calendar or redis.call('HGET', b, 'calendar') == '1') then
  return 0
end
if tonumber(redis.call('HGET', b, 'period') or '-1') == idx then
  spent = math.max(spent, tonumber(redis.call('HGET', b, 'spent') or '0'))
end
redis.call('HSET', b, 'period', ARGV[1], 'spent', tostring(spent), 'seeded', '1')
if calendar then redis.call('HSET', b, 'calendar', '1') end
redis.call('PERSIST', b)  -- no TTL: see admit.lua
return 1

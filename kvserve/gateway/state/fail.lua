-- Count one failure of a deployment; with allowed_fails failures inside a minute, start its
-- cooldown (a key with a TTL that every gateway instance sees).
-- KEYS: failures zset, cooldown key. ARGV: allowed_fails, cooldown_ms, unique member.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 60000)
redis.call('PEXPIRE', KEYS[1], 60000)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then
  redis.call('DEL', KEYS[1])
  if tonumber(ARGV[2]) > 0 then redis.call('SET', KEYS[2], '1', 'PX', ARGV[2]) end
  return 1
end
return 0

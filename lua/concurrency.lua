-- concurrency: requests in flight. Allows when in-flight + 1 <= limit; a slot is held
-- until its lease is released (response ended, client gone) or expires after `lease`.
-- A check of cost 0 only observes: it is allowed, takes no slot, and reports the free ones.
--
-- KEYS:   the check's key, a sorted set: member = lease id (decimal text, never 0),
--         score = the lease's expiry (ms); TTL = the latest expiry.
-- ARGV:   the check's limit, and in the places of burst and max_delay: lease_ms, and the
--         lease id this request holds if admitted ("0": take no lease, only count).
-- Calls:  as common.lua describes; 'store' needs no state; 'refund' gives the slot back
--         (releases the check's lease); 'release' frees lease `x` (decide.lua's mode
--         "release"); 'renew' makes lease `x`, if still live, expire `y` ms from now and
--         returns 1, else 0: a released or expired lease is not brought back, its slot may
--         be another's (decide.lua's mode "renew", while the request holding it lasts).
local function concurrency(key, rule, now, op, cost, x, y)
  local allowed, remaining, retry
  local lease = x
  if op == 'renew' then
    local score = redis.call('ZSCORE', key, lease)
    if not score or score + 0 <= now then return 0 end
    local expiry = now + y
    if expiry > score + 0 then
      redis.call('ZADD', key, string.format('%d', expiry), lease)
      -- The key lives until its latest lease expires: this one, now, at the latest.
      if redis.call('PTTL', key) < y + 0 then
        redis.call('PEXPIRE', key, string.format('%d', y))
      end
    end
    return 1
  end
  if op ~= 'release' then lease = rule[5] end
  if op == 'release' or op == 'refund' then
    redis.call('ZREM', key, lease)
    if redis.call('ZCARD', key) == 0 then redis.call('DEL', key) end
    return
  end
  local stamp = string.format('%d', now)
  if op ~= 'store' then
    local limit = rule[2]
    local held = redis.call('ZCOUNT', key, '(' .. stamp, '+inf')
    if cost == 0 then
      allowed = true
    else
      allowed = held < limit
      if allowed then held = held + 1 end
    end
    remaining = limit - held
    if remaining < 0 then remaining = 0 end
    -- Slots free whenever a response ends; a second is the honest hint.
    retry = 1000
    if allowed then retry = 0 end
    if op ~= 'decide' or not allowed then
      return allowed, remaining, 0, retry
    end
  end
  -- Take the slot: drop expired leases, add this one, live until the latest expires.
  redis.call('ZREMRANGEBYSCORE', key, '-inf', stamp)
  if lease ~= '0' then
    redis.call('ZADD', key, string.format('%d', now + rule[4]), lease)
  end
  local latest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if latest[2] and latest[2] + 0 > now then
    redis.call('PEXPIRE', key, string.format('%d', latest[2] - now))
  else
    redis.call('DEL', key)
  end
  return allowed, remaining, 0, retry
end

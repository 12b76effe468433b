-- concurrency: requests in flight. Allows when in-flight + 1 <= limit; a slot is held
-- until its lease is released (response ended, client gone) or expires after `lease`.
--
-- KEYS:   the check's key, a sorted set: member = lease id (decimal text, never 0),
--         score = the lease's expiry (ms).
-- ARGV:   the check's rule (decide.lua parses it into `r`): limit, lease_ms, and the
--         lease id this request holds if admitted ("0": only look).
-- Returns concurrency.decide(key, r, now) -> verdict, state   (reads only)
--         concurrency.store(key, r, now, state)  takes the slot; TTL = latest expiry
--         concurrency.refund(key, r, now, at)    gives the slot back
--         concurrency.release(key, lease)        frees lease `lease` (decide.lua mode
--                                                "release")
local concurrency = {}

function concurrency.decide(key, r, now)
  local held = redis.call('ZCOUNT', key, '(' .. int(now), '+inf')
  local allowed = held + 1 <= r.limit
  if allowed then held = held + 1 end
  -- Slots free whenever a response ends; a second is the honest hint.
  return verdict(allowed, math.max(r.limit - held, 0), 0, allowed and 0 or 1000, 0), nil
end

function concurrency.store(key, r, now, _)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now))
  if r.lease ~= '0' then
    redis.call('ZADD', key, int(now + r.lease_ms), r.lease)
  end
  local latest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if latest[2] and tonumber(latest[2]) > now then
    redis.call('PEXPIRE', key, int(tonumber(latest[2]) - now))
  else
    redis.call('DEL', key)
  end
end

function concurrency.release(key, lease)
  redis.call('ZREM', key, lease)
  if redis.call('ZCARD', key) == 0 then redis.call('DEL', key) end
end

function concurrency.refund(key, r, _, _)
  concurrency.release(key, r.lease)
end

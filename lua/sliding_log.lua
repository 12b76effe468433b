-- sliding_log: every admitted request's (time, cost); allows when the units in
-- (now − period, now] plus cost fit in limit. Exact; memory O(limit).
--
-- KEYS:   the check's key, a sorted set: score = admission time (ms), member
--         "<time>:<units>" (requests admitted in the same millisecond share one member);
--         and, derived from it with the same {hash} tag, "<key>:total", a string holding
--         the units of every member still in the set. Members that have left the window
--         stay until the next charge removes them (a decision only reads).
-- ARGV:   the check's rule (decide.lua parses it into `r`): limit, period, cost.
-- Returns sliding_log.decide(key, r, now) -> verdict, state   (reads only)
--         sliding_log.store(key, r, now, state)  charges; both keys get TTL = newest + period
--         sliding_log.refund(key, r, now, at)    takes back r.cost units admitted at `at`
local sliding_log = {}

local function units_of(member)
  return tonumber(string.match(member, ':(%d+)$'))
end

local function total_key(key)
  return key .. ':total'
end

-- Units in the set, counted in `<key>:total`.
local function log_total(key)
  return tonumber(redis.call('GET', total_key(key)) or '0')
end

-- Units of the members that have left the window (time <= now − period).
local function expired_units(key, r, now)
  local units = 0
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', key, '-inf', int(now - r.period))) do
    units = units + units_of(member)
  end
  return units
end

-- Writes the total and gives both keys the TTL the newest entry needs (or deletes both).
local function log_save(key, r, now, total)
  local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  local ttl = 0
  if newest[2] then ttl = tonumber(newest[2]) + r.period - now end
  if total <= 0 or ttl <= 0 then
    redis.call('DEL', key, total_key(key))
    return
  end
  redis.call('SET', total_key(key), int(total), 'PX', int(ttl))
  redis.call('PEXPIRE', key, int(ttl))
end

function sliding_log.decide(key, r, now)
  local p, limit, cost = r.period, r.limit, r.cost
  local total = log_total(key) - expired_units(key, r, now)
  local allowed = total + cost <= limit
  local retry = 0
  if not allowed then
    if cost > limit then
      retry = p
    else
      -- The oldest units must age out until `cost` fits. Every member holds at least
      -- one unit, so no more than `must_free` members are needed.
      local must_free = total + cost - limit
      local at = now
      local oldest = redis.call('ZRANGEBYSCORE', key, '(' .. int(now - p), '+inf',
        'WITHSCORES', 'LIMIT', 0, int(must_free))
      for i = 1, #oldest, 2 do
        local units = units_of(oldest[i])
        at = tonumber(oldest[i + 1]) + p
        if units >= must_free then break end
        must_free = must_free - units
      end
      retry = at - now
    end
  end
  local newest = nil
  if allowed and cost > 0 then
    total = total + cost
    newest = now
  else
    local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    if last[2] and tonumber(last[2]) + p > now then newest = tonumber(last[2]) end
  end
  local reset = 0
  if newest then reset = newest + p - now end
  return verdict(allowed, math.max(limit - total, 0), reset, retry, 0), nil
end

function sliding_log.store(key, r, now, _)
  if r.cost <= 0 then return end
  local total = log_total(key) - expired_units(key, r, now) + r.cost
  redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now - r.period))
  local units = r.cost
  local same = redis.call('ZRANGEBYSCORE', key, int(now), int(now))
  if same[1] then
    units = units + units_of(same[1])
    redis.call('ZREM', key, same[1])
  end
  redis.call('ZADD', key, int(now), int(now) .. ':' .. int(units))
  log_save(key, r, now, total)
end

function sliding_log.refund(key, r, now, at)
  local same = redis.call('ZRANGEBYSCORE', key, int(at), int(at))
  -- Gone already: a later charge removed it from the set and from the total.
  if not same[1] then return end
  local units = units_of(same[1]) - r.cost
  redis.call('ZREM', key, same[1])
  if units > 0 then
    redis.call('ZADD', key, int(at), int(at) .. ':' .. int(units))
  end
  log_save(key, r, now, log_total(key) - r.cost)
end

-- sliding_log: every admitted request's (time, cost); allows when the units in
-- (now − period, now] plus cost fit in limit. Exact; memory O(limit).
--
-- KEYS:   the check's key, a sorted set: score = admission time (ms), member
--         "<time>:<units>" (requests admitted in the same millisecond share one member);
--         and, derived from it with the same {hash} tag, "<key>:total", a string holding
--         the units of every member still in the set. Members that have left the window
--         stay until the next charge removes them (a decision only reads). Both keys get
--         TTL = newest + period.
-- ARGV:   the check's limit, period.
-- Calls:  as common.lua describes; 'store' needs no state (it reads the set again);
--         'refund' takes back cost units admitted at the given time.
local function sliding_log(key, rule, now, op, cost, charged_at)
  local allowed, remaining, reset, retry
  local p = rule[3]
  local total_key = key .. ':total'
  local total
  if op == 'refund' then
    local stamp = string.format('%d', charged_at)
    local same = redis.call('ZRANGEBYSCORE', key, stamp, stamp)
    -- Gone already: a later charge removed it from the set and from the total.
    if not same[1] then return end
    local units = string.match(same[1], ':(%d+)$') - cost
    redis.call('ZREM', key, same[1])
    if units > 0 then
      redis.call('ZADD', key, stamp, stamp .. ':' .. string.format('%d', units))
    end
    total = (redis.call('GET', total_key) or 0) - cost
  else
    -- The units in the window: the total less the members that have left it.
    local gone_before = string.format('%d', now - p)
    total = (redis.call('GET', total_key) or 0) + 0
    local gone = redis.call('ZRANGEBYSCORE', key, '-inf', gone_before)
    for i = 1, #gone do
      total = total - string.match(gone[i], ':(%d+)$')
    end
    if op ~= 'store' then
      local limit = rule[2]
      allowed = op == 'charge' or cost == 0 or cost <= limit - total
      retry = 0
      if not allowed then
        if cost > limit then
          retry = p
        else
          -- The oldest units must age out until `cost` fits. Every member holds at
          -- least one unit, so no more than `must_free` members are needed.
          local must_free = total + cost - limit
          local fits = now
          local oldest = redis.call('ZRANGEBYSCORE', key, '(' .. gone_before, '+inf',
            'WITHSCORES', 'LIMIT', '0', string.format('%d', must_free))
          for i = 1, #oldest, 2 do
            local units = string.match(oldest[i], ':(%d+)$') + 0
            fits = oldest[i + 1] + p
            if units >= must_free then break end
            must_free = must_free - units
          end
          retry = fits - now
        end
      end
      -- reset: until the newest entry (this one, if it is charged) leaves the window.
      local held, latest = total, nil
      if allowed and cost > 0 then
        held, latest = total + cost, now
      else
        local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
        if last[2] and last[2] + p > now then latest = last[2] + 0 end
      end
      remaining = limit - held
      if remaining < 0 then remaining = 0 end
      reset = 0
      if latest then reset = latest + p - now end
      if op == 'peek' or not allowed then
        return allowed, remaining, reset, retry
      end
    end
    -- Charge: drop the members that left, add `cost` units at `now`; the log's units
    -- saturate at 2^53 (only a charge past the limit gets there).
    local units, room = cost, 9007199254740992 - total
    if room < 0 then room = 0 end
    if units > room then units = room end
    total = total + units
    redis.call('ZREMRANGEBYSCORE', key, '-inf', gone_before)
    if units > 0 then
      local stamp = string.format('%d', now)
      local same = redis.call('ZRANGEBYSCORE', key, stamp, stamp)
      if same[1] then
        units = units + string.match(same[1], ':(%d+)$')
        redis.call('ZREM', key, same[1])
      end
      redis.call('ZADD', key, stamp, stamp .. ':' .. string.format('%d', units))
    end
  end
  -- Both keys live until the newest member leaves the window (or go now).
  local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  local ttl = 0
  if newest[2] then ttl = newest[2] + p - now end
  if total <= 0 or ttl <= 0 then
    redis.call('DEL', key, total_key)
  else
    ttl = string.format('%d', ttl)
    redis.call('SET', total_key, string.format('%d', total), 'PX', ttl)
    redis.call('PEXPIRE', key, ttl)
  end
  return allowed, remaining, reset, retry
end

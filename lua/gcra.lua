-- gcra: the generic cell rate algorithm, one stored value, the theoretical arrival time
-- (tat). With T = period/limit: allows when max(tat, now) + cost·T − now <= burst·T.
-- Same contract as token_bucket, including on_exceed = "delay" up to max_delay.
-- T is kept exact as a fraction of denominator `limit`: tat = ms + frac/limit. The lead
-- (tat − now) × limit saturates at 2^53, and so does a reply's delay.
--
-- The same function is leaky_bucket (leaky_bucket.lua): for a check whose algorithm is
-- "leaky_bucket" it shapes instead, allowing while the queue's wait fits in burst·T.
--
-- KEYS:   the check's key, a string "<tat ms>:<frac>" (0 <= frac < limit), TTL = until
--         tat (rounded up).
-- ARGV:   the check's limit, period, burst, max_delay ("": reject).
-- Calls:  as common.lua describes; the state for 'store' is the new tat (ms, frac);
--         'refund' moves tat back by cost·T.
local function gcra(key, at, now, op, cost, ms, frac)
  local argv = ARGV
  local allowed, remaining, reset, delay
  if op ~= 'store' then
    local limit, p = argv[at + 2] + 0, argv[at + 3] + 0
    -- read(key) of common.lua, inlined (a Lua call costs Redis about as much as the rest)
    local text, tat, tat_frac = state[key]
    if text == nil then
      text = redis.call('GET', key)
      state[key] = text
    else
      tat = n1[key]
      if tat ~= nil then
        text, tat_frac = nil, n2[key]
      elseif text == 0 then
        text = nil
      end
    end
    if text then
      local colon = string.find(text, ':', 1, true)
      tat, tat_frac = string.sub(text, 1, colon - 1) + 0, string.sub(text, colon + 1) + 0
    end
    if op == 'refund' then
      if not tat then return end
      local back = cost * p
      local back_frac = back % limit
      ms = tat - (back - back_frac) / limit
      frac = tat_frac - back_frac
      if frac < 0 then ms, frac = ms - 1, frac + limit end
    else
      local shaping = argv[at + 1] == 'leaky_bucket'
      local tolerance = argv[at + 4] * p
      -- ahead = (tat − now) × limit, or 0 when tat is in the past.
      local ahead = 0
      if tat then
        ahead = tat - now
        if ahead < 0 then
          ahead = 0
        else
          ahead = ahead * limit + tat_frac
          if ahead > 9007199254740992 then ahead = 9007199254740992 end
        end
      end
      local new_ahead = ahead + cost * p
      -- delay: allowed, the wait before it may pass; denied, how long until it would
      -- conform (ms, rounded up; a leaky_bucket's wait is rounded down, see below).
      if cost == 0 then
        -- Observes: neither queued nor booked ahead.
        allowed, delay = true, 0
      elseif shaping then
        -- Allowed: leave in the millisecond the slot falls in (rounded down), so a
        -- fast queue is not held a whole extra millisecond per request.
        allowed = ahead <= tolerance
        if allowed then
          delay = (ahead - ahead % limit) / limit
        else
          delay = ahead - tolerance
          delay = (delay + (-delay) % limit) / limit
        end
      else
        delay = 0
        if new_ahead > tolerance then
          delay = new_ahead - tolerance
          delay = (delay + (-delay) % limit) / limit
        end
        local max_delay = argv[at + 5]
        if max_delay == '' then
          allowed = delay == 0
        else
          allowed = delay <= max_delay + 0
        end
      end
      -- A charge books ahead whatever the wait: the debt of a response that cost more.
      if op == 'charge' then allowed = true end
      if new_ahead > 9007199254740992 then new_ahead = 9007199254740992 end
      if delay > 9007199254740992 then delay = 9007199254740992 end
      local after = ahead
      if allowed then after = new_ahead end
      if shaping then
        -- Requests that could still join the queue now.
        remaining = 0
        if after <= tolerance then
          remaining = tolerance - after
          remaining = (remaining - remaining % p) / p + 1
        end
      else
        remaining = tolerance - after
        if remaining < 0 then remaining = 0 end
        remaining = (remaining - remaining % p) / p
      end
      reset = (after + (-after) % limit) / limit
      frac = new_ahead % limit
      ms = now + (new_ahead - frac) / limit
      if op == 'peek' or not allowed then
        return allowed, remaining, reset, delay, ms, frac
      end
    end
  end
  local ttl = ms - now
  if frac > 0 then ttl = ttl + 1 end
  -- write(key, ttl, ms, frac), inlined
  if ttl > 0 then
    state[key], n1[key], n2[key] = ttl, ms, frac
  else
    state[key], n1[key] = 0, nil
  end
  return allowed, remaining, reset, delay
end

-- gcra: the generic cell rate algorithm. With T = period/limit: allows when
-- max(tat, now) + cost·T − now <= burst·T. Same contract as token_bucket, including
-- on_exceed = "delay" up to max_delay, and the same stored state: the units in use ×
-- period at `last`, draining `limit` a millisecond, so tat = last + used·period/limit and
-- the lead (tat − now) × limit is the units in use × period now. Units, not a time, so an
-- override or reload that changes limit, burst or period keeps the units used (a new
-- period rescales them, a part of a unit rounded up). The lead saturates at 2^53, and so
-- does a reply's delay.
--
-- The same function is leaky_bucket (leaky_bucket.lua): for a check whose algorithm is
-- "leaky_bucket" it shapes instead, allowing while the queue's wait fits in burst·T.
--
-- KEYS:   the check's key, a string "<used × period>:<last ms>:<period>", TTL = until
--         tat (rounded up).
-- ARGV:   the check's limit, period, burst, max_delay ("": reject).
-- Calls:  as common.lua describes; the state for 'store' is the new (used × period,
--         last); 'refund' moves tat back by cost·T.
local function gcra(key, rule, now, op, cost, ahead, last)
  local allowed, remaining, reset, delay
  local limit, p = rule[2], rule[3]
  if op ~= 'store' then
    -- read(key) of common.lua, inlined (a Lua call costs Redis about as much as the rest)
    local text, scaled, period = state[key]
    if text == nil then
      text = redis.call('GET', key)
      state[key] = text
    end
    if text then scaled, last, period = unpack_state('<ddd', text) end
    if scaled and period ~= p then
      -- A new period: the same units, a part of one rounded up.
      scaled = (scaled + (-scaled) % period) / period * p
      if scaled > 9007199254740992 then scaled = 9007199254740992 end
    end
    if op == 'refund' then
      if not scaled then return end
      ahead = scaled - cost * p
      if ahead < 0 then ahead = 0 end
    else
      local shaping = rule[1] == 'leaky_bucket'
      local tolerance = rule[4] * p
      -- ahead = (tat − now) × limit: drained since `last`, or 0 when tat is in the past;
      -- a clock that went back drains nothing.
      ahead = 0
      if not scaled then
        last = now
      elseif now > last then
        ahead = scaled - (now - last) * limit
        if ahead < 0 then ahead = 0 end
        last = now
      else
        ahead = scaled
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
        local max_delay = rule[5]
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
      if allowed then ahead = new_ahead end
      if shaping then
        -- Requests that could still join the queue now.
        remaining = 0
        if ahead <= tolerance then
          remaining = tolerance - ahead
          remaining = (remaining - remaining % p) / p + 1
        end
      else
        remaining = tolerance - ahead
        if remaining < 0 then remaining = 0 end
        remaining = (remaining - remaining % p) / p
      end
      reset = (ahead + (-ahead) % limit) / limit
      if op == 'peek' or not allowed then
        return allowed, remaining, reset, delay, ahead, last
      end
    end
  end
  -- Until tat, rounded up.
  local ttl = last + (ahead + (-ahead) % limit) / limit - now
  -- write(key, ttl, ahead, last, p), inlined
  if ttl > 0 then
    state[key], ttls[key] = pack('<ddd', ahead, last, p), ttl
  else
    state[key], ttls[key] = false, 0
  end
  return allowed, remaining, reset, delay
end

-- token_bucket: capacity `burst`, refilled continuously at limit/period, starts full;
-- allows when tokens >= cost. The key holds the units in use (capacity − tokens), scaled by
-- `period` so the refill (elapsed × limit) stays an integer, and the period they were
-- scaled by: an override or reload that changes limit, burst or period keeps the units
-- used (a new period rescales them, a part of a unit rounded up). With on_exceed = "delay"
-- a request may book tokens ahead (more units in use than the capacity) when the wait for
-- them is at most max_delay. The units in use saturate at 2^53 (× period), and so does a
-- reply's delay.
--
-- KEYS:   the check's key, a string "<used × period>:<last refill ms>:<period>", TTL =
--         until the bucket is full again.
-- ARGV:   the check's limit, period, burst, max_delay ("": reject).
-- Calls:  as common.lua describes; the state for 'store' is (used × period, last);
--         'refund' puts cost tokens back.
local function token_bucket(key, rule, now, op, cost, scaled, last)
  local allowed, remaining, reset, delay
  local limit, p = rule[2], rule[3]
  local capacity = rule[4] * p
  if op ~= 'store' then
    -- read(key) of common.lua, inlined (a Lua call costs Redis about as much as the rest)
    local text, period
    text, scaled, last = state[key]
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
      scaled = scaled - cost * p
      if scaled < 0 then scaled = 0 end
    else
      if not scaled then scaled, last = 0, now end
      -- Refill; a clock that went back refills nothing.
      if now > last then
        scaled = scaled - (now - last) * limit
        if scaled < 0 then scaled = 0 end
        last = now
      end
      -- The tokens left (negative when booked ahead): exact, both below 2^53.
      local tokens = capacity - scaled
      local need = cost * p
      -- Booked ahead (tokens < 0) even cost 0 looks short; it never waits.
      local short = 0
      if cost > 0 and need > tokens then short = need - tokens end
      -- delay: allowed, the wait for booked tokens; denied, the wait until they refill.
      delay = (short + (-short) % limit) / limit
      local max_delay = rule[5]
      if max_delay == '' then
        allowed = short == 0
      else
        allowed = delay <= max_delay + 0
      end
      -- A charge books ahead whatever the wait: the debt of a response that cost more.
      if op == 'charge' then allowed = true end
      if allowed then
        tokens = tokens - need
        if tokens < capacity - 9007199254740992 then tokens = capacity - 9007199254740992 end
        scaled = capacity - tokens
      end
      if delay > 9007199254740992 then delay = 9007199254740992 end
      remaining = 0
      if tokens > 0 then remaining = (tokens - tokens % p) / p end
      reset = (scaled + (-scaled) % limit) / limit
      if op == 'peek' or not allowed then
        return allowed, remaining, reset, delay, scaled, last
      end
    end
  end
  -- Full again at last + ceil(used / limit).
  local ttl = last + (scaled + (-scaled) % limit) / limit - now
  -- write(key, ttl, scaled, last, p), inlined
  if ttl > 0 then
    state[key], ttls[key] = pack('<ddd', scaled, last, p), ttl
  else
    state[key], ttls[key] = false, 0
  end
  return allowed, remaining, reset, delay
end

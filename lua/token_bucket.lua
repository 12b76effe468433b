-- token_bucket: capacity `burst`, refilled continuously at limit/period, starts full;
-- allows when tokens >= cost. Tokens are stored multiplied by `period` so the refill
-- (elapsed × limit) stays an integer. With on_exceed = "delay" a request may book tokens
-- ahead (the count goes negative) when the wait for them is at most max_delay. The deficit
-- (capacity − tokens × period) saturates at 2^53, and so does a reply's delay.
--
-- KEYS:   the check's key, a string "<tokens × period>:<last refill ms>", TTL = until the
--         bucket is full again.
-- ARGV:   the check's limit, period, burst, max_delay ("": reject).
-- Calls:  as common.lua describes; the state for 'store' is (tokens × period, last);
--         'refund' puts cost tokens back.
local function token_bucket(key, at, now, op, cost, scaled, last)
  local argv = ARGV
  local allowed, remaining, reset, delay
  local limit, p = argv[at + 2] + 0, argv[at + 3] + 0
  local capacity = argv[at + 4] * p
  if op ~= 'store' then
    -- read(key) of common.lua, inlined (a Lua call costs Redis about as much as the rest)
    local text
    text, scaled, last = state[key]
    if text == nil then
      text = redis.call('GET', key)
      state[key] = text
    else
      scaled = n1[key]
      if scaled ~= nil then
        text, last = nil, n2[key]
      elseif text == 0 then
        text = nil
      end
    end
    if text then
      local colon = string.find(text, ':', 1, true)
      scaled, last = string.sub(text, 1, colon - 1) + 0, string.sub(text, colon + 1) + 0
    end
    if op == 'refund' then
      if not scaled then return end
      scaled = scaled + cost * p
      if scaled > capacity then scaled = capacity end
    else
      if not scaled then scaled, last = capacity, now end
      -- Refill; a clock that went back refills nothing.
      if now > last then
        scaled = scaled + (now - last) * limit
        last = now
      end
      if scaled > capacity then scaled = capacity end
      local need = cost * p
      -- Booked ahead (scaled < 0) even cost 0 looks short; it never waits.
      local short = 0
      if cost > 0 and need > scaled then short = need - scaled end
      -- delay: allowed, the wait for booked tokens; denied, the wait until they refill.
      delay = (short + (-short) % limit) / limit
      local max_delay = argv[at + 5]
      if max_delay == '' then
        allowed = short == 0
      else
        allowed = delay <= max_delay + 0
      end
      -- A charge books ahead whatever the wait: the debt of a response that cost more.
      if op == 'charge' then allowed = true end
      if allowed then
        scaled = scaled - need
        if scaled < capacity - 9007199254740992 then scaled = capacity - 9007199254740992 end
      end
      if delay > 9007199254740992 then delay = 9007199254740992 end
      remaining = 0
      if scaled > 0 then remaining = (scaled - scaled % p) / p end
      reset = capacity - scaled
      reset = (reset + (-reset) % limit) / limit
      if op == 'peek' or not allowed then
        return allowed, remaining, reset, delay, scaled, last
      end
    end
  end
  -- Full again at last + ceil((capacity − tokens) / limit).
  local ttl = capacity - scaled
  if ttl < 0 then ttl = 0 end
  ttl = last + (ttl + (-ttl) % limit) / limit - now
  -- write(key, ttl, scaled, last), inlined
  if ttl > 0 then
    state[key], n1[key], n2[key] = ttl, scaled, last
  else
    state[key], n1[key] = 0, nil
  end
  return allowed, remaining, reset, delay
end

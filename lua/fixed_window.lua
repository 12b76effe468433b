-- fixed_window: one counter per window; windows are aligned to multiples of `period`
-- since the Unix epoch. Allows when count + cost <= limit.
--
-- KEYS:   the check's key, a string "<window start ms>:<count>", TTL = the window's end.
-- ARGV:   the check's limit, period. A calendar period (DESIGN section 20) comes as the
--         window the proxy computed: minus its length in the place of the period, its
--         start in that of burst and the proxy's time in that of max_delay; the check is
--         then decided at that time (the window's), whatever `now` says.
-- Calls:  as common.lua describes; the state for 'store' is (start, count); 'refund'
--         takes back cost from the count of the window of the charge, if still current.
-- Every write sets the TTL again, even inside the window the key holds: keeping it (SET ...
-- KEEPTTL, a third cheaper) would keep the end of a window of another period when a reload
-- or a live override lengthens it, and the key would expire early and count again from 0.
local function fixed_window(key, rule, now, op, cost, x, y)
  local start, count = x, y
  local allowed, remaining, reset, delay, first
  local p = rule[3]
  if p < 0 then
    p, first, now = -p, rule[4], rule[5] + 0
  end
  if op ~= 'store' then
    -- read(key) of common.lua, inlined (a Lua call costs Redis about as much as the rest)
    local text, stored, stored_count = state[key]
    if text == nil then
      text = redis.call('GET', key)
      state[key] = text
    end
    if text then stored, stored_count = unpack_state('<dd', text) end
    if op == 'refund' then
      start = first or x - x % p
      if stored ~= start then return end
      count = stored_count - cost
      if count < 0 then count = 0 end
    else
      local limit = rule[2]
      start, count = first or now - now % p, 0
      -- The stored window began inside this one: this window, or (after a longer period
      -- came in) a part of it, whose units it keeps.
      if stored and stored >= start and stored < start + p then count = stored_count end
      reset = start + p - now
      allowed = op == 'charge' or cost == 0 or cost <= limit - count
      -- delay: denied, the wait until the next window.
      if allowed then
        count, delay = count + cost, 0
        if count > 9007199254740992 then count = 9007199254740992 end
      else
        delay = reset
      end
      remaining = limit - count
      if remaining < 0 then remaining = 0 end
      if count == 0 then reset = 0 end
      if op == 'peek' or not allowed then
        return allowed, remaining, reset, delay, start, count
      end
    end
  end
  local ttl = start + p - now
  -- write(key, ttl, start, count), inlined
  if ttl == true or ttl > 0 then
    state[key], ttls[key] = pack('<dd', start, count), ttl
  else
    state[key], ttls[key] = false, 0
  end
  return allowed, remaining, reset, delay
end

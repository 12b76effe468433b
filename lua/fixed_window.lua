-- fixed_window: one counter per window; windows are aligned to multiples of `period`
-- since the Unix epoch. Allows when count + cost <= limit.
--
-- KEYS:   the check's key, the window's start (ms), its count and its period (ms) packed
--         as doubles (common.lua), TTL = the window's end.
-- ARGV:   the check's limit, period. A calendar period (DESIGN section 20) comes as the
--         window the proxy computed: minus its length in the place of the period, its
--         start in that of burst and the proxy's time in that of max_delay; the check is
--         then decided at that time (the window's), whatever `now` says.
-- Calls:  as common.lua describes; the state for 'store' is (start, count); 'refund'
--         takes back cost from the count of the window of the charge, if still current.
-- A write inside the window the key holds in Redis, of the same period, keeps its TTL (SET
-- ... KEEPTTL, with no TTL to format: about 40% cheaper than PSETEX), which ends with that
-- window. Any other write sets it again: a key of another period (a reload or a live
-- override lengthened it) would otherwise expire at its old end and count again from 0.
local function fixed_window(key, rule, now, op, cost, x, y)
  local start, count = x, y
  local allowed, remaining, reset, delay, first, held
  local p = rule[3]
  if p < 0 then
    p, first, now = -p, rule[4], rule[5] + 0
  end
  if op ~= 'store' then
    -- read(key) of common.lua, inlined (a Lua call costs Redis about as much as the rest)
    local text, stored, stored_count, stored_p = state[key]
    if text == nil then
      text = redis.call('GET', key)
      state[key] = text
    end
    if text then stored, stored_count, stored_p = unpack_state('<ddd', text) end
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
    -- The key holds this very window (its start, its period), in Redis unless this call
    -- wrote it (below).
    held = stored == start and stored_p == p
  end
  local ttl = start + p - now
  -- write(key, ttl, text) of common.lua, inlined; `true`: SET ... KEEPTTL (flush), unless
  -- this call already set the key to a new window, which Redis does not hold yet.
  if ttl > 0 then
    local written = ttls[key]
    if held and (written == nil or written == true) then ttl = true end
    state[key], ttls[key] = pack('<ddd', start, count, p), ttl
  else
    state[key], ttls[key] = false, 0
  end
  return allowed, remaining, reset, delay
end

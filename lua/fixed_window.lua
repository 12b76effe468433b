-- fixed_window: one counter per window; windows are aligned to multiples of `period`
-- since the Unix epoch. Allows when count + cost <= limit.
--
-- KEYS:   the check's key, a string "<window start ms>:<count>", TTL = the window's end.
-- ARGV:   the check's limit, period. A calendar period (DESIGN section 20) comes as the
--         window the proxy computed: minus its length in the place of the period, its
--         start in that of burst and the proxy's time in that of max_delay; the check is
--         then decided at that time (the window's), whatever `now` says.
-- Calls:  as common.lua describes; the state for 'store' is (start, count, keep); 'refund'
--         takes back cost from the count of the window of the charge, if still current.
-- A write to the window the key already holds in Redis keeps its TTL (SET ... KEEPTTL):
-- the window's end has not moved, and a SET without PX costs Redis a third less. (Only a
-- period changed by a reload moves it: a key that holds a window of the old period, whose
-- start the new period shares, keeps the old window's end, and a longer period's count
-- starts again from 0 there, once.)
local function fixed_window(key, at, now, op, cost, x, y, z)
  local start, count, keep = x, y, z
  local argv = ARGV
  local allowed, remaining, reset, delay, first
  local p = argv[at + 3] + 0
  if p < 0 then
    p, first, now = -p, argv[at + 4] + 0, argv[at + 5] + 0
  end
  if op ~= 'store' then
    -- held: true when Redis holds the window `stored` (the text came from it, or this
    -- call's write of it keeps its TTL).
    -- read(key) of common.lua, inlined (a Lua call costs Redis about as much as the rest)
    local text, stored, stored_count, held = state[key]
    if text == nil then
      text = redis.call('GET', key)
      state[key] = text
    else
      stored = n1[key]
      if stored ~= nil then
        text, stored_count, held = nil, n2[key], text
      elseif text == 0 then
        text = nil
      end
    end
    if text then
      local colon = string.find(text, ':', 1, true)
      stored, stored_count = string.sub(text, 1, colon - 1) + 0, string.sub(text, colon + 1) + 0
      held = true
    end
    if op == 'refund' then
      start = first or x - x % p
      if stored ~= start then return end
      keep = held == true
      count = stored_count - cost
      if count < 0 then count = 0 end
    else
      local limit = argv[at + 2] + 0
      start, count = first or now - now % p, 0
      if stored == start then count, keep = stored_count, held == true end
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
        return allowed, remaining, reset, delay, start, count, keep
      end
    end
  end
  local ttl = start + p - now
  if keep and ttl > 0 then ttl = true end
  -- write(key, ttl, start, count), inlined
  if ttl == true or ttl > 0 then
    state[key], n1[key], n2[key] = ttl, start, count
  else
    state[key], n1[key] = 0, nil
  end
  return allowed, remaining, reset, delay
end

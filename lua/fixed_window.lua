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
local function fixed_window(key, at, now, op, cost, x, y)
  local start, count = x, y
  local argv = ARGV
  local allowed, remaining, reset, delay, first
  local p = argv[at + 3] + 0
  if p < 0 then
    p, first, now = -p, argv[at + 4] + 0, argv[at + 5] + 0
  end
  if op ~= 'store' then
    local text, stored, stored_count = read(key)
    if text then
      local colon = string.find(text, ':', 1, true)
      stored, stored_count = string.sub(text, 1, colon - 1) + 0, string.sub(text, colon + 1) + 0
    end
    if op == 'refund' then
      start = first or x - x % p
      if stored ~= start then return end
      count = stored_count - cost
      if count < 0 then count = 0 end
    else
      local limit = argv[at + 2] + 0
      start, count = first or now - now % p, 0
      if stored == start then count = stored_count end
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
  write(key, ttl, '%d:%d', start, count)
  return allowed, remaining, reset, delay
end

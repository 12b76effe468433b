-- sliding_window: the previous and current window's counts, the previous one weighted by
-- the part of it still inside the sliding period. Allows when
-- prev × (period − elapsed) / period + curr + cost <= limit (compared multiplied by period).
--
-- KEYS:   the check's key, the current window's start (ms), prev, curr and the period
--         (ms) packed as doubles (common.lua), TTL = start + 2 periods (1 when curr = 0).
--         A write inside the window the key holds in Redis, of the same period, with a
--         count in it before and after, keeps the TTL (SET ... KEEPTTL), which is that one.
-- ARGV:   the check's limit, period.
-- Calls:  as common.lua describes; the state for 'store' is (start, prev, curr); 'refund'
--         takes back cost from the window of the charge, current or previous.
local function sliding_window(key, rule, now, op, cost, x, y, z)
  local start, prev, curr = x, y, z
  local allowed, remaining, reset, retry, held
  local p = rule[3]
  if op ~= 'store' then
    -- read(key) of common.lua, inlined (a Lua call costs Redis about as much as the rest)
    local text, stored, stored_p
    text, stored, prev, curr = state[key]
    if text == nil then
      text = redis.call('GET', key)
      state[key] = text
    end
    if text then stored, prev, curr, stored_p = unpack_state('<dddd', text) end
    -- The key holds this window (below), of this period, with a count: its TTL is
    -- start + 2 periods, in Redis unless this call wrote it.
    held = stored_p == p and curr and curr > 0
    if op == 'refund' then
      if not stored then return end
      start = x - x % p
      if stored == start then
        curr = curr - cost
        if curr < 0 then curr = 0 end
      elseif stored == start + p then
        -- A later request opened the next window: the charge now sits in `prev`.
        prev = prev - cost
        if prev < 0 then prev = 0 end
      else
        return
      end
      start = stored
    else
      local limit = rule[2]
      start = now - now % p
      held = held and stored == start
      if stored ~= start then
        if stored and stored + p == start then
          prev, curr = curr, 0
        elseif stored and stored > start - p and stored < start + p then
          -- A window of another period (a new one came in) began inside this window or
          -- the one before: all its units count in that one.
          local units = prev + curr
          if units > 9007199254740992 then units = 9007199254740992 end
          if stored > start then
            prev, curr = 0, units
          else
            prev, curr = units, 0
          end
        else
          prev, curr = 0, 0
        end
      end
      local elapsed = now - start
      local weighted_prev = prev * (p - elapsed)
      allowed = op == 'charge' or cost == 0 or
        (cost <= limit - curr and weighted_prev + (curr + cost) * p <= limit * p)
      retry = 0
      if not allowed then
        -- The wait until the request would fit, if nothing else arrives: later in this
        -- window, as the previous window's weight fades ...
        local room = (limit - curr - cost) * p
        local wait
        if room >= 0 and prev > 0 then
          -- (prev × (period − elapsed) − room + prev − 1) / prev, truncated toward zero
          local a = prev * (p - elapsed) - room + prev - 1
          if a >= 0 then
            wait = (a - a % prev) / prev
          else
            wait = -((-a - (-a) % prev) / prev)
          end
          if elapsed + wait >= p then
            wait = nil
          elseif wait < 0 then
            wait = 0
          end
        end
        -- ... or in the next window, where this window's count fades in turn.
        if wait then
          retry = wait
        else
          retry = p - elapsed + p
          room = (limit - cost) * p
          if room >= 0 then
            local offset = 0
            if curr ~= 0 then
              local a = curr * p - room + curr - 1
              if a > 0 then offset = (a - a % curr) / curr end
            end
            if offset < p then retry = p - elapsed + offset end
          end
        end
      end
      if allowed then
        curr = curr + cost
        if curr > 9007199254740992 then curr = 9007199254740992 end
      end
      remaining = limit * p - weighted_prev
      if remaining < 0 then remaining = 0 end
      remaining = (remaining - remaining % p) / p - curr
      if remaining < 0 then remaining = 0 end
      reset = 0
      if curr > 0 then
        reset = p - elapsed + p
      elseif prev > 0 then
        reset = p - elapsed
      end
      if op == 'peek' or not allowed then
        return allowed, remaining, reset, retry, start, prev, curr
      end
    end
  end
  local ttl = start + p - now
  if curr > 0 then ttl = ttl + p end
  -- write(key, ttl, text) of common.lua, inlined; `true`: SET ... KEEPTTL (fixed_window.lua)
  if ttl > 0 then
    local written = ttls[key]
    if held and curr > 0 and (written == nil or written == true) then ttl = true end
    state[key], ttls[key] = pack('<dddd', start, prev, curr, p), ttl
  else
    state[key], ttls[key] = false, 0
  end
  return allowed, remaining, reset, retry
end

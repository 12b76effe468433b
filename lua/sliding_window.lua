-- sliding_window: the previous and current window's counts, the previous one weighted by
-- the part of it still inside the sliding period. Allows when
-- prev × (period − elapsed) / period + curr + cost <= limit (compared multiplied by period).
--
-- KEYS:   the check's key, a string "<current window start ms>:<prev>:<curr>".
-- ARGV:   the check's rule (decide.lua parses it into `r`): limit, period, cost.
-- Returns sliding_window.decide(key, r, now) -> verdict, state   (reads only)
--         sliding_window.store(key, r, now, state)  charges; TTL = start + 2 periods
--                                                   (1 when curr = 0)
--         sliding_window.refund(key, r, now, at)    takes back one charge made at `at`
local sliding_window = {}

-- The wait until a denied request would fit, if nothing else arrives.
local function sliding_retry(r, elapsed, prev, curr)
  local p, limit, cost = r.period, r.limit, r.cost
  -- Later in this window, as the previous window's weight fades.
  local room = limit * p - (curr + cost) * p
  if room >= 0 and prev > 0 then
    local wait = tdiv(prev * (p - elapsed) - room + prev - 1, prev)
    if elapsed + wait < p then return math.max(wait, 0) end
  end
  -- In the next window, where this window's count fades in turn.
  local to_next = p - elapsed
  room = (limit - cost) * p
  if room < 0 then return to_next + p end
  local offset = 0
  if curr ~= 0 then
    offset = math.max(tdiv(curr * p - room + curr - 1, curr), 0)
  end
  if offset < p then return to_next + offset end
  return to_next + p
end

function sliding_window.decide(key, r, now)
  local p, limit, cost = r.period, r.limit, r.cost
  local start = now - imod(now, p)
  local prev, curr = 0, 0
  local state = load_fields(key)
  if state and state[1] == start then
    prev, curr = state[2], state[3]
  elseif state and state[1] + p == start then
    prev, curr = state[3], 0
  end
  local elapsed = now - start
  local weighted_prev = prev * (p - elapsed)
  local allowed = weighted_prev + (curr + cost) * p <= limit * p
  local curr_after = curr
  if allowed then curr_after = curr + cost end
  local room = idiv(math.max(limit * p - weighted_prev, 0), p)
  local to_window_end = start + p - now
  local reset = 0
  if curr_after > 0 then
    reset = to_window_end + p
  elseif prev > 0 then
    reset = to_window_end
  end
  local retry = 0
  if not allowed then retry = sliding_retry(r, elapsed, prev, curr) end
  local v = verdict(allowed, math.max(room - curr_after, 0), reset, retry, 0)
  return v, {start, prev, curr_after}
end

local function sliding_ttl(r, now, state)
  local span = r.period
  if state[3] > 0 then span = 2 * r.period end
  return state[1] + span - now
end

function sliding_window.store(key, r, now, state)
  save_fields(key, state, sliding_ttl(r, now, state))
end

function sliding_window.refund(key, r, now, at)
  local start = at - imod(at, r.period)
  local state = load_fields(key)
  if not state then return end
  if state[1] == start then
    state[3] = math.max(state[3] - r.cost, 0)
  elseif state[1] == start + r.period then
    -- A later request opened the next window: the charge now sits in `prev`.
    state[2] = math.max(state[2] - r.cost, 0)
  else
    return
  end
  save_fields(key, state, sliding_ttl(r, now, state))
end

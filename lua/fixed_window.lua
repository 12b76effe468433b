-- fixed_window: one counter per window; windows are aligned to multiples of `period`
-- since the Unix epoch. Allows when count + cost <= limit.
--
-- KEYS:   the check's key, a string "<window start ms>:<count>".
-- ARGV:   the check's rule (decide.lua parses it into `r`): limit, period, cost.
-- Returns fixed_window.decide(key, r, now) -> verdict, state   (reads only)
--         fixed_window.store(key, r, now, state)  charges: writes state, TTL = window end
--         fixed_window.refund(key, r, now, at)    takes back one charge of r.cost made at `at`
local fixed_window = {}

function fixed_window.decide(key, r, now)
  local start = now - imod(now, r.period)
  local count = 0
  local state = load_fields(key)
  if state and state[1] == start then count = state[2] end
  local reset = start + r.period - now
  local allowed = count + r.cost <= r.limit
  local after = count
  if allowed then after = count + r.cost end
  local v = verdict(allowed, math.max(r.limit - after, 0),
    after > 0 and reset or 0, allowed and 0 or reset, 0)
  return v, {start, after}
end

function fixed_window.store(key, r, now, state)
  save_fields(key, state, state[1] + r.period - now)
end

function fixed_window.refund(key, r, now, at)
  local start = at - imod(at, r.period)
  local state = load_fields(key)
  if state and state[1] == start then
    state[2] = math.max(state[2] - r.cost, 0)
    save_fields(key, state, start + r.period - now)
  end
end

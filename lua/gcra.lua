-- gcra: the generic cell rate algorithm, one stored value, the theoretical arrival time
-- (tat). With T = period/limit: allows when max(tat, now) + cost·T − now <= burst·T.
-- Same contract as token_bucket, including on_exceed = "delay" up to max_delay.
-- T is kept exact as a fraction of denominator `limit`: tat = ms + frac/limit.
--
-- The shared core `tat_decide` also serves leaky_bucket (leaky_bucket.lua).
--
-- KEYS:   the check's key, a string "<tat ms>:<frac>" (0 <= frac < limit).
-- ARGV:   the check's rule (decide.lua parses it into `r`): limit, period, burst,
--         max_delay (absent: reject), cost.
-- Returns gcra.decide(key, r, now) -> verdict, state   (reads only)
--         gcra.store(key, r, now, state)  charges; TTL = until tat (rounded up)
--         gcra.refund(key, r, now, at)    moves tat back by cost·T
local gcra = {}

-- shaping = false: gcra; true: leaky_bucket (allowed while the queue's wait fits in
-- burst·T, and the request waits its turn).
local function tat_decide(key, r, now, shaping)
  local limit, p = r.limit, r.period
  local tolerance = r.burst * p
  -- ahead = (tat − now) × limit, or 0 when tat is in the past.
  local base_ms, base_frac = now, 0
  local state = load_fields(key)
  if state and state[1] >= now then base_ms, base_frac = state[1], state[2] end
  local ahead = (base_ms - now) * limit + base_frac
  local new_ahead = ahead + r.cost * p
  local q, frac = idiv(new_ahead, limit)
  local allowed, wait, over
  if shaping then
    allowed = ahead <= tolerance
    wait = ceil_div(ahead, limit)
    over = ceil_div(math.max(ahead - tolerance, 0), limit)
  else
    over = ceil_div(math.max(new_ahead - tolerance, 0), limit)
    if r.max_delay then
      allowed, wait = over <= r.max_delay, over
    else
      allowed, wait = new_ahead <= tolerance, 0
    end
  end
  local after = ahead
  if allowed then after = new_ahead end
  local remaining
  if shaping then
    -- Requests that could still join the queue now.
    remaining = 0
    if after <= tolerance then remaining = idiv(tolerance - after, p) + 1 end
  else
    remaining = idiv(math.max(tolerance - after, 0), p)
  end
  local v = verdict(allowed, remaining, ceil_div(after, limit),
    allowed and 0 or over, allowed and wait or 0)
  return v, {now + q, frac}
end

local function tat_ttl(now, state)
  local ttl = state[1] - now
  if state[2] > 0 then ttl = ttl + 1 end
  return ttl
end

local function tat_store(key, now, state)
  save_fields(key, state, tat_ttl(now, state))
end

local function tat_refund(key, r, now)
  local state = load_fields(key)
  if not state then return end
  local q, frac = idiv(r.cost * r.period, r.limit)
  state[1], state[2] = state[1] - q, state[2] - frac
  if state[2] < 0 then
    state[1], state[2] = state[1] - 1, state[2] + r.limit
  end
  save_fields(key, state, tat_ttl(now, state))
end

function gcra.decide(key, r, now)
  return tat_decide(key, r, now, false)
end

function gcra.store(key, _, now, state)
  tat_store(key, now, state)
end

function gcra.refund(key, r, now, _)
  tat_refund(key, r, now)
end

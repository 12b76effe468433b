-- token_bucket: capacity `burst`, refilled continuously at limit/period, starts full;
-- allows when tokens >= cost. Tokens are stored multiplied by `period` so the refill
-- (elapsed × limit) stays an integer. With on_exceed = "delay" a request may book tokens
-- ahead (the count goes negative) when the wait for them is at most max_delay.
--
-- KEYS:   the check's key, a string "<tokens × period>:<last refill ms>".
-- ARGV:   the check's rule (decide.lua parses it into `r`): limit, period, burst,
--         max_delay (absent: reject), cost.
-- Returns token_bucket.decide(key, r, now) -> verdict, state   (reads only)
--         token_bucket.store(key, r, now, state)  charges; TTL = until the bucket is full
--         token_bucket.refund(key, r, now, at)    puts r.cost tokens back
local token_bucket = {}

local function bucket_ttl(r, now, state)
  local missing = math.max(r.burst * r.period - state[1], 0)
  return state[2] + ceil_div(missing, r.limit) - now
end

function token_bucket.decide(key, r, now)
  local p, limit = r.period, r.limit
  local capacity = r.burst * p
  local scaled, last = capacity, now
  local state = load_fields(key)
  if state then scaled, last = state[1], state[2] end
  -- A clock that went back refills nothing.
  local elapsed = math.max(now - last, 0)
  scaled = math.min(scaled + elapsed * limit, capacity)
  local need = r.cost * p
  local short = math.max(need - scaled, 0)
  local wait = ceil_div(short, limit)
  local allowed
  if r.max_delay then
    allowed = wait <= r.max_delay
  else
    allowed = short == 0
  end
  local after = scaled
  if allowed then after = scaled - need end
  local v = verdict(allowed, idiv(math.max(after, 0), p), ceil_div(capacity - after, limit),
    allowed and 0 or wait, allowed and wait or 0)
  return v, {after, math.max(now, last)}
end

function token_bucket.store(key, r, now, state)
  save_fields(key, state, bucket_ttl(r, now, state))
end

function token_bucket.refund(key, r, now, _)
  local state = load_fields(key)
  if not state then return end
  state[1] = math.min(state[1] + r.cost * r.period, r.burst * r.period)
  save_fields(key, state, bucket_ttl(r, now, state))
end

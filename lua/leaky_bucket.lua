-- leaky_bucket: a queue that drains at exactly limit/period. The stored value is the
-- next free slot (slot = ms + frac/limit, T = period/limit): a request is allowed when
-- its wait max(slot, now) − now <= burst·T, and then waits that long before it passes.
-- Shares gcra.lua's arithmetic (`tat_decide` with shaping on).
--
-- KEYS:   the check's key, a string "<slot ms>:<frac>" (0 <= frac < limit).
-- ARGV:   the check's rule (decide.lua parses it into `r`): limit, period, burst, cost.
-- Returns leaky_bucket.decide(key, r, now) -> verdict, state   (reads only)
--         leaky_bucket.store(key, r, now, state)  charges; TTL = until the slot (rounded up)
--         leaky_bucket.refund(key, r, now, at)    moves the slot back by cost·T
local leaky_bucket = {}

function leaky_bucket.decide(key, r, now)
  return tat_decide(key, r, now, true)
end

function leaky_bucket.store(key, _, now, state)
  tat_store(key, now, state)
end

function leaky_bucket.refund(key, r, now, _)
  tat_refund(key, r, now)
end

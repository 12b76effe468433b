-- prefetch.lua: the entry point that takes units of one key ahead (DESIGN section 19), and
-- gives back the units of the previous take that were not used, in one atomic call.
--
-- Assembled by src/limiter/scripts.rs like decide.lua: common.lua, one algorithm file, the
-- generated line naming it (ALGORITHM, NAME), then this file. It calls the algorithm only
-- through common.lua's calling convention (peek, decide, refund), so it knows nothing of
-- how a key's state is laid out.
--
-- KEYS:   the check's key; then, when the check bans, its ban key (`<its key>:ban`).
-- ARGV[1] "prefetch"
-- ARGV[2] now in ms, or "" to read the server's clock (TIME)
-- ARGV[3..7] the check's algorithm, limit, period_ms, burst, max_delay_ms (always "")
-- ARGV[8] want: the most units to take (at least the cost)
-- ARGV[9] cost: the units the request at hand needs
-- ARGV[10] back: units of the previous take not used, to give back (0: none)
-- ARGV[11] back_at: the time (the script's now) of that take
-- Returns {now, granted, remaining, reset_ms, delay_ms, returned}:
--   granted   the units taken now and charged: min(want, max(floor(left / 2), cost))
--             when the key has `cost` units left, else 0 (nothing charged; the caller
--             decides the request the normal way, which reads and sets bans)
--   remaining, reset_ms, delay_ms  what the algorithm answered for the take (granted > 0)
--             or for a request of `cost` (granted = 0)
--   returned  how many of the `back` units the key took back: the rest were dropped, the
--             key's state having moved past them (a new window, a full bucket)
-- A standing ban grants nothing.
local argv = ARGV
pack, unpack_state, format = struct.pack, struct.unpack, string.format
local now = argv[2]
if now == '' then
  local time = redis.call('TIME')
  local us = time[2] + 0
  now = time[1] * 1000 + (us - us % 1000) / 1000
else
  now = now + 0
end
local run = ALGORITHM
if not run then return redis.error_reply('sluice: unknown algorithm ' .. argv[3]) end
-- The check's rule as the algorithms take it (common.lua).
local rule = {argv[3], argv[4] + 0, argv[5] + 0, argv[6] + 0, argv[7]}
local key = KEYS[1]
local want, cost, back = argv[8] + 0, argv[9] + 0, argv[10] + 0

local returned = 0
if back > 0 then
  local _, before = run(key, rule, now, 'peek', 0)
  run(key, rule, now, 'refund', back, argv[11] + 0)
  local _, after = run(key, rule, now, 'peek', 0)
  returned = after - before
  if returned < 0 then returned = 0 end
  if returned > back then returned = back end
end

local banned = false
if KEYS[2] then
  local text = read(KEYS[2])
  local ban_until = text and text + 0
  banned = ban_until and ban_until > now or false
end

local granted = 0
local allowed, remaining, reset, delay
if not banned then
  local _, left = run(key, rule, now, 'peek', 0)
  if left >= cost then
    granted = (left - left % 2) / 2
    if granted > want then granted = want end
    if granted < cost then granted = cost end
    allowed, remaining, reset, delay = run(key, rule, now, 'decide', granted)
    if not allowed then
      -- The estimate of what is left rounds differently from the decision (a sliding
      -- window's weighted count): ask for the request's own units only.
      granted = cost
      allowed, remaining, reset, delay = run(key, rule, now, 'decide', granted)
      if not allowed then granted = 0 end
    end
  end
end
if granted == 0 then
  allowed, remaining, reset, delay = run(key, rule, now, 'peek', cost)
end
flush()
return {now, granted, remaining, reset, delay, returned}

-- decide.lua: the entry point. Decides every check of one request in one atomic call,
-- all or nothing, using the algorithm files concatenated ahead of it.
--
-- KEYS:   one key per check, `<key_prefix>{<hash>}:<policy>:<algorithm>`.
-- ARGV[1] mode:
--           "decide"  evaluate every check (reading only); then, when every enforce
--                     check allows, charge every check that allowed, else charge none
--           "peek"    evaluate only, charge nothing
--           "refund"  take back one charge of every check, made at time ARGV[3]
--           "release" concurrency: free lease ARGV[3 + i] under KEYS[i]
-- ARGV[2] now in ms, or "" to read the server's clock (TIME)
-- ARGV[3] refund: the `now` of the decision being refunded ("release": see above)
-- ARGV[4 + 9·(i−1) ...] check i ("decide", "peek", "refund"): algorithm, limit,
--         period_ms, burst, max_delay_ms ("" when requests over the limit are rejected),
--         lease_ms, cost, enforce ("1" or "0"), lease id ("0" when none)
-- Returns "decide"/"peek": {now, charged (1/0), then per check: allowed (1/0), remaining,
--         reset_ms, retry_after_ms, wait_ms}; "refund"/"release": {now}.
--
-- Redis >= 5 replicates a script's effects, so reading TIME before writing is allowed;
-- redis.replicate_commands() only matters on 3.2–4.x and is a no-op after that.

-- ALGORITHMS (name -> table of the algorithm files included) is generated just above
-- this file by src/limiter/scripts.rs: a script holds only the algorithms its call uses.
local FIELDS = 9

local mode = ARGV[1]
local now
if ARGV[2] == '' then
  if redis.replicate_commands then redis.replicate_commands() end
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
else
  now = tonumber(ARGV[2])
end

if mode == 'release' then
  for i, key in ipairs(KEYS) do
    concurrency.release(key, ARGV[3 + i])
  end
  return {now}
end

if #ARGV ~= 3 + FIELDS * #KEYS then
  return redis.error_reply('sluice: ' .. #KEYS .. ' keys need ' .. (3 + FIELDS * #KEYS) ..
    ' arguments, got ' .. #ARGV)
end

local rules = {}
for i = 1, #KEYS do
  local at = 3 + FIELDS * (i - 1)
  local max_delay = nil
  if ARGV[at + 5] ~= '' then max_delay = tonumber(ARGV[at + 5]) end
  local r = {
    algorithm = ARGV[at + 1],
    limit = tonumber(ARGV[at + 2]),
    period = tonumber(ARGV[at + 3]),
    burst = tonumber(ARGV[at + 4]),
    max_delay = max_delay,
    lease_ms = tonumber(ARGV[at + 6]),
    cost = tonumber(ARGV[at + 7]),
    enforce = ARGV[at + 8] == '1',
    lease = ARGV[at + 9],
  }
  if not ALGORITHMS[r.algorithm] then
    return redis.error_reply('sluice: unknown algorithm ' .. tostring(r.algorithm))
  end
  rules[i] = r
end

if mode == 'refund' then
  local charged_at = tonumber(ARGV[3])
  for i, key in ipairs(KEYS) do
    ALGORITHMS[rules[i].algorithm].refund(key, rules[i], now, charged_at)
  end
  return {now}
end

if mode ~= 'decide' and mode ~= 'peek' then
  return redis.error_reply('sluice: unknown mode ' .. tostring(mode))
end

local verdicts, states = {}, {}
local charge = mode == 'decide'
for i, key in ipairs(KEYS) do
  verdicts[i], states[i] = ALGORITHMS[rules[i].algorithm].decide(key, rules[i], now)
  if rules[i].enforce and not verdicts[i][1] then charge = false end
end

local reply = {now, charge and 1 or 0}
for i, key in ipairs(KEYS) do
  local v = verdicts[i]
  if charge and v[1] then
    ALGORITHMS[rules[i].algorithm].store(key, rules[i], now, states[i])
  end
  reply[#reply + 1] = v[1] and 1 or 0
  for j = 2, 5 do reply[#reply + 1] = v[j] end
end
return reply

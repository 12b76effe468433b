-- decide.lua: the entry point. Decides every check of one request in one atomic call,
-- all or nothing, using the algorithm files concatenated ahead of it.
--
-- KEYS:   one key per check, `<key_prefix>{<hash>}:<policy>:<algorithm>`; then, for each
--         check flagged "2" (below), in order, its ban key (`<its key>:ban`).
-- ARGV[1] mode:
--           "decide" then one character per check, "1" if it is enforced, "0" if it is a
--                     shadow, "2" if it is enforced and bans ("decide1", "decide10", ...):
--                     evaluate every check (reading only); then, when every enforced check
--                     allows, charge every check that allowed, else charge none and ban
--                     the key of every "2" check its algorithm denied
--           "peek"    evaluate only, charge nothing; "peek" then one character per check
--                     as for "decide" reads bans too (and sets none)
--           "refund"  take back one charge of every check, made at time ARGV[3]
--           "release" concurrency: free lease ARGV[2 + i] under KEYS[i]
--           "renew"   concurrency: lease ARGV[1 + 2i] under KEYS[i], if still live, now
--                     expires ARGV[2 + 2i] ms from now
-- ARGV[2] now in ms, or "" to read the server's clock (TIME)
-- then six fields per check (for "refund" after ARGV[3]): algorithm, limit, period_ms,
--         burst, max_delay_ms ("" when requests over the limit are rejected), cost;
--         concurrency puts lease_ms in the place of burst and in that of max_delay the
--         lease id the request takes if admitted ("0": none).
--         Then, for each check flagged "2", in order, its ban in ms.
-- Returns "decide"/"peek": {now, then per check: allowed (1/0, or 2: denied by a standing
--         ban), remaining, reset_ms, delay_ms (allowed: the wait before it passes; denied:
--         the retry-after)};
--         "refund"/"release": {now}; "renew": {now, then per key 1 if the lease was
--         live (and is renewed), else 0}. Whether a decide charged follows from the verdicts.
--
-- A check of cost 0 only observes: it is decided (always allowed, see the algorithm
-- files) but never charged, so never refunded either.
--
-- Bans: a "2" check whose ban key holds a time after now is denied (2, remaining 0,
-- reset_ms and delay_ms = the ban's rest) without running its algorithm. When its algorithm
-- denies it in a decide, its ban key is set to now + ban with TTL ban, and its delay_ms
-- becomes at least ban. The ban key holds its end time, not just a TTL, so the decision
-- follows the script's clock (TIME or the caller's) as state does.
--
-- Reading TIME before writing needs script effects replication, the default since Redis
-- 5 (the oldest sluice supports), so the script does not call redis.replicate_commands().
--
-- Why so few arguments: Redis builds the ARGV table on every call, and a ninth element
-- makes it grow once more; so one check takes eight.

-- Generated just above this file by src/limiter/scripts.rs, which includes only the
-- algorithms the call uses: when that is one algorithm, ALGORITHM is its function and
-- NAME its name (ALGORITHMS is nil: no table to build on every call); otherwise
-- ALGORITHMS maps each name to its function. So the function for algorithm `name` is
--   name == NAME and ALGORITHM or ALGORITHMS and ALGORITHMS[name]
local FIELDS = 6

local argv = ARGV
local mode, now = argv[1], argv[2]
if now == '' then
  local time = redis.call('TIME')
  local us = time[2] + 0
  now = time[1] * 1000 + (us - us % 1000) / 1000
else
  now = now + 0
end
local checks = #KEYS

-- One check to decide or peek (the common case): a decide charges it in the same pass,
-- when it allows.
if checks == 1 and #argv == 2 + FIELDS then
  local op
  if mode == 'decide1' or mode == 'decide0' then
    op = 'decide'
  elseif mode == 'peek' then
    op = 'peek'
  end
  if op then
    local name, cost = argv[3], argv[8]
    local run = name == NAME and ALGORITHM or ALGORITHMS and ALGORITHMS[name]
    if not run then return redis.error_reply('sluice: unknown algorithm ' .. name) end
    -- Most requests cost 1: spare converting it.
    if cost == '1' then
      cost = 1
    else
      cost = cost + 0
      if cost == 0 then op = 'peek' end
    end
    local allowed, remaining, reset, delay = run(KEYS[1], 2, now, op, cost)
    return {now, allowed and 1 or 0, remaining, reset, delay}
  end
end

if mode == 'release' then
  local release = NAME == 'concurrency' and ALGORITHM or ALGORITHMS.concurrency
  for i = 1, checks do
    release(KEYS[i], 0, now, 'release', 0, argv[2 + i])
  end
  return {now}
end

if mode == 'renew' then
  local renew = NAME == 'concurrency' and ALGORITHM or ALGORITHMS.concurrency
  local reply = {now}
  for i = 1, checks do
    reply[i + 1] = renew(KEYS[i], 0, now, 'renew', 0, argv[1 + 2 * i], argv[2 + 2 * i])
  end
  return reply
end

-- Checks that ban bring one key and one argument more each ("2" appears in no mode name).
local bans = 0
if string.find(mode, '2', 5, true) then
  local _, n = string.gsub(mode, '2', '')
  bans = n
  checks = checks - bans
end

-- The fields of check i follow ARGV[first + FIELDS·(i − 1)].
local first = 2
if mode == 'refund' then first = 3 end
if #argv ~= first + FIELDS * checks + bans then
  return redis.error_reply('sluice: ' .. checks .. ' checks need ' ..
    (first + FIELDS * checks + bans) .. ' arguments, got ' .. #argv)
end
local runs, costs = {}, {}
for i = 1, checks do
  local at = first + FIELDS * (i - 1)
  local name = argv[at + 1]
  runs[i] = name == NAME and ALGORITHM or ALGORITHMS and ALGORITHMS[name]
  if not runs[i] then return redis.error_reply('sluice: unknown algorithm ' .. name) end
  costs[i] = argv[at + 6] + 0
end

if mode == 'refund' then
  local charged_at = argv[3] + 0
  for i = 1, checks do
    if costs[i] > 0 then
      runs[i](KEYS[i], first + FIELDS * (i - 1), now, 'refund', costs[i], charged_at)
    end
  end
  return {now}
end

local charge = #mode == 6 + checks and string.find(mode, '^decide[012]*$') ~= nil
local peek = mode == 'peek' or (#mode == 4 + checks and string.find(mode, '^peek[012]*$') ~= nil)
if not charge and not peek then
  return redis.error_reply('sluice: unknown mode ' .. mode)
end
-- Byte 49 is "1": enforced; byte 50 is "2": enforced, and bans.
local enforced = {string.byte(mode, peek and 5 or 7, -1)}

-- Evaluate all, keeping what each would store, then charge all or none.
local reply, states, banned = {now}, {}, 0
for i = 1, checks do
  local at, r, s = first + FIELDS * (i - 1), 4 * i - 2, 3 * i - 2
  local flag, ban_until = enforced[i], nil
  if flag == 50 then
    banned = banned + 1
    ban_until = redis.call('GET', KEYS[checks + banned])
    if ban_until then
      ban_until = ban_until + 0
      if ban_until <= now then ban_until = nil end
    end
  end
  if ban_until then
    reply[r], reply[r + 1], reply[r + 2], reply[r + 3] = 2, 0, ban_until - now, ban_until - now
    charge = false
  else
    local allowed
    allowed, reply[r + 1], reply[r + 2], reply[r + 3], states[s], states[s + 1], states[s + 2] =
      runs[i](KEYS[i], at, now, 'peek', costs[i])
    reply[r] = allowed and 1 or 0
    if not allowed and (flag == 49 or flag == 50) then charge = false end
  end
end
if not charge and not peek and bans > 0 then
  -- Ban every banning key its algorithm denied now.
  local b = 0
  for i = 1, checks do
    if enforced[i] == 50 then
      b = b + 1
      local r = 4 * i - 2
      if reply[r] == 0 then
        local ban = argv[first + FIELDS * checks + b] + 0
        redis.call('SET', KEYS[checks + b], string.format('%d', now + ban),
          'PX', string.format('%d', ban))
        if reply[r + 3] < ban then reply[r + 3] = ban end
      end
    end
  end
end
if charge then
  for i = 1, checks do
    local s = 3 * i - 2
    if reply[4 * i - 2] == 1 and costs[i] > 0 then
      runs[i](KEYS[i], first + FIELDS * (i - 1), now, 'store', costs[i],
        states[s], states[s + 1], states[s + 2])
    end
  end
end
return reply

-- decide.lua: the entry point. Decides every check of one request in one atomic call,
-- all or nothing, using the algorithm files concatenated ahead of it; or, in one "batch"
-- call, the requests of several callers one after another, each all or nothing on its own.
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
--           "adjust"  settle charges once responses are known (DESIGN section 12): per
--                     check, an amount > 0 is charged now whatever the limit (the key
--                     carries the debt), an amount < 0 taken back from the charge made at
--                     the check's time (a refund, also of a charge across slots undone)
--           "release" concurrency: free lease ARGV[2 + i] under KEYS[i]
--           "renew"   concurrency: lease ARGV[1 + 2i] under KEYS[i], if still live, now
--                     expires ARGV[2 + 2i] ms from now
--           "batch"   several requests, each decided exactly as its own "decide" call
--                     would be, in order (so each sees what those before it charged).
--                     After ARGV[2], request after request: its "decide..." mode, with
--                     ARGV[2] = "each" its now, then its fields and bans as below; or
--                     "=" (then its now with "each"): the mode, fields and bans of the
--                     request before it. KEYS hold each request's keys then its ban keys,
--                     request after request
-- ARGV[2] now in ms, or "" to read the server's clock (TIME; a batch reads it once), or
--         for "batch" "each": every request brings its own now
-- then six fields per check (for "adjust" seven, see there): algorithm, limit, period_ms,
--         burst, max_delay_ms ("" when requests over the limit are rejected), cost;
--         concurrency puts lease_ms in the place of burst and in that of max_delay the
--         lease id the request takes if admitted ("0": none).
--         Then, for each check flagged "2", in order, its ban in ms.
-- Returns "decide"/"peek": {now, then per check: allowed (1/0, or 2: denied by a standing
--         ban), remaining, reset_ms, delay_ms (allowed: the wait before it passes; denied:
--         the retry-after)};
--         "batch": the same integers as one string of big-endian 64-bit integers (struct
--         ">i8" each): now (0 with "each"), then those four per check of every request,
--         request after request;
--         "adjust"/"release": {now}; "renew": {now, then per key 1 if the lease was
--         live (and is renewed), else 0}. Whether a decide charged follows from the verdicts.
--
-- A batch is one call: if it fails, it fails for every request in it. The requests decided
-- before the failure keep the charges of their sliding_log and concurrency checks, which
-- write as they go, and lose the others', which are written when the call ends (flush, see
-- common.lua).
--
-- A check of cost 0 only observes: it is decided (always allowed, see the algorithm
-- files) but never charged, so never adjusted either.
--
-- Bans: a "2" check whose ban key holds a time after now is denied (2, remaining 0,
-- reset_ms and delay_ms = the ban's rest) without running its algorithm. When its algorithm
-- denies it in a decide, its ban key is set to now + ban with TTL ban, and its reset_ms and
-- delay_ms become ban: during a ban every answer shows the ban's rest, never the window's
-- (DESIGN section 17). The ban key holds its end time, not just a TTL, so the decision
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
local each = false
if now == '' then
  local time = redis.call('TIME')
  local us = time[2] + 0
  now = time[1] * 1000 + (us - us % 1000) / 1000
elseif now == 'each' and mode == 'batch' then
  each = true
else
  now = now + 0
end
local checks = #KEYS

-- The check whose fields follow ARGV[at], asked with `op`: its algorithm's function (nil
-- for an unknown one), its cost, and the op that cost leaves (a cost of 0 only peeks).
-- Most requests cost 1: spare converting it.
local function one_check(at, op)
  local name, cost = argv[at + 1], argv[at + 6]
  local run = name == NAME and ALGORITHM or ALGORITHMS and ALGORITHMS[name]
  if cost == '1' then return run, 1, op end
  cost = cost + 0
  if cost == 0 then op = 'peek' end
  return run, cost, op
end

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
    local run, cost
    run, cost, op = one_check(2, op)
    if not run then return redis.error_reply('sluice: unknown algorithm ' .. argv[3]) end
    local allowed, remaining, reset, delay = run(KEYS[1], 2, now, op, cost)
    flush()
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

if mode == 'adjust' then
  -- Seven fields per check, after ARGV[2]: its six as above, the amount in the place of
  -- the cost, then the time its charge was made at.
  if #argv ~= 2 + 7 * checks then
    return redis.error_reply('sluice: ' .. checks .. ' adjustments need ' ..
      (2 + 7 * checks) .. ' arguments, got ' .. #argv)
  end
  local runs = {}
  for i = 1, checks do
    local name = argv[2 + 7 * (i - 1) + 1]
    runs[i] = name == NAME and ALGORITHM or ALGORITHMS and ALGORITHMS[name]
    if not runs[i] then return redis.error_reply('sluice: unknown algorithm ' .. name) end
  end
  for i = 1, checks do
    local at = 2 + 7 * (i - 1)
    local amount = argv[at + 6] + 0
    if amount > 0 then
      runs[i](KEYS[i], at, now, 'charge', amount)
    elseif amount < 0 then
      runs[i](KEYS[i], at, now, 'refund', -amount, argv[at + 7] + 0)
    end
  end
  flush()
  return {now}
end

-- decide and peek: one request, its mode ARGV[1] and its fields after ARGV[2]; or, for
-- "batch", one request after another, each as a "decide" of its own would be decided. For
-- the request at hand, ARGV[f + 1] is its first check's algorithm, KEYS[k + 1] its first
-- key and reply[r + 1] the first of its first check's integers; ARGV[at] is the last
-- argument read. The tables are reused from one request to the next: each reads only the
-- entries it wrote, except that an "=" request reads the runs and costs of the request
-- before it.
local batch = mode == 'batch'
local last, at, f, k, r = #argv, 2, 2, 0, 1
local keys = KEYS
local reply, runs, costs, states = {now}, {}, {}, {}
-- What a request's mode and fields say (below), kept for the "=" requests that follow it.
local flags, peek, decides, bans, checks, run, cost, op
if each then reply[1] = 0 end
if batch and #keys > 1 and keys[1] ~= keys[2] and #keys <= 4000 and
    NAME ~= 'sliding_log' and NAME ~= 'concurrency' then
  -- The keys of many callers (the first two differ): all in one MGET rather than one GET
  -- a key (each a command of its own in Redis), into the state the algorithms read. A key
  -- that is not a string (sliding_log, concurrency) reads as absent and is never read. A
  -- hot key's batch (the first two keys the same) reads its key once, with GET, as it
  -- goes: in MGET each repeat of a key would cost a third of a GET. (unpack() is bounded
  -- by Lua's C stack.)
  local texts = redis.call('MGET', unpack(keys))
  for i = 1, #keys do state[keys[i]] = texts[i] end
end
repeat
  -- A batch request whose mode is "=" has the mode, fields and bans of the one before it
  -- (most requests of a batch are one route's): only its keys and its now are its own.
  local same = false
  if batch then
    at = at + 1
    same = argv[at] == '='
    if not same then mode = argv[at] end
    if each then
      at = at + 1
      now = argv[at] + 0
    end
    if not same then f = at end
  end
  if batch and (mode == 'decide1' or mode == 'decide0') then
    -- One check that bans nobody (most requests): decided and charged in one pass, as a
    -- call of its own is above. Its limit, period and burst (concurrency: lease_ms) become
    -- numbers once, in ARGV, for it and the "=" requests after it: the algorithm's `+ 0`
    -- then parses no text.
    if not same then
      argv[f + 2], argv[f + 3], argv[f + 4] = argv[f + 2] + 0, argv[f + 3] + 0, argv[f + 4] + 0
      run, cost, op = one_check(f, 'decide')
      if not run then return redis.error_reply('sluice: unknown algorithm ' .. argv[f + 1]) end
      at = at + FIELDS
    end
    -- This request, then the "=" requests right after it (the same check on their own
    -- keys and, with "each", at their own now), in a loop of their own: every VM
    -- instruction a request saves shows in Redis's CPU.
    repeat
      k = k + 1
      local allowed, remaining, reset, delay = run(keys[k], f, now, op, cost)
      -- In order, so that the reply grows as an array.
      reply[r + 1] = allowed and 1 or 0
      reply[r + 2] = remaining
      reply[r + 3] = reset
      reply[r + 4] = delay
      r = r + 4
      if at >= last or argv[at + 1] ~= '=' then break end
      at = at + 1
      if each then
        at = at + 1
        now = argv[at] + 0
      end
    until false
  else
    if not same then
      -- The mode's flags start at byte `flags`: "1" (byte 49) enforced; "2" (byte 50)
      -- enforced, and bans; "0" a shadow.
      flags, peek = 7, false
      decides = string.find(mode, '^decide[012]*$') ~= nil
      if not decides then
        flags = 5
        peek = not batch and string.find(mode, '^peek[012]*$') ~= nil
        if not peek then return redis.error_reply('sluice: unknown mode ' .. mode) end
      end
      -- Checks that ban bring one key and one argument more each ("2" appears in no mode
      -- name).
      bans = 0
      if string.find(mode, '2', flags, true) then
        local _, n = string.gsub(mode, '2', '')
        bans = n
      end
      checks = #mode - flags + 1
      if not batch then
        -- A bare "peek": every key is a check's.
        if mode == 'peek' then checks = checks + #KEYS end
        if #KEYS ~= checks + bans or last ~= at + FIELDS * checks + bans then
          return redis.error_reply('sluice: ' .. checks .. ' checks need ' ..
            (at + FIELDS * checks + bans) .. ' arguments, got ' .. last)
        end
      end
      for i = 1, checks do
        local name = argv[f + FIELDS * (i - 1) + 1]
        runs[i] = name == NAME and ALGORITHM or ALGORITHMS and ALGORITHMS[name]
        if not runs[i] then return redis.error_reply('sluice: unknown algorithm ' .. name) end
        costs[i] = argv[f + FIELDS * (i - 1) + 6] + 0
      end
    end
    local charge = decides

    -- Evaluate all, keeping what each would store, then charge all or none.
    local banned = 0
    for i = 1, checks do
      local q, s = r + 4 * i - 3, 3 * i - 2
      local flag, ban_until = string.byte(mode, flags + i - 1), nil
      if flag == 50 then
        banned = banned + 1
        local text, written = read(KEYS[k + checks + banned])
        ban_until = text and text + 0 or written
        if ban_until and ban_until <= now then ban_until = nil end
      end
      if ban_until then
        reply[q], reply[q + 1], reply[q + 2], reply[q + 3] = 2, 0, ban_until - now, ban_until - now
        charge = false
      else
        local allowed
        allowed, reply[q + 1], reply[q + 2], reply[q + 3], states[s], states[s + 1], states[s + 2] =
          runs[i](KEYS[k + i], f + FIELDS * (i - 1), now, 'peek', costs[i])
        reply[q] = allowed and 1 or 0
        if not allowed and (flag == 49 or flag == 50) then charge = false end
      end
    end
    if not charge and not peek and bans > 0 then
      -- Ban every banning key its algorithm denied now.
      local b = 0
      for i = 1, checks do
        if string.byte(mode, flags + i - 1) == 50 then
          b = b + 1
          local q = r + 4 * i - 3
          if reply[q] == 0 then
            local ban = argv[f + FIELDS * checks + b] + 0
            write(KEYS[k + checks + b], ban, now + ban)
            reply[q + 2], reply[q + 3] = ban, ban
          end
        end
      end
    end
    if charge then
      for i = 1, checks do
        local s = 3 * i - 2
        if reply[r + 4 * i - 3] == 1 and costs[i] > 0 then
          runs[i](KEYS[k + i], f + FIELDS * (i - 1), now, 'store', costs[i],
            states[s], states[s + 1], states[s + 2])
        end
      end
    end
    if not same then at = at + FIELDS * checks + bans end
    k, r = k + checks + bans, r + 4 * checks
  end
until not batch or at >= last
if at ~= last or k ~= #KEYS then
  return redis.error_reply('sluice: a batch of ' .. #KEYS .. ' keys and ' .. last ..
    ' arguments does not add up')
end
flush()
if batch then
  -- One string rather than an array of hundreds of integers, each of which the caller's
  -- client would parse on its own. unpack() puts its values on Lua's C stack, which holds
  -- at most 8000: longer replies are packed in pieces (a single piece is returned as it
  -- is, since a concat would copy it once more).
  local n, piece = #reply, 4000
  local function pack(i)
    local j = math.min(i + piece - 1, n)
    return struct.pack('>' .. string.rep('i8', j - i + 1), unpack(reply, i, j))
  end
  if n <= piece then return pack(1) end
  local parts = {}
  for i = 1, n, piece do parts[#parts + 1] = pack(i) end
  return table.concat(parts)
end
return reply

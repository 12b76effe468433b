-- decide.lua: the entry point, decide(keys, argv): KEYS and ARGV of one FCALL of the
-- library, or of one EVALSHA of the script (common.lua). Decides every check of one
-- request in one atomic call, all or nothing, using the algorithm files concatenated ahead
-- of it; or, in one "batch" call, the requests of several callers one after another, each
-- all or nothing on its own.
--
-- KEYS:   one key per check, `<key_prefix>{<hash>}:<policy>:<algorithm>[.v3]`; then, for
--         each check flagged "2" (below), in order, its ban key (`<its key>:ban`).
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
--                     ARGV[2] = "each" its now, then its fields and bans as below; after
--                     a request, "=" and a count N: the N requests that follow have its
--                     mode, fields and bans (with "each", their N nows come next). KEYS
--                     hold each request's keys then its ban keys, request after request
-- ARGV[2] now in ms, or "" to read the server's clock (TIME; a batch reads it once), or
--         for "batch" "each": every request brings its own now
-- then two fields per check (for "adjust" three: its rule, the amount, the time of the
--         charge): its rule, "<algorithm> <limit> <period_ms> <burst> <max_delay_ms>"
--         (max_delay_ms empty when requests over the limit are rejected; concurrency puts
--         lease_ms in the place of burst and in that of max_delay the lease id the request
--         takes if admitted, "0": none), and its cost. One argument for the rule, not
--         five: Redis makes a Lua string of every argument and the library parses a
--         rule's text once (rule_of). Then, for each check flagged "2", in order, its ban
--         in ms.
-- Returns "decide"/"peek" and "batch": one string of big-endian 64-bit integers (struct
--         ">i8" each), not an array of them (each element of which Redis would make a
--         reply of and the client parse): now (0 with "each"), then per check allowed (1/0,
--         or 2: denied by a standing ban), remaining, reset_ms, delay_ms (allowed: the wait
--         before it passes; denied: the retry-after), request after request;
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
-- 5 (the oldest sluice supports) and the only mode of functions, so decide does not call
-- redis.replicate_commands().

-- Generated just above this file by src/limiter/scripts.rs: ALGORITHM and NAME when the
-- script holds one algorithm (ALGORITHMS is nil: no table to build on every EVALSHA),
-- otherwise ALGORITHMS maps each name to its function (the library holds them all). So
-- the function for algorithm `name` is
--   name == NAME and ALGORITHM or ALGORITHMS and ALGORITHMS[name]
local FIELDS = 2

-- Rules by their text. In the library (FCALL) this table outlives the call: a rule's text
-- is split and its numbers parsed once, then found with one table look-up, the string
-- being interned as Redis hands it over. A calendar window or a concurrency lease id
-- makes a text of its own per request: the table is dropped when it holds RULES_MAX.
local rules, rule_count, RULES_MAX = {}, 0, 1000

-- The check's rule `text` ("<algorithm> <limit> <period_ms> <burst> <max_delay_ms>", the
-- last possibly empty) as the algorithms take it: {algorithm, limit, period, burst (all
-- three numbers), max_delay (text)}; nil when malformed.
local function rule_of(text)
  local rule = rules[text]
  if rule then return rule end
  local find, sub = string.find, string.sub
  local a = find(text, ' ', 1, true)
  local b = a and find(text, ' ', a + 1, true)
  local c = b and find(text, ' ', b + 1, true)
  local d = c and find(text, ' ', c + 1, true)
  if not d then return nil end
  rule = {sub(text, 1, a - 1), sub(text, a + 1, b - 1) + 0, sub(text, b + 1, c - 1) + 0,
    sub(text, c + 1, d - 1) + 0, sub(text, d + 1)}
  if rule_count >= RULES_MAX then rules, rule_count = {}, 0 end
  rules[text], rule_count = rule, rule_count + 1
  return rule
end

-- The check whose rule is `text` and cost `cost` (text), asked with `op`: its rule, its
-- algorithm's function (nil for an unknown one), its cost as a number, and the op that
-- cost leaves (a cost of 0 only peeks). Most requests cost 1: spare converting it.
local function check_of(text, cost, op)
  local rule = rule_of(text)
  if not rule then return nil end
  local name = rule[1]
  local run = name == NAME and ALGORITHM or ALGORITHMS and ALGORITHMS[name]
  if cost == '1' then return rule, run, 1, op end
  cost = cost + 0
  if cost == 0 then op = 'peek' end
  return rule, run, cost, op
end

local function unknown(text)
  return redis.error_reply('sluice: unknown algorithm or malformed rule "' .. text .. '"')
end

-- Integers as one string of big-endian 64-bit integers (struct ">i8" each), rather than an
-- array of them, each of which Redis and the caller's client would handle on its own.
-- unpack() puts its values on Lua's C stack, which holds at most 8000: longer replies are
-- packed in pieces (a single piece is returned as it is, since a concat would copy it).
local function pack_piece(reply, i, j)
  return struct.pack('>' .. string.rep('i8', j - i + 1), unpack(reply, i, j))
end
local function packed(reply)
  local n, piece = #reply, 4000
  if n <= piece then return pack_piece(reply, 1, n) end
  local parts = {}
  for i = 1, n, piece do
    parts[#parts + 1] = pack_piece(reply, i, math.min(i + piece - 1, n))
  end
  return table.concat(parts)
end

-- The modes other than decide, peek and batch.
local function other(mode, keys, argv, now, checks)
  if mode == 'release' then
    local release = NAME == 'concurrency' and ALGORITHM or ALGORITHMS.concurrency
    for i = 1, checks do
      release(keys[i], nil, now, 'release', 0, argv[2 + i])
    end
    return {now}
  end
  if mode == 'renew' then
    local renew = NAME == 'concurrency' and ALGORITHM or ALGORITHMS.concurrency
    local reply = {now}
    for i = 1, checks do
      reply[i + 1] = renew(keys[i], nil, now, 'renew', 0, argv[1 + 2 * i], argv[2 + 2 * i])
    end
    return reply
  end
  -- adjust: three fields per check, after ARGV[2]: its rule, the amount, then the time
  -- its charge was made at.
  if #argv ~= 2 + 3 * checks then
    return redis.error_reply('sluice: ' .. checks .. ' adjustments need ' ..
      (2 + 3 * checks) .. ' arguments, got ' .. #argv)
  end
  local runs, rules_of = {}, {}
  for i = 1, checks do
    local text = argv[3 * i]
    local rule = rule_of(text)
    local name = rule and rule[1]
    runs[i] = name and (name == NAME and ALGORITHM or ALGORITHMS and ALGORITHMS[name])
    if not runs[i] then return unknown(text) end
    rules_of[i] = rule
  end
  for i = 1, checks do
    local amount = argv[3 * i + 1] + 0
    if amount > 0 then
      runs[i](keys[i], rules_of[i], now, 'charge', amount)
    elseif amount < 0 then
      runs[i](keys[i], rules_of[i], now, 'refund', -amount, argv[3 * i + 2] + 0)
    end
  end
  flush()
  return {now}
end

local decide_many

-- The entry point: KEYS and ARGV of one call.
local function decide(keys, argv)
  -- Left over from a call that failed halfway (the library's tables outlive calls).
  if next(state) ~= nil then state, ttls = {}, {} end
  if not pack then pack, unpack_state, format = struct.pack, struct.unpack, string.format end
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
  local checks = #keys

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
      local rule, run, cost
      rule, run, cost, op = check_of(argv[3], argv[4], op)
      if not run then return unknown(argv[3]) end
      local key = keys[1]
      local allowed, remaining, reset, delay = run(key, rule, now, op, cost)
      -- flush() for the one key (sliding_log and concurrency write as they go).
      local ttl = ttls[key]
      if ttl then
        if ttl == true then
          redis.call('SET', key, state[key], 'KEEPTTL')
        elseif ttl > 0 then
          redis.call('PSETEX', key, format('%d', ttl), state[key])
        else
          redis.call('DEL', key)
        end
        ttls[key] = nil
      end
      if state[key] ~= nil then state[key] = nil end
      return struct.pack('>i8i8i8i8i8', now, allowed and 1 or 0, remaining, reset, delay)
    end
  end
  if mode == 'release' or mode == 'renew' or mode == 'adjust' then
    return other(mode, keys, argv, now, checks)
  end
  return decide_many(keys, argv, mode, now, each)
end

-- One request of several checks (or with bans, or a peek): every check evaluated (reading
-- only), keeping what each would store, then, for a decide, all charged or none. Its
-- checks' keys are keys[k + 1 ..], then its ban keys; their rules, functions and costs
-- in `rules_of`, `runs`, `costs`; its bans' ms at argv[b + 1 ..]; its integers go to
-- reply[r + 1 ..]. `flags` is the byte of `mode` where the checks' flags start.
local function decide_request(keys, argv, mode, now, k, r, b, flags, charge, peek, checks,
                              bans, rules_of, runs, costs, reply)
  local states = {}
  local banned = 0
  for i = 1, checks do
    local q, s = r + 4 * i - 3, 3 * i - 2
    local flag, ban_until = string.byte(mode, flags + i - 1), nil
    if flag == 50 then
      banned = banned + 1
      local text = read(keys[k + checks + banned])
      ban_until = text and text + 0
      if ban_until and ban_until <= now then ban_until = nil end
    end
    if ban_until then
      reply[q], reply[q + 1], reply[q + 2], reply[q + 3] = 2, 0, ban_until - now, ban_until - now
      charge = false
    else
      local allowed
      allowed, reply[q + 1], reply[q + 2], reply[q + 3], states[s], states[s + 1], states[s + 2] =
        runs[i](keys[k + i], rules_of[i], now, 'peek', costs[i])
      reply[q] = allowed and 1 or 0
      if not allowed and (flag == 49 or flag == 50) then charge = false end
    end
  end
  if not charge and not peek and bans > 0 then
    -- Ban every banning key its algorithm denied now.
    local n = 0
    for i = 1, checks do
      if string.byte(mode, flags + i - 1) == 50 then
        n = n + 1
        local q = r + 4 * i - 3
        if reply[q] == 0 then
          local ban = argv[b + n] + 0
          write(keys[k + checks + n], ban, format('%d', now + ban))
          reply[q + 2], reply[q + 3] = ban, ban
        end
      end
    end
  end
  if charge then
    for i = 1, checks do
      local s = 3 * i - 2
      if reply[r + 4 * i - 3] == 1 and costs[i] > 0 then
        runs[i](keys[k + i], rules_of[i], now, 'store', costs[i],
          states[s], states[s + 1], states[s + 2])
      end
    end
  end
end

-- decide and peek of several checks or with bans, and "batch": one request after another,
-- each as a "decide" of its own would be decided. For the request at hand ARGV[f + 1] is
-- its first check's rule, KEYS[k + 1] its first key and reply[r + 1] the first of its first
-- check's integers; ARGV[at] is the last argument read. A "=" run after a request repeats
-- its mode, rules, costs and bans for the next N requests (only their keys and, with
-- "each", their now are their own): they are decided in a loop of their own, every VM
-- instruction a request saves showing in Redis's CPU.
decide_many = function(keys, argv, mode, now, each)
  local batch = mode == 'batch'
  local last, at, k, r = #argv, 2, 0, 1
  local reply, runs, rules_of, costs = {now}, {}, {}, {}
  if each then reply[1] = 0 end
  if batch and #keys > 1 and keys[1] ~= keys[2] and #keys <= 4000 then
    -- The keys of many callers (the first two differ): all in one MGET rather than one
    -- GET a key (each a command of its own in Redis), into the state the algorithms read,
    -- unless the first check's algorithm keeps no string (sliding_log, concurrency). A key
    -- that is not a string reads as absent and is never read. A hot key's batch (the
    -- first two keys the same) reads its key once, with GET, as it goes: in MGET each
    -- repeat of a key would cost a third of a GET. (unpack() is bounded by Lua's C stack.)
    local first = argv[each and 5 or 4] or ''
    local space = string.find(first, ' ', 1, true)
    local name = space and string.sub(first, 1, space - 1)
    if name ~= 'sliding_log' and name ~= 'concurrency' then
      local texts = redis.call('MGET', unpack(keys))
      for i = 1, #keys do state[keys[i]] = texts[i] end
    end
  end
  repeat
    if batch then
      at = at + 1
      mode = argv[at]
      if each then
        at = at + 1
        now = argv[at] + 0
      end
    end
    local f = at
    if batch and (mode == 'decide1' or mode == 'decide0') then
      -- One check that bans nobody (most requests): decided and charged in one pass, as a
      -- call of its own is.
      local rule, run, cost, op = check_of(argv[f + 1], argv[f + 2], 'decide')
      if not run then return unknown(argv[f + 1]) end
      at = at + FIELDS
      local n = 1
      if argv[at + 1] == '=' then
        n, at = 1 + argv[at + 2], at + 2
      end
      for j = 1, n do
        if j > 1 and each then
          at = at + 1
          now = argv[at] + 0
        end
        k = k + 1
        local allowed, remaining, reset, delay = run(keys[k], rule, now, op, cost)
        -- In order, so that the reply grows as an array.
        reply[r + 1] = allowed and 1 or 0
        reply[r + 2] = remaining
        reply[r + 3] = reset
        reply[r + 4] = delay
        r = r + 4
      end
    else
      -- The mode's flags start at byte `flags`: "1" (byte 49) enforced; "2" (byte 50)
      -- enforced, and bans; "0" a shadow.
      local flags, peek = 7, false
      local decides = string.find(mode, '^decide[012]*$') ~= nil
      if not decides then
        flags = 5
        peek = not batch and string.find(mode, '^peek[012]*$') ~= nil
        if not peek then return redis.error_reply('sluice: unknown mode ' .. mode) end
      end
      -- Checks that ban bring one key and one argument more each ("2" appears in no mode
      -- name).
      local bans = 0
      if string.find(mode, '2', flags, true) then
        local _, n = string.gsub(mode, '2', '')
        bans = n
      end
      local checks = #mode - flags + 1
      if not batch then
        -- A bare "peek": every key is a check's.
        if mode == 'peek' then checks = checks + #keys end
        if #keys ~= checks + bans or last ~= at + FIELDS * checks + bans then
          return redis.error_reply('sluice: ' .. checks .. ' checks need ' ..
            (at + FIELDS * checks + bans) .. ' arguments, got ' .. last)
        end
      end
      for i = 1, checks do
        local text = argv[f + FIELDS * (i - 1) + 1]
        rules_of[i], runs[i], costs[i] = check_of(text, argv[f + FIELDS * (i - 1) + 2], 'peek')
        if not runs[i] then return unknown(text) end
      end
      at = at + FIELDS * checks + bans
      local n = 1
      if batch and argv[at + 1] == '=' then
        n, at = 1 + argv[at + 2], at + 2
      end
      for j = 1, n do
        if j > 1 and each then
          at = at + 1
          now = argv[at] + 0
        end
        decide_request(keys, argv, mode, now, k, r, f + FIELDS * checks, flags, decides, peek,
          checks, bans, rules_of, runs, costs, reply)
        k, r = k + checks + bans, r + 4 * checks
      end
    end
  until not batch or at >= last
  if at ~= last or k ~= #keys then
    return redis.error_reply('sluice: a batch of ' .. #keys .. ' keys and ' .. last ..
      ' arguments does not add up')
  end
  -- A batch's tables grew with its keys: the next call starts with new ones.
  flush(batch)
  return packed(reply)
end

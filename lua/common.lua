-- common.lua: the conventions every algorithm file follows (the first part of the script).
--
-- Not a script of its own: src/limiter/scripts.rs concatenates common.lua, the algorithm
-- files, a generated line naming them (see decide.lua) and decide.lua into one script, so
-- the `local`s of one file are visible to all that follow.
--
-- Calling convention: each algorithm file defines one function named after its algorithm,
--
--   alg(key, at, now, op, cost, x, ...)
--
--   key  the check's key
--   at   where the check's fields start in ARGV: ARGV[at + 1] .. ARGV[at + 5] are its
--        algorithm, limit, period_ms, burst and max_delay_ms ("" = reject); concurrency
--        reads lease_ms and its lease id in the places of burst and max_delay (decide.lua)
--   now  the time in ms
--   op   'peek'    decides, reading only. Returns allowed (a boolean), remaining,
--                  reset_ms and delay_ms (allowed: the wait before the request passes;
--                  denied: the retry-after), then the state a 'store' needs
--        'decide'  the same, and when it allows, charges the check at once
--        'store'   charges the check with state `x, ...` as a 'peek' returned it
--        'charge'  charges the check's cost at once whatever its limit: windows count
--                  past it, token_bucket and gcra book ahead (a debt the key's next
--                  requests wait out). Not for leaky_bucket or concurrency
--        'refund'  takes back `cost` units of a charge of the check made at time `x`
--        'release' (concurrency) frees lease `x`
--   cost the check's cost, a number. decide.lua never charges a check of cost 0 (it only
--        observes) nor refunds one.
--
-- Why one function per algorithm, and no helper functions: Redis runs the script's top
-- level on every call, so every `function` in it makes a new closure every call, and with
-- a closure per operation and per helper that cost more server CPU than a decision's
-- arithmetic. For the same reason the functions' only upvalues are the state tables at
-- the end of this file (an algorithm reads and writes them itself, as read() and write()
-- there do: a Lua call costs about as much as what those do), they build no tables, and
-- take state apart with string.find/sub, not gmatch. Every VM instruction and library
-- call shows in the server's CPU: bench/lua_cost.sh and callgrind measure it
-- (bench/results/redis-cost.md).
--
-- Numbers: every value is an integer number of ms or units, held exactly in a Lua 5.1
-- double while it stays below 2^53 (validated config keeps limit × period and burst ×
-- period below that). Costs are at most 2^53 (DESIGN section 17), and what a key holds
-- saturates there, as in src/limiter/algorithm.rs: a count of units stops at 2^53 (more
-- than any limit), a bucket's units in use × period (a tat's lead, (tat − now) ×
-- limit) too, and a reply's ms never exceed it; so no stored or replied
-- number leaves the exact range, and none overflows the integer Redis makes of it. A sum
-- of two values below 2^53 may round, but never below 2^53 when it is above, so a
-- comparison with a number below 2^53 stays right; near 2^53 a check compares
-- `cost <= limit - count` (exact) rather than a sum. The literal 9007199254740992 is 2^53
-- (a literal costs nothing; a shared local would be an upvalue, see above).
-- For a and b > 0 below 2^53, `a % b` (= a − floor(a/b)·b) is exact: a/b
-- cannot round across an integer when |a| < 2^53. So, with no function call:
--   floor(a / b) = (a - a % b) / b
--   ceil(a / b)  = (a + (-a) % b) / b            (a >= 0)
-- Text to number: `s + 0` (ARGV and replies are strings). Number to text: numbers sent to
-- Redis go through string.format('%d', n), so they are plain decimal integers: Lua's own
-- tostring/`..` print %.14g ("1.7953787950501e+12" past 14 digits), and Redis 7.2.0–7.2.4
-- turn a Lua number argument such as 100000000 into "1e+08" (redis#13113).
--
-- String state (fixed_window, sliding_window, token_bucket, gcra, leaky_bucket and ban
-- keys) goes through read(key) and write(key, ttl, a, b, c): one call (a batch decides
-- many requests, often of one key) reads a key from Redis once (a batch of many callers'
-- keys reads them all in one MGET, see decide.lua) and writes it once, its last value,
-- when the call ends (flush). A SET (or a DEL) replaces a string key whole, so the last
-- one is all a sequence of them leaves: the outcome is the one writing every time would
-- give, at one read and one SET per key and call.
--
-- Stored state keeps the text layout of earlier versions ("a:b" strings, the sorted sets),
-- so instances of both versions can share one Redis during a rolling upgrade. The one
-- exception is versioned in the key instead: token_bucket, gcra and leaky_bucket keep the
-- units in use ("used:last:period", keys ending in ".v2"), which an override's new
-- numbers do not change; older instances keep their own keys for at most a period.

-- The call's string state, by key. `state[key]` is the text Redis holds (false: absent)
-- while this call has not written the key; once it has, the key's TTL in ms or 0
-- (deleted), and
-- `n1`, `n2`, `n3` the numbers of its text, formatted only when the call ends: "n1" (a
-- ban), "n1:n2" or "n1:n2:n3". Four tables, not one a field: every new key in a table
-- costs an insert (and now and then a rehash) per key and call.
local state, n1, n2, n3 = {}, {}, {}, {}

-- The key's state: its text as Redis holds it (false: absent) while this call has not
-- written it; after that nil, then the numbers written (none: deleted) and the TTL the
-- write set (its `state`). So a batch parses and formats a key's text once, not once a
-- request.
local function read(key)
  local v = state[key]
  if v == nil then
    v = redis.call('GET', key)
    state[key] = v
    return v
  end
  local a = n1[key]
  if a ~= nil then return nil, a, n2[key], n3[key], v end
  if v == 0 then return nil end
  return v
end

-- Sets `key` to the text of a, b, c for `ttl` ms, or deletes it when ttl <= 0, when the
-- call ends. A key always has the same layout (its algorithm's).
local function write(key, ttl, a, b, c)
  if ttl > 0 then
    state[key], n1[key] = ttl, a
    -- (Setting an absent entry to nil would still insert it.)
    if b ~= nil then n2[key] = b end
    if c ~= nil then n3[key] = c end
  else
    state[key], n1[key] = 0, nil
  end
end

-- PSETEX rather than SET ... PX: one argument less to convert, the same command inside.
-- (Not SET ... KEEPTTL inside a window the key holds, a third cheaper: when a reload or a
-- live override lengthens a fixed window's period, the key would keep the old window's
-- end, expire early and count from 0 again: over the limit.)
local function flush()
  local format, pack, call = string.format, struct.pack, redis.call
  for key, v in pairs(state) do
    local a = n1[key]
    if a ~= nil then
      local b, c = n2[key], n3[key]
      local text
      -- (Only entries set are set to nil: that of an absent one would insert it.)
      if c ~= nil then
        text = pack('<ddd', a, b, c)
        n2[key], n3[key] = nil, nil
      elseif b ~= nil then
        text = pack('<dd', a, b)
        n2[key] = nil
      else
        text = format('%d', a)
      end
      n1[key] = nil
      call('PSETEX', key, format('%d', v), text)
    elseif v == 0 then
      call('DEL', key)
    end
    -- Emptied as it goes (allowed while traversing): the library's tables serve the next
    -- call.
    state[key] = nil
  end
end

-- common.lua: the conventions every algorithm file follows (the first part of the text).
--
-- Not code of its own: src/limiter/scripts.rs concatenates common.lua, the algorithm
-- files, a generated line naming them (see decide.lua) and decide.lua, which defines the
-- entry point decide(keys, argv), so the `local`s of one file are visible to all that
-- follow. That text is sent in two forms (issue #42, DESIGN section 18):
--   the function library (Redis 7+): every algorithm, `decide` registered by FUNCTION LOAD
--        and called by FCALL. Its top level runs once, at load: the algorithm functions,
--        the tables below and decide.lua's cache of parsed rules outlive every call;
--   the script (EVALSHA; Redis < 7, or a user refused functions): the algorithms a call
--        uses and `return decide(KEYS, ARGV)`, the top level run again on every call.
--
-- Calling convention: each algorithm file defines one function named after its algorithm,
--
--   alg(key, rule, now, op, cost, x, ...)
--
--   key  the check's key
--   rule the check's rule as decide.lua parsed it once: rule[1] .. rule[5] are its
--        algorithm, limit, period_ms and burst (numbers) and max_delay_ms (text, "" =
--        reject); concurrency has lease_ms and its lease id (text) in the places of burst
--        and max_delay, a calendar fixed_window its window as fixed_window.lua says
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
-- What a call costs the server: every VM instruction, table, string and library call
-- shows in Redis's CPU (bench/lua_zipf.py measures the whole process, callgrind counts
-- instructions; bench/results/redis-cost.md). So one function per algorithm and no
-- helper functions on the hot path (a Lua call costs about as much as what read() and
-- write() below do, so the algorithms inline them); no table built per decision; no
-- string parsed or formatted per decision where it can be helped: rules arrive as one
-- argument each and are parsed once per library (decide.lua), state is packed doubles
-- (below), replies are packed integers. In the script form every `function` and table of
-- the top level is made again per call: that form costs more, and exists for old servers.
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
-- (a literal costs nothing; a shared local would be an upvalue).
-- For a and b > 0 below 2^53, `a % b` (= a − floor(a/b)·b) is exact: a/b
-- cannot round across an integer when |a| < 2^53. So, with no function call:
--   floor(a / b) = (a - a % b) / b
--   ceil(a / b)  = (a + (-a) % b) / b            (a >= 0)
-- Text to number: `s + 0` (ARGV and replies are strings). Number to text: numbers sent to
-- Redis as arguments go through string.format('%d', n), so they are plain decimal
-- integers: Lua's own tostring/`..` print %.14g ("1.7953787950501e+12" past 14 digits),
-- and Redis 7.2.0–7.2.4 turn a Lua number argument such as 100000000 into "1e+08"
-- (redis#13113). Replies are struct.pack('>i8') integers (exact below 2^53), state
-- struct.pack('<d') doubles (exact for any of them).
--
-- String state (fixed_window, sliding_window, token_bucket, gcra, leaky_bucket and ban
-- keys) goes through read(key) and write(key, ttl, text): one call (a batch decides
-- many requests, often of one key) reads a key from Redis once (a batch of many callers'
-- keys reads them all in one MGET, see decide.lua) and writes it once, its last value,
-- when the call ends (flush). A SET (or a DEL) replaces a string key whole, so the last
-- one is all a sequence of them leaves: the outcome is the one writing every time would
-- give, at one read and one SET per key and call.
--
-- Stored layout (v3, issue #42, versioned in the key: `…:fixed_window.v3`,
-- `…:sliding_window.v3`, `…:token_bucket.v3`, `…:gcra.v3`, `…:leaky_bucket.v3`): the
-- numbers of each algorithm's state packed as little-endian doubles, struct.pack('<ddd'),
-- read with one struct.unpack, where the text of v2 ("a:b:c") took a string.find, a
-- string.sub and a conversion per number to read and a string.format to write.
-- fixed_window keeps (start, count, period), sliding_window (start, prev, curr, period):
-- with the period, a write inside the window its key holds knows the key's TTL is the
-- one it would set, and keeps it (SET ... KEEPTTL, no TTL formatted or set). The buckets
-- keep the units in use (used, last, period), which an override's new numbers do not
-- change. During a rolling upgrade, older instances keep their own keys (the text
-- layout), so old and new instances keep separate state for at most one period. Ban keys
-- hold their end time as decimal text; sliding_log and concurrency keep
-- their sorted sets and key names.

-- The call's string state, by key: `state[key]` is the text the key holds (false: none),
-- as Redis holds it until this call writes the key, then as it will; `ttls[key]` is set
-- once the call has written the key: its TTL in ms, 0 (deleted) or true (the key keeps
-- its TTL). Two tables, not one
-- a field: every new key in a table costs an insert (and now and then a rehash). In the
-- function library they outlive the call: flush() empties them, and a call that finds
-- them not empty (one before it failed halfway) starts new ones (decide.lua).
local state, ttls = {}, {}
-- Library functions as upvalues, no global look-up per use, set by the entry point on its
-- first call: a library's top level runs at FUNCTION LOAD, where Redis offers neither
-- `struct` nor `redis.call`.
local pack, unpack_state, format

-- The key's text (false: none), read from Redis on the call's first look.
local function read(key)
  local text = state[key]
  if text == nil then
    text = redis.call('GET', key)
    state[key] = text
  end
  return text
end

-- Sets `key` to `text` for `ttl` ms, or deletes it when ttl <= 0, when the call ends.
local function write(key, ttl, text)
  if ttl > 0 then
    state[key], ttls[key] = text, ttl
  else
    state[key], ttls[key] = false, 0
  end
end

-- PSETEX rather than SET ... PX: one argument less to convert, the same command inside.
-- A TTL of `true` keeps the key's (SET ... KEEPTTL: fixed_window, inside the window the
-- key holds). Then the tables are emptied
-- for the next call (the library's outlive it): entry by entry (allowed while traversing),
-- or with `fresh` (a batch, whose tables grew with its keys) replaced by new ones.
local function flush(fresh)
  for key, ttl in pairs(ttls) do
    if ttl == true then
      redis.call('SET', key, state[key], 'KEEPTTL')
    elseif ttl > 0 then
      redis.call('PSETEX', key, format('%d', ttl), state[key])
    else
      redis.call('DEL', key)
    end
    if not fresh then ttls[key], state[key] = nil, nil end
  end
  if fresh then
    state, ttls = {}, {}
  else
    -- Keys read and not written.
    for key in pairs(state) do state[key] = nil end
  end
end

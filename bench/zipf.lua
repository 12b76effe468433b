-- bench/zipf.lua: wrk script for bench/run.sh's rows 5z, 5k, 5j and 6z.
--
--   wrk -tT -cC -dD -s bench/zipf.lua URL -- DATAFILE SEED
--
-- DATAFILE is a Lua file written by `bench/benchlib.py authdata` that returns
-- { header = NAME, cdf = { c1, ..., cN }, values = { v1, ..., vN } }: cdf is the cumulative
-- Zipf(s = 1) probability of ranks 1..N (cN = 1.0). Each request draws u = math.random()
-- and takes the first rank whose cdf >= u (binary search, 17 steps for N = 100,000), so
-- value k is sent with probability proportional to 1/k: a few hot consumers and a long
-- tail. GET / carries `NAME: value`; the formatted request of a rank is built once per
-- wrk thread and reused. Every wrk thread seeds math.random with SEED + its index, so a
-- run's sequence of draws is the same every time.

local thread_count = 0
function setup(thread)
   thread:set("tid", thread_count)
   thread_count = thread_count + 1
end

local header, cdf, values, n
local cache = {}
local floor, random = math.floor, math.random

function init(args)
   local data = dofile(args[1])
   header, cdf, values = data.header, data.cdf, data.values
   n = #cdf
   assert(n > 0 and n == #values, "zipf.lua: bad data file " .. tostring(args[1]))
   math.randomseed((tonumber(args[2]) or 1) + 1000 * (tid or 0))
end

function request()
   local u = random()
   local lo, hi = 1, n
   while lo < hi do
      local mid = floor((lo + hi) / 2)
      if cdf[mid] < u then lo = mid + 1 else hi = mid end
   end
   local r = cache[lo]
   if not r then
      r = wrk.format(nil, nil, { [header] = values[lo] })
      cache[lo] = r
   end
   return r
end

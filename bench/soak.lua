-- bench/soak.lua: wrk script for bench/soak.sh.
--
--   wrk -tT -cC -dD -s bench/soak.lua URL -- RATE THREADS IPS KEYS
--
-- RATE > 0 paces the load at RATE requests/s in total (RATE/THREADS per wrk thread);
-- RATE = 0 sends as fast as the connections allow (peak). Pacing: every wrk thread keeps
-- a schedule of absolute send times, one every THREADS/RATE s; wrk calls delay() before
-- each request and the request waits until the next free slot (a thread that fell more
-- than 1 s behind drops the backlog instead of bursting). The rate is therefore open-loop
-- as long as the connections are not all busy, and wrk's own event loop does the waiting,
-- so pacing costs next to no CPU.
--
-- Requests (the same for peak and soak): GET / from IPS client addresses (sent as
-- X-Forwarded-For by a trusted peer, 127.0.0.1) and KEYS API keys (X-Api-Key), drawn at
-- random, except that 1 request in 50 comes from the hot address 10.255.255.1 and
-- another 1 in 50 carries the hot key "k-hot": soak.sh sets both policies' limits to half
-- of what the hot address / key then sends, so they get 429s and nobody else does. 1
-- request in 100 carries `Connection: close`, so connections also churn.

local ffi = require("ffi")
ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } soak_timespec;
int clock_gettime(int clk_id, soak_timespec *tp);
]]
local ts = ffi.new("soak_timespec")
local function now_ms()
   ffi.C.clock_gettime(1, ts) -- CLOCK_MONOTONIC
   return tonumber(ts.tv_sec) * 1000 + tonumber(ts.tv_nsec) / 1e6
end

local nthreads_started = 0
function setup(thread)
   thread:set("tid", nthreads_started)
   nthreads_started = nthreads_started + 1
end

local reqs, n, i = {}, 0, 0
local interval, next_slot = 0, 0

function init(args)
   local rate = tonumber(args[1]) or 0
   local threads = tonumber(args[2]) or 1
   local ips = tonumber(args[3]) or 1000
   local keys = tonumber(args[4]) or 500
   math.randomseed(1234 + (tid or 0))
   -- a fixed cycle of ready-made requests: no formatting per request
   n = 10000
   for j = 0, n - 1 do
      local ip, key
      if j % 50 == 0 then
         ip = "10.255.255.1"
      else
         local a = math.random(1, ips)
         ip = string.format("10.%d.%d.%d", math.floor(a / 65536) % 256, math.floor(a / 256) % 256, a % 256)
      end
      if j % 50 == 25 then
         key = "k-hot"
      else
         key = "k-" .. math.random(1, keys)
      end
      local h = { ["X-Forwarded-For"] = ip, ["X-Api-Key"] = key }
      if j % 100 == 99 then h["Connection"] = "close" end
      reqs[j] = wrk.format("GET", "/", h)
   end
   if rate > 0 then
      interval = 1000.0 * threads / rate
      next_slot = now_ms()
   else
      delay = nil -- peak: no pacing (wrk looks for delay() after init)
   end
end

function request()
   local r = reqs[i]
   i = (i + 1) % n
   return r
end

function delay()
   local t = now_ms()
   if next_slot < t - 1000 then next_slot = t end
   local d = next_slot - t
   next_slot = next_slot + interval
   if d <= 0 then return 0 end
   return math.floor(d + 0.5)
end

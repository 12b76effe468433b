-- common.lua: helpers shared by every algorithm (the first part of the assembled script).
--
-- Not a script of its own: src/limiter/scripts.rs concatenates common.lua, the algorithm
-- files and decide.lua into one script, so these `local`s are visible to all that follow.
--
-- Numbers: every value is an integer number of milliseconds or units, held exactly in a
-- Lua 5.1 double while it stays below 2^53 (validated config keeps limit × period and
-- burst × period below that). Never divide with `/` alone: `idiv` floors exactly and
-- corrects the one-off a rounded quotient could cause. Numbers written to Redis go
-- through `int`, so they are stored as plain decimal integers, never "1.7e+12".

-- A whole number as decimal text.
local function int(n)
  return string.format('%d', n)
end

-- Floor division: q, r with a = q*b + r and 0 <= r < b (b > 0).
local function idiv(a, b)
  local q = math.floor(a / b)
  local r = a - q * b
  if r < 0 then
    q, r = q - 1, r + b
  elseif r >= b then
    q, r = q + 1, r - b
  end
  return q, r
end

-- ceil(a / b) for a >= 0, b > 0.
local function ceil_div(a, b)
  local q, r = idiv(a, b)
  if r > 0 then q = q + 1 end
  return q
end

-- a / b truncated toward zero, as Rust's integer `/` does (b > 0).
local function tdiv(a, b)
  if a >= 0 then
    return (idiv(a, b))
  end
  return -(idiv(-a, b))
end

-- a mod b for a >= 0, b > 0.
local function imod(a, b)
  local _, r = idiv(a, b)
  return r
end

-- One policy's outcome: allowed, remaining, reset_ms, retry_after_ms, wait_ms.
local function verdict(allowed, remaining, reset, retry, wait)
  return {allowed, remaining, reset, retry, wait}
end

-- The integers stored in a string key as "a:b:c", or nil when the key is absent.
local function load_fields(key)
  local text = redis.call('GET', key)
  if not text then return nil end
  local fields = {}
  for part in string.gmatch(text, '[^:]+') do
    fields[#fields + 1] = tonumber(part)
  end
  return fields
end

-- Stores integers as "a:b:c" for `ttl` ms; a state that is already worthless is deleted.
local function save_fields(key, fields, ttl)
  if ttl <= 0 then
    redis.call('DEL', key)
    return
  end
  local parts = {}
  for i, n in ipairs(fields) do parts[i] = int(n) end
  redis.call('SET', key, table.concat(parts, ':'), 'PX', int(ttl))
end

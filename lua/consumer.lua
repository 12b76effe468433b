-- One change to the runtime consumers (DESIGN §11, §17), made whole. Redis runs a script
-- with no other command in between, so reading a consumer and writing it back is a
-- compare-and-set that no change from any instance can slip into: a change that read the
-- consumer before a revoke cannot write the revoked key back. Does what
-- `ConsumerChange::apply` (src/auth/consumers.rs) does in process.
--
-- KEYS[1]  the consumers' hash: field = a consumer's name, value = the consumer as JSON,
--          {"name": …, "plan": … or null, "keys": [{"id": …, "digest": …}, …]}
-- ARGV[1]  the change: "put", "delete", "add_key" or "revoke_key"
-- ARGV[2]  the consumer's name
-- ARGV[3]  put: the plan ("" for none); add_key, revoke_key: the key's id
-- ARGV[4]  add_key: the key's digest (lowercase hex SHA-256)
--
-- Returns {status, consumer}: status 1 when done (consumer: its JSON now, "" once
-- deleted); 0 when no consumer has that name (put creates it instead) and 2 when
-- revoke_key names no key of the consumer, both changing nothing. A stored value that is
-- not a readable consumer counts as none.

local hash, op, name = KEYS[1], ARGV[1], ARGV[2]

local function decode(text)
  if not text then
    return nil
  end
  local ok, c = pcall(cjson.decode, text)
  if not ok or type(c) ~= 'table' then
    return nil
  end
  if type(c.keys) ~= 'table' then
    c.keys = {}
  end
  return c
end

-- cjson writes an empty table as an object, {}: the JSON is put together here instead.
local function encode(c)
  local keys = {}
  for i, k in ipairs(c.keys) do
    keys[i] = '{"id":' .. cjson.encode(k.id) .. ',"digest":' .. cjson.encode(k.digest) .. '}'
  end
  local plan = 'null'
  if type(c.plan) == 'string' then
    plan = cjson.encode(c.plan)
  end
  return '{"name":' .. cjson.encode(name) .. ',"plan":' .. plan .. ',"keys":['
    .. table.concat(keys, ',') .. ']}'
end

if op == 'delete' then
  if redis.call('HDEL', hash, name) == 1 then
    return {1, ''}
  end
  return {0, ''}
end

local consumer = decode(redis.call('HGET', hash, name))
if op == 'put' then
  consumer = consumer or { keys = {} }
  if ARGV[3] == '' then
    consumer.plan = nil
  else
    consumer.plan = ARGV[3]
  end
elseif not consumer then
  return {0, ''}
elseif op == 'add_key' then
  table.insert(consumer.keys, { id = ARGV[3], digest = ARGV[4] })
elseif op == 'revoke_key' then
  local kept = {}
  for _, k in ipairs(consumer.keys) do
    if k.id ~= ARGV[3] then
      table.insert(kept, k)
    end
  end
  if #kept == #consumer.keys then
    return {2, ''}
  end
  consumer.keys = kept
else
  return redis.error_reply('consumer.lua: unknown change ' .. tostring(op))
end
local text = encode(consumer)
redis.call('HSET', hash, name, text)
return {1, text}

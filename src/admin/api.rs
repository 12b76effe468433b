//! The `/v1/` handlers (DESIGN §9.2): each asks the limiter; none re-implements it.

use std::time::Duration;

use http::Method;
use serde_json::{json, Value};

use super::{Answer, Call};
use crate::clock::unix_ms;
use crate::config::{exact_in_redis, parse_duration, Algorithm, Policy};
use crate::gateway::Gateway;
use crate::key;
use crate::limiter::runtime::RuntimeOverride;
use crate::limiter::NamedKey;

/// Largest limit or burst: exact in Redis's Lua numbers (2^53).
const MOST: u64 = 1 << 53;

/// The `endpoint` label of a call.
pub fn endpoint(method: &Method, segments: &[String]) -> &'static str {
    let first = segments.first().map(String::as_str);
    match (method, first) {
        (&Method::GET, Some("policies")) => "policies",
        (&Method::GET, Some("summary")) => "summary",
        (&Method::GET, Some("quota")) => "quota",
        (&Method::DELETE, Some("quota")) => "reset",
        (&Method::PUT, Some("overrides")) => "override_put",
        (&Method::DELETE, Some("overrides")) => "override_delete",
        (&Method::GET, Some("overrides")) => "overrides",
        (&Method::GET, Some("top")) => "top",
        (&Method::GET, Some("consumers")) => "consumers",
        (&Method::PUT, Some("consumers")) => "consumer_put",
        (&Method::DELETE, Some("consumers")) if segments.len() == 2 => "consumer_delete",
        (&Method::POST, Some("consumers")) => "key_create",
        (&Method::DELETE, Some("consumers")) => "key_revoke",
        _ => "other",
    }
}

pub async fn handle(gateway: &Gateway, call: &Call) -> Answer {
    let segments: Vec<&str> = call.segments.iter().map(String::as_str).collect();
    let policy = |name: &str| gateway.config.policies.iter().find(|p| p.name == name);
    match (&call.method, &segments[..]) {
        (&Method::GET, ["policies"]) => policies(gateway),
        (_, ["consumers", ..]) => super::consumers::handle(gateway, call).await,
        (_, ["quota" | "overrides" | "top", name]) => {
            let Some(policy) = policy(name) else {
                return Answer::problem(404, "Not Found", format!("no policy named {name:?}"));
            };
            match (&call.method, segments[0]) {
                (&Method::GET, "quota") => quota(gateway, policy, call).await,
                (&Method::DELETE, "quota") => reset(gateway, policy, call).await,
                (&Method::PUT, "overrides") => put_override(gateway, policy, call).await,
                (&Method::DELETE, "overrides") => delete_override(gateway, policy, call).await,
                (&Method::GET, "overrides") => list_overrides(gateway, policy),
                (&Method::GET, "top") => top(gateway, policy, call),
                _ => Answer::problem(
                    405,
                    "Method Not Allowed",
                    format!("{} is not served here", call.method),
                ),
            }
        }
        _ => Answer::problem(404, "Not Found", "no such admin API call"),
    }
}

fn numbers(policy: &Policy) -> Value {
    json!({
        "limit": policy.limit.get(),
        "period_seconds": policy.period.as_secs_f64(),
        "burst": policy.burst.get(),
    })
}

fn policies(gateway: &Gateway) -> Answer {
    let list: Vec<Value> = gateway
        .config
        .policies
        .iter()
        .map(|p| {
            let mut v = numbers(p);
            v["name"] = json!(p.name);
            v["algorithm"] = json!(p.algorithm.name());
            v["key"] = json!(p.key.iter().map(key::part_name).collect::<Vec<_>>());
            v["ban_seconds"] = json!(p.ban.as_secs_f64());
            v["overrides"] = json!(p
                .overrides
                .iter()
                .map(|o| json!({
                    "when": o.when.iter().map(|c| key::part_name(&c.part)).collect::<Vec<_>>(),
                    "limit": o.numbers.limit.get(),
                    "period_seconds": o.numbers.period.as_secs_f64(),
                    "burst": o.numbers.burst.get(),
                }))
                .collect::<Vec<_>>());
            v
        })
        .collect();
    Answer::json(200, json!(list))
}

/// The key named by the call's `key=` parameters, or the 400 saying why not.
fn named(gateway: &Gateway, policy: &Policy, call: &Call) -> Result<NamedKey, Answer> {
    gateway
        .limiter
        .named_key(policy, &call.all("key"))
        .map_err(|why| Answer::problem(400, "Bad Request", why))
}

fn unavailable(e: impl std::fmt::Display) -> Answer {
    Answer::problem(503, "Service Unavailable", format!("limiter backend: {e}"))
}

async fn quota(gateway: &Gateway, policy: &Policy, call: &Call) -> Answer {
    let key = match named(gateway, policy, call) {
        Ok(k) => k,
        Err(a) => return a,
    };
    match gateway.limiter.quota(policy, &key).await {
        Ok(q) => Answer::json(200, json!(q)),
        Err(e) => unavailable(e),
    }
}

async fn reset(gateway: &Gateway, policy: &Policy, call: &Call) -> Answer {
    let key = match named(gateway, policy, call) {
        Ok(k) => k,
        Err(a) => return a,
    };
    match gateway.limiter.reset(&key).await {
        Ok(()) => {
            log::info!(
                "admin: {} reset policy {} key {:?}",
                call.caller,
                policy.name,
                key.values
            );
            Answer::empty()
        }
        Err(e) => unavailable(e),
    }
}

/// `{"limit":…, "period":"1m", "burst":…, "ttl":"30d"}`: any of limit, period, burst.
fn parse_override(policy: &Policy, key: &NamedKey, body: &[u8]) -> Result<RuntimeOverride, String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("bad JSON: {e}"))?;
    let Some(fields) = v.as_object() else {
        return Err("expected a JSON object".into());
    };
    for name in fields.keys() {
        if !matches!(name.as_str(), "limit" | "period" | "burst" | "ttl") {
            return Err(format!(
                "unknown field {name:?} (limit, period, burst, ttl)"
            ));
        }
    }
    let count = |name: &str| -> Result<Option<u64>, String> {
        match fields.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(n) => match n.as_u64() {
                Some(n) if (1..=MOST).contains(&n) => Ok(Some(n)),
                _ => Err(format!(
                    "`{name}` must be an integer between 1 and {MOST}, found {n}"
                )),
            },
        }
    };
    let duration = |name: &str| -> Result<Option<Duration>, String> {
        match fields.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => match parse_duration(s) {
                Some(d) if d >= Duration::from_millis(1) => Ok(Some(d)),
                _ => Err(format!(
                    "`{name}`: bad duration {s:?} (e.g. \"250ms\", \"1m\", \"30d\")"
                )),
            },
            Some(other) => Err(format!("`{name}` must be a duration string, found {other}")),
        }
    };
    let (limit, burst, period, ttl) = (
        count("limit")?,
        count("burst")?,
        duration("period")?,
        duration("ttl")?,
    );
    if limit.is_none() && burst.is_none() && period.is_none() {
        return Err("an override needs at least one of `limit`, `period` and `burst`".into());
    }
    if period.is_some() && policy.algorithm == Algorithm::Concurrency {
        return Err("a concurrency policy takes no `period`".into());
    }
    let limit = limit.unwrap_or(policy.limit.get());
    // As in the config: a policy whose burst follows its limit keeps following it.
    let burst = burst.unwrap_or(if policy.burst == policy.limit {
        limit
    } else {
        policy.burst.get()
    });
    let period = period.unwrap_or(policy.period);
    // The config's own rule for its overrides (§9.1): a calendar window only counts.
    let counted = policy.calendar.is_some() && period == policy.period;
    if policy.algorithm != Algorithm::Concurrency && !counted {
        for (name, n) in [("limit", limit), ("burst", burst)] {
            if !exact_in_redis(n, period) {
                return Err(format!(
                    "`{name}` times `period` in ms must stay below 2^53 ({n} × {} ms): use a shorter period",
                    period.as_millis()
                ));
            }
        }
    }
    Ok(RuntimeOverride {
        policy: policy.name.clone(),
        key: key.values.clone(),
        limit,
        period_ms: period.as_millis() as u64,
        burst,
        // Saturating (DESIGN §21): a ttl near the largest duration is "for ever", never an
        // expiry that wrapped into the past.
        expires_at_ms: ttl.map(|t| {
            let ms = u64::try_from(t.as_millis()).unwrap_or(u64::MAX);
            unix_ms().saturating_add(ms)
        }),
    })
}

/// An override as shown: its numbers and time left.
fn shown(o: &RuntimeOverride) -> Value {
    let mut v = json!(o);
    v["period_seconds"] = json!(o.period_ms as f64 / 1000.0);
    v["ttl_seconds"] = match o.expires_at_ms {
        Some(t) => json!(t.saturating_sub(unix_ms()) as f64 / 1000.0),
        None => Value::Null,
    };
    v
}

async fn put_override(gateway: &Gateway, policy: &Policy, call: &Call) -> Answer {
    let key = match named(gateway, policy, call) {
        Ok(k) => k,
        Err(a) => return a,
    };
    let o = match parse_override(policy, &key, &call.body) {
        Ok(o) => o,
        Err(why) => return Answer::problem(400, "Bad Request", why),
    };
    match gateway.limiter.set_override(&key, o.clone()).await {
        Ok(()) => {
            log::info!(
                "admin: {} set override on policy {} key {:?}: limit {} period {}ms burst {} expires_at_ms {:?}",
                call.caller, policy.name, key.values, o.limit, o.period_ms, o.burst, o.expires_at_ms
            );
            Answer::json(200, shown(&o))
        }
        Err(e) => unavailable(e),
    }
}

async fn delete_override(gateway: &Gateway, policy: &Policy, call: &Call) -> Answer {
    let key = match named(gateway, policy, call) {
        Ok(k) => k,
        Err(a) => return a,
    };
    match gateway.limiter.delete_override(&key).await {
        Ok(_) => {
            log::info!(
                "admin: {} deleted override on policy {} key {:?}",
                call.caller,
                policy.name,
                key.values
            );
            Answer::empty()
        }
        Err(e) => unavailable(e),
    }
}

fn list_overrides(gateway: &Gateway, policy: &Policy) -> Answer {
    let list: Vec<Value> = gateway
        .limiter
        .overrides(policy)
        .iter()
        .map(shown)
        .collect();
    Answer::json(200, json!(list))
}

fn top(gateway: &Gateway, policy: &Policy, call: &Call) -> Answer {
    let n = match call.first("n").map(str::parse::<usize>) {
        None => 20,
        Some(Ok(n)) if (1..=10_000).contains(&n) => n,
        Some(_) => {
            return Answer::problem(
                400,
                "Bad Request",
                "`n` must be an integer between 1 and 10000",
            )
        }
    };
    let Some(entries) = gateway.limiter.top(policy, n) else {
        return Answer::problem(
            404,
            "Not Found",
            "the heavy-hitter sketch is off ([admin] top_keys = 0)",
        );
    };
    let list: Vec<Value> = entries
        .iter()
        .map(|e| {
            json!({
                "key": e.key,
                "requests": e.requests,
                "rejected": e.rejected,
                "allowed": e.allowed,
                "error": e.error,
            })
        })
        .collect();
    Answer::json(200, json!(list))
}

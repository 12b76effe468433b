//! The `/v1/consumers` handlers (DESIGN §11): runtime consumers and their API keys, kept by
//! the limiter (fleet-wide with Redis); the config's consumers are shown and never changed.
//! Each call is one `ConsumerChange`, made by the limiter against what is stored now
//! (DESIGN §17): two calls at once, on any instances, never undo each other.

use base64::Engine as _;
use http::Method;
use serde_json::{json, Value};

use super::{Answer, Call};
use crate::auth::consumers::{self, Changed, ConsumerChange, RuntimeConsumer, RuntimeKey};
use crate::config::ANONYMOUS;
use crate::gateway::Gateway;

pub async fn handle(gateway: &Gateway, call: &Call) -> Answer {
    let segments: Vec<&str> = call.segments.iter().map(String::as_str).collect();
    match (&call.method, &segments[1..]) {
        (&Method::GET, []) => list(gateway),
        (&Method::PUT, [name]) => put(gateway, name, call).await,
        (&Method::DELETE, [name]) => delete(gateway, name, call).await,
        (&Method::POST, [name, "keys"]) => create_key(gateway, name, call).await,
        (&Method::DELETE, [name, "keys", id]) => revoke_key(gateway, name, id, call).await,
        (_, [] | [_] | [_, "keys"] | [_, "keys", _]) => Answer::problem(
            405,
            "Method Not Allowed",
            format!("{} is not served here", call.method),
        ),
        _ => Answer::problem(404, "Not Found", "no such admin API call"),
    }
}

fn unavailable(e: impl std::fmt::Display) -> Answer {
    Answer::problem(503, "Service Unavailable", format!("limiter backend: {e}"))
}

fn from_config(name: &str) -> Answer {
    Answer::problem(
        409,
        "Conflict",
        format!("consumer {name:?} comes from the config; change it there and reload"),
    )
}

fn in_config(gateway: &Gateway, name: &str) -> bool {
    gateway.config.consumers.iter().any(|c| c.name == name)
}

fn list(gateway: &Gateway) -> Answer {
    let mut all: Vec<Value> = gateway
        .config
        .consumers
        .iter()
        .map(|c| {
            json!({
                "name": c.name,
                "plan": c.plan,
                "keys": c.keys.len(),
                "source": "config",
            })
        })
        .collect();
    for c in gateway.limiter.runtime_consumers().all() {
        if in_config(gateway, &c.name) {
            continue;
        }
        all.push(shown(&c));
    }
    Answer::json(200, json!(all))
}

fn shown(c: &RuntimeConsumer) -> Value {
    json!({
        "name": c.name,
        "plan": c.plan,
        "keys": c.keys.len(),
        "key_ids": c.keys.iter().map(|k| k.id.as_str()).collect::<Vec<_>>(),
        "source": "runtime",
    })
}

/// Why `name` cannot name a consumer, if it cannot.
fn bad_name(name: &str) -> Option<String> {
    let plain = !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
    if !plain {
        return Some("a consumer name uses letters, digits, '_', '-', '.' (at most 128)".into());
    }
    if name == ANONYMOUS {
        return Some(format!(
            "\"{ANONYMOUS}\" is the plan of requests without a consumer"
        ));
    }
    if name.parse::<std::net::IpAddr>().is_ok() {
        return Some("a consumer name must not be an IP address".into());
    }
    None
}

/// `{"plan": "gold"}` or `{"plan": null}` or `{}`.
fn parse_plan(body: &[u8]) -> Result<Option<String>, String> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("bad JSON: {e}"))?;
    let Some(fields) = v.as_object() else {
        return Err("expected a JSON object".into());
    };
    if let Some(other) = fields.keys().find(|k| *k != "plan") {
        return Err(format!("unknown field {other:?} (plan)"));
    }
    match fields.get("plan") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(p)) if !p.is_empty() && p != ANONYMOUS && p.len() <= 128 => {
            Ok(Some(p.clone()))
        }
        Some(other) => Err(format!(
            "`plan` must be a non-empty string other than \"{ANONYMOUS}\", found {other}"
        )),
    }
}

async fn put(gateway: &Gateway, name: &str, call: &Call) -> Answer {
    if let Some(why) = bad_name(name) {
        return Answer::problem(400, "Bad Request", why);
    }
    if in_config(gateway, name) {
        return from_config(name);
    }
    let plan = match parse_plan(&call.body) {
        Ok(p) => p,
        Err(why) => return Answer::problem(400, "Bad Request", why),
    };
    let change = ConsumerChange::Put {
        name: name.to_owned(),
        plan: plan.clone(),
    };
    match gateway.limiter.change_consumer(&change).await {
        Ok(Changed::Done(Some(consumer))) => {
            log::info!("admin: {} set consumer {name} (plan {plan:?})", call.caller);
            Answer::json(200, shown(&consumer))
        }
        Ok(other) => unexpected(other),
        Err(e) => unavailable(e),
    }
}

async fn delete(gateway: &Gateway, name: &str, call: &Call) -> Answer {
    if in_config(gateway, name) {
        return from_config(name);
    }
    let change = ConsumerChange::Delete {
        name: name.to_owned(),
    };
    match gateway.limiter.change_consumer(&change).await {
        Ok(Changed::Done(_)) => {
            log::info!(
                "admin: {} deleted consumer {name} and its keys",
                call.caller
            );
            Answer::empty()
        }
        Ok(_) => Answer::problem(404, "Not Found", format!("no consumer named {name:?}")),
        Err(e) => unavailable(e),
    }
}

/// A new random 256-bit key, shown once; only its digest is kept.
async fn create_key(gateway: &Gateway, name: &str, call: &Call) -> Answer {
    if in_config(gateway, name) {
        return from_config(name);
    }
    let secret: [u8; 32] = rand::random();
    let key = format!(
        "sk_{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(secret)
    );
    let id = consumers::hex(&rand::random::<[u8; 8]>());
    let change = ConsumerChange::AddKey {
        name: name.to_owned(),
        key: RuntimeKey {
            id: id.clone(),
            digest: consumers::hex(&consumers::digest(key.as_bytes())),
        },
    };
    match gateway.limiter.change_consumer(&change).await {
        Ok(Changed::Done(_)) => {
            log::info!(
                "admin: {} created key {id} for consumer {name}",
                call.caller
            );
            Answer::json(201, json!({"id": id, "key": key}))
        }
        Ok(_) => Answer::problem(
            404,
            "Not Found",
            format!("no runtime consumer named {name:?} (create it with PUT first)"),
        ),
        Err(e) => unavailable(e),
    }
}

async fn revoke_key(gateway: &Gateway, name: &str, id: &str, call: &Call) -> Answer {
    if in_config(gateway, name) {
        return from_config(name);
    }
    let change = ConsumerChange::RevokeKey {
        name: name.to_owned(),
        id: id.to_owned(),
    };
    match gateway.limiter.change_consumer(&change).await {
        Ok(Changed::Done(_)) => {
            log::info!("admin: {} revoked key {id} of consumer {name}", call.caller);
            Answer::empty()
        }
        Ok(Changed::NoKey) => Answer::problem(
            404,
            "Not Found",
            format!("consumer {name:?} has no key {id:?}"),
        ),
        Ok(_) => Answer::problem(404, "Not Found", format!("no consumer named {name:?}")),
        Err(e) => unavailable(e),
    }
}

/// A change answered otherwise than its kind can be (a put always leaves a consumer).
fn unexpected(changed: Changed) -> Answer {
    Answer::problem(
        500,
        "Internal Server Error",
        format!("the limiter backend answered {changed:?}"),
    )
}

//! What sluice writes itself: rate-limit headers, 429/503 problem bodies, `respond` routes.

use std::fmt::Write;

use crate::config::{Algorithm, HeaderStyle, Policy};
use crate::limiter::algorithm::Verdict;
use crate::limiter::{Decision, Denial, PolicyOutcome};

pub const PROBLEM: &str = "application/problem+json";

/// An `application/problem+json` body for answers sluice makes itself.
pub fn problem(status: u16, title: &str, detail: &str) -> String {
    serde_json::json!({"type": "about:blank", "title": title, "status": status, "detail": detail})
        .to_string()
}

pub fn body_too_large() -> String {
    problem(
        413,
        "Content Too Large",
        "request body larger than max_request_body",
    )
}

fn secs_up(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

/// The rate-limit response headers for the enforced policies that were decided.
pub fn rate_limit_headers(
    style: HeaderStyle,
    policies: &[Policy],
    outcomes: &[PolicyOutcome],
) -> Vec<(&'static str, String)> {
    // With the numbers each was decided with (an override's, or the policy's own).
    let shown: Vec<(&Policy, Verdict, u64, u64)> = outcomes
        .iter()
        .filter(|o| o.decision != Decision::ShadowRejected)
        .filter_map(|o| {
            let p = &policies[o.policy];
            let (limit, period_ms) = o
                .rule
                .map_or((p.limit.get(), p.period.as_millis() as u64), |r| {
                    (r.limit, r.period_ms)
                });
            Some((p, o.verdict?, limit, period_ms))
        })
        .filter(|(p, ..)| p.mode == crate::config::Mode::Enforce)
        .collect();
    if shown.is_empty() {
        return Vec::new();
    }
    match style {
        HeaderStyle::Off => Vec::new(),
        HeaderStyle::Ietf => {
            let mut policy = String::new();
            let mut state = String::new();
            for (i, (p, v, limit, period_ms)) in shown.iter().enumerate() {
                let sep = if i > 0 { ", " } else { "" };
                if p.algorithm == Algorithm::Concurrency {
                    let _ = write!(
                        policy,
                        "{sep}\"{}\";q={limit};qu=\"concurrent-requests\"",
                        p.name
                    );
                    let _ = write!(state, "{sep}\"{}\";r={};t=0", p.name, v.remaining);
                } else {
                    let w = secs_up(*period_ms);
                    let _ = write!(policy, "{sep}\"{}\";q={limit};w={w}", p.name);
                    let _ = write!(
                        state,
                        "{sep}\"{}\";r={};t={}",
                        p.name,
                        v.remaining,
                        secs_up(v.reset_ms)
                    );
                }
            }
            vec![("RateLimit-Policy", policy), ("RateLimit", state)]
        }
        HeaderStyle::Legacy => {
            // The most restrictive: lowest remaining, then longest reset.
            let Some((_, v, limit, _)) = shown.iter().min_by(|a, b| {
                a.1.remaining
                    .cmp(&b.1.remaining)
                    .then(b.1.reset_ms.cmp(&a.1.reset_ms))
            }) else {
                return Vec::new();
            };
            vec![
                ("X-RateLimit-Limit", limit.to_string()),
                ("X-RateLimit-Remaining", v.remaining.to_string()),
                ("X-RateLimit-Reset", secs_up(v.reset_ms).to_string()),
            ]
        }
    }
}

/// Status, extra headers and problem+json body for a denied request.
pub fn denial(denial: &Denial) -> (u16, Vec<(&'static str, String)>, String) {
    match denial {
        Denial::Limited { status, retry_after_ms, violated } => {
            let names: Vec<String> = violated.iter().map(|n| serde_json::Value::from(n.as_str()).to_string()).collect();
            let body = format!(
                "{{\"type\":\"https://iana.org/assignments/http-problem-types#quota-exceeded\",\"title\":\"Too Many Requests\",\"status\":{status},\"violated-policies\":[{}]}}",
                names.join(",")
            );
            (*status, vec![("Retry-After", secs_up(*retry_after_ms).max(1).to_string())], body)
        }
        Denial::BackendDown => (
            503,
            Vec::new(),
            "{\"type\":\"about:blank\",\"title\":\"Service Unavailable\",\"status\":503,\"detail\":\"rate limiter backend unavailable\"}".to_owned(),
        ),
    }
}

//! What sluice writes itself: rate-limit headers, 429/503 problem bodies, `respond` routes,
//! and the trailers-only answers gRPC clients get instead (DESIGN §8).

use std::fmt::Write;

use crate::config::{Algorithm, HeaderStyle, Policy};
use crate::limiter::algorithm::Verdict;
use crate::limiter::{Decision, Denial, PolicyOutcome};

pub const PROBLEM: &str = "application/problem+json";
pub const GRPC: &str = "application/grpc";

/// The gRPC status codes sluice answers with itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrpcStatus {
    InvalidArgument = 3,
    DeadlineExceeded = 4,
    PermissionDenied = 7,
    ResourceExhausted = 8,
    Unimplemented = 12,
    Unavailable = 14,
    Unauthenticated = 16,
}

/// Whether a request is gRPC (`content-type: application/grpc`, `application/grpc+proto`...):
/// its client reads `grpc-status`, never the HTTP status.
pub fn is_grpc(headers: &http::HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.len() >= GRPC.len() && v[..GRPC.len()].eq_ignore_ascii_case(GRPC))
}

/// The `grpc-status` and `grpc-message` of a trailers-only answer: sent in the response
/// HEADERS frame, with END_STREAM and HTTP status 200.
pub fn grpc_status(status: GrpcStatus, message: &str) -> Vec<(&'static str, String)> {
    vec![
        ("grpc-status", (status as u8).to_string()),
        ("grpc-message", grpc_percent_encode(message)),
    ]
}

/// gRPC's `grpc-message` encoding: bytes outside printable ASCII, and `%`, as %XX.
fn grpc_percent_encode(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for b in message.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// The gRPC answer for a denied request, with its extra headers (`Retry-After`).
pub fn grpc_denial(denial: &Denial) -> Vec<(&'static str, String)> {
    match denial {
        Denial::Limited {
            retry_after_ms,
            violated,
            ..
        } => {
            let names: Vec<&str> = violated.iter().map(|n| n.as_str()).collect();
            let mut headers = grpc_status(
                GrpcStatus::ResourceExhausted,
                &format!("rate limited: {}", names.join(", ")),
            );
            headers.push(("Retry-After", secs_up(*retry_after_ms).max(1).to_string()));
            headers
        }
        Denial::BackendDown => grpc_status(GrpcStatus::Unavailable, "rate limiter unavailable"),
    }
}

/// Why authentication refused a request (DESIGN §11).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthRefusal {
    /// 401: no credential on a `required` route.
    Missing,
    /// 401: a credential that is not good, and why (never the credential itself).
    Invalid(String),
    /// 503: the issuer's keys could not be had.
    Unavailable(String),
}

/// Status, headers and problem body of an authentication refusal.
pub fn auth_refusal(refusal: &AuthRefusal) -> (u16, Vec<(&'static str, String)>, String) {
    const REALM: &str = "Bearer realm=\"sluice\"";
    match refusal {
        AuthRefusal::Missing => (
            401,
            vec![("WWW-Authenticate", REALM.to_owned())],
            problem(
                401,
                "Unauthorized",
                "no credentials: send an API key or a bearer token",
            ),
        ),
        AuthRefusal::Invalid(why) => (
            401,
            vec![(
                "WWW-Authenticate",
                format!("{REALM}, error=\"invalid_token\""),
            )],
            problem(401, "Unauthorized", why),
        ),
        AuthRefusal::Unavailable(why) => {
            (503, Vec::new(), problem(503, "Service Unavailable", why))
        }
    }
}

/// The gRPC answer of an authentication refusal: UNAUTHENTICATED, or UNAVAILABLE.
pub fn grpc_auth_refusal(refusal: &AuthRefusal) -> Vec<(&'static str, String)> {
    match refusal {
        AuthRefusal::Missing => grpc_status(GrpcStatus::Unauthenticated, "no credentials"),
        AuthRefusal::Invalid(why) => grpc_status(GrpcStatus::Unauthenticated, why),
        AuthRefusal::Unavailable(why) => grpc_status(GrpcStatus::Unavailable, why),
    }
}

/// An `application/problem+json` body for answers sluice makes itself.
pub fn problem(status: u16, title: &str, detail: &str) -> String {
    serde_json::json!({"type": "about:blank", "title": title, "status": status, "detail": detail})
        .to_string()
}

/// The 403 body of a client address in `[server] deny` (DESIGN §20).
pub fn denied_client() -> String {
    problem(403, "Forbidden", "the client address is denied")
}

pub fn body_too_large() -> String {
    problem(
        413,
        "Content Too Large",
        "request body larger than max_request_body",
    )
}

/// Appends `n` in decimal, without the `fmt` machinery.
fn push_number(out: &mut String, n: u64) {
    out.push_str(itoa::Buffer::new().format(n));
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
            // Written piece by piece rather than with `write!`: this runs on every request,
            // and the formatting machinery was most of its cost (callgrind).
            let mut policy = String::with_capacity(48 * shown.len());
            let mut state = String::with_capacity(40 * shown.len());
            for (i, (p, v, limit, period_ms)) in shown.iter().enumerate() {
                if i > 0 {
                    policy.push_str(", ");
                    state.push_str(", ");
                }
                for s in [&mut policy, &mut state] {
                    s.push('"');
                    s.push_str(&p.name);
                    s.push_str("\";");
                }
                policy.push_str("q=");
                push_number(&mut policy, *limit);
                state.push_str("r=");
                push_number(&mut state, v.remaining);
                if p.algorithm == Algorithm::Concurrency {
                    policy.push_str(";qu=\"concurrent-requests\"");
                    state.push_str(";t=0");
                } else {
                    policy.push_str(";w=");
                    push_number(&mut policy, secs_up(*period_ms));
                    state.push_str(";t=");
                    push_number(&mut state, secs_up(v.reset_ms));
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

/// The `reject` body (DESIGN §20) of the policy a denial reports (the first it names, whose
/// `status` it has), with its placeholders replaced, and its content type; None: the
/// problem+json body of `denial`.
pub fn reject_body<'p>(
    policies: &'p [Policy],
    outcomes: &[PolicyOutcome],
    denial: &Denial,
) -> Option<(Vec<u8>, &'p str)> {
    let Denial::Limited {
        retry_after_ms,
        violated,
        ..
    } = denial
    else {
        return None;
    };
    let name = violated.first()?;
    let outcome = outcomes.iter().find(|o| policies[o.policy].name == *name)?;
    let policy = &policies[outcome.policy];
    let reject = policy.reject.as_ref()?;
    let limit = outcome.rule.map_or(policy.limit.get(), |r| r.limit);
    // Whole seconds, as in Retry-After.
    let retry_after = secs_up(*retry_after_ms).max(1);
    let body = reject
        .body
        .render(&policy.name, limit, &reject.period, retry_after);
    Some((body, reject.content_type.as_str()))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_is_recognised_by_content_type_prefix() {
        let mut h = http::HeaderMap::new();
        assert!(!is_grpc(&h));
        for (value, grpc) in [
            ("application/grpc", true),
            ("application/grpc+proto", true),
            ("Application/GRPC", true),
            ("application/json", false),
            ("application/grp", false),
        ] {
            h.insert(
                http::header::CONTENT_TYPE,
                value.parse().expect("header value"),
            );
            assert_eq!(is_grpc(&h), grpc, "{value}");
        }
    }

    #[test]
    fn grpc_denials_follow_the_design_table() {
        let limited = Denial::Limited {
            status: 429,
            retry_after_ms: 1500,
            violated: vec!["per_ip".into(), "per_key".into()],
        };
        assert_eq!(
            grpc_denial(&limited),
            vec![
                ("grpc-status", "8".to_owned()),
                ("grpc-message", "rate limited: per_ip, per_key".to_owned()),
                ("Retry-After", "2".to_owned()),
            ]
        );
        assert_eq!(
            grpc_denial(&Denial::BackendDown),
            vec![
                ("grpc-status", "14".to_owned()),
                ("grpc-message", "rate limiter unavailable".to_owned()),
            ]
        );
        assert_eq!(
            grpc_status(GrpcStatus::Unimplemented, "no route")[0].1,
            "12"
        );
    }

    #[test]
    fn grpc_message_is_percent_encoded() {
        assert_eq!(grpc_percent_encode("a b:c"), "a b:c");
        assert_eq!(grpc_percent_encode("100%\né"), "100%25%0A%C3%A9");
    }
}

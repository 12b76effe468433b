//! Costs cannot wrap, and a ban answers alike everywhere (DESIGN §17), through the real
//! binary on both backends: RLS `hits_addend` above 2^53 is INVALID_ARGUMENT and charges
//! nothing, and so is a request's own limit past 2^53 ms on a rate rule; exactly 2^53 is decided by the limit, also next to a count of 1 (where a double
//! would round 2^53 + 1 down to 2^53); a response cost above 2^53 (a header, a usage sum) is
//! charged as 2^53, so the next request is refused; a `max_failures` ban shows its own rest as
//! `Retry-After`, never the failures window's, on the instance that set it and on another.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
#[path = "common/rls.rs"]
mod rls;

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::http::{self, Request as HttpRequest, Scripted};
use common::jwt::key_digest;
use common::redis::RedisServer;
use common::Sluice;
use rls::{call, call_bytes, one, RlsSluice, INVALID_ARGUMENT};
use sluice::rls::proto::{encode_request, Code, Descriptor, Unit};

const TWO_53: u64 = 1 << 53;

/// Rules per year (no window turns during a test): 10 with each algorithm a rule may have
/// (`ten` counts in fixed windows, as envoyproxy/ratelimit does), and `huge`, a fixed window
/// of 2^53 (the largest limit a rule may have).
const RULES: &str = "domain: costs
descriptors:
  - key: ten
    rate_limit: {name: ten, unit: year, requests_per_unit: 10}
  - key: sw
    rate_limit: {name: sw, unit: year, requests_per_unit: 10, algorithm: sliding_window}
  - key: sl
    rate_limit: {name: sl, unit: year, requests_per_unit: 10, algorithm: sliding_log}
  - key: tb
    rate_limit: {name: tb, unit: year, requests_per_unit: 10, algorithm: token_bucket}
  - key: gc
    rate_limit: {name: gc, unit: year, requests_per_unit: 10, algorithm: gcra}
  - key: huge
    rate_limit: {name: huge, unit: year, requests_per_unit: 9007199254740992}
";

/// The rules of 10 a year, one per algorithm.
const TENS: [&str; 5] = ["ten", "sw", "sl", "tb", "gc"];

fn redis_limiter(redis: &RedisServer) -> String {
    format!(
        "backend = \"redis\"\nurl = \"{}\"\ntimeout = \"1s\"",
        redis.url()
    )
}

/// The admin API's reading of a key of an RLS rule: (limit, remaining).
fn quota(s: &RlsSluice, policy: &str, key: &str) -> (u64, u64) {
    let r = http::get(
        s.sluice.admin,
        &format!("/v1/quota/{policy}?key={key}"),
        &[("authorization", "Bearer t0ken")],
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v: serde_json::Value = serde_json::from_str(&r.body).expect("json");
    (
        v["limit"].as_u64().expect("limit"),
        v["remaining"].as_u64().expect("remaining"),
    )
}

/// The remaining of rule `rule` for key value `value`, asked without charging (hits_addend 0).
fn left(s: &RlsSluice, rule: &str, value: &str) -> u32 {
    let peek = call(s.rls, &one("costs", rule, value, Some(0))).expect("answer");
    assert_eq!(peek.overall_code, Code::Ok);
    peek.statuses[0].limit_remaining
}

fn ten_left(s: &RlsSluice, value: &str) -> u32 {
    left(s, "ten", value)
}

fn hits_above_2_53_are_invalid(limiter: &str) {
    let s = rls::start(limiter, "", RULES);
    for rule in TENS {
        let three = call(s.rls, &one("costs", rule, "k", Some(3))).expect("answer");
        assert_eq!(three.statuses[0].limit_remaining, 7, "{rule}");
        // 2^64 - 3 wraps a u64 count of 3 to 0; 2^53 + 1 is not exact in Redis's doubles.
        for hits in [u64::MAX - 2, TWO_53 + 1, u64::MAX] {
            assert_eq!(
                call(s.rls, &one("costs", rule, "k", Some(hits))),
                Err(INVALID_ARGUMENT),
                "{rule}: hits_addend {hits}"
            );
            assert_eq!(
                left(&s, rule, "k"),
                7,
                "{rule}: hits_addend {hits} changed the key"
            );
        }
        // Exactly 2^53 (and just under) is a cost like any other: refused by a limit of 10,
        // with an honest wait, charging nothing; what is left still fits.
        for hits in [TWO_53, TWO_53 - 1, 8] {
            let over = call(s.rls, &one("costs", rule, "k", Some(hits))).expect("answer");
            let st = &over.statuses[0];
            assert_eq!(
                (over.overall_code, st.code, st.limit_remaining),
                (Code::OverLimit, Code::OverLimit, 7),
                "{rule}: hits_addend {hits}"
            );
            let wait = st.duration_until_reset_ms.expect("a wait");
            assert!(wait > 0 && wait <= TWO_53, "{rule}: {wait} ms");
        }
        let seven = call(s.rls, &one("costs", rule, "k", Some(7))).expect("answer");
        assert_eq!(
            (seven.overall_code, seven.statuses[0].limit_remaining),
            (Code::Ok, 0),
            "{rule}"
        );
    }
    // None of it was a backend failure answered by `on_error` (allow).
    let errors: Vec<String> = s
        .sluice
        .metrics()
        .lines()
        .filter(|l| l.starts_with("sluice_backend_errors_total{") && !l.ends_with(" 0"))
        .map(str::to_owned)
        .collect();
    assert!(errors.is_empty(), "{errors:?}");
    // One bad descriptor makes the whole request invalid: the good one is not charged.
    let mut two = one("costs", "ten", "other", Some(1));
    two.descriptors.push(Descriptor {
        entries: vec![("ten".into(), "k".into())],
        limit: None,
        hits_addend: Some(TWO_53 + 1),
    });
    assert_eq!(call(s.rls, &two), Err(INVALID_ARGUMENT));
    assert_eq!(ten_left(&s, "other"), 10);
    // The request's own hits_addend is a uint32: a varint beyond it is refused, not cut
    // down to its low 32 bits (2^32 + 1 would charge 1).
    let mut message = encode_request(&one("costs", "ten", "other", None));
    message.push(3 << 3);
    message.extend_from_slice(&[0x81, 0x80, 0x80, 0x80, 0x10]);
    assert_eq!(call_bytes(s.rls, &message), Err(INVALID_ARGUMENT));
    assert_eq!(ten_left(&s, "other"), 10);
    assert_eq!(quota(&s, "ten", "k"), (10, 0));
}

#[test]
fn rls_hits_addend_above_2_53_is_invalid_and_changes_nothing_on_memory() {
    hits_above_2_53_are_invalid("backend = \"memory\"");
}

#[test]
fn rls_hits_addend_above_2_53_is_invalid_and_changes_nothing_on_redis() {
    let redis = RedisServer::start();
    hits_above_2_53_are_invalid(&redis_limiter(&redis));
}

/// A request's own `limit` (a uint32 per unit) meets the rules' bound: with a rate algorithm,
/// the limit times the unit in ms must stay below 2^53 (4,294,967,295 a year does not), or
/// the request is invalid and charges nothing; the windows and the log only count.
#[test]
fn an_rls_request_limit_past_2_53_with_a_rate_is_invalid() {
    let s = rls::start("backend = \"memory\"", "", RULES);
    let with_limit = |rule: &str, per_year: u32| {
        let mut r = one("costs", rule, "own", Some(1));
        r.descriptors[0].limit = Some((per_year, Unit::Year));
        call(s.rls, &r)
    };
    for rule in ["sw", "tb", "gc"] {
        assert_eq!(with_limit(rule, u32::MAX), Err(INVALID_ARGUMENT), "{rule}");
        assert_eq!(
            left(&s, rule, "own"),
            10,
            "{rule}: an invalid request charged"
        );
        // 285,616 a year is the most that stays below 2^53 ms.
        let fits = with_limit(rule, 285_616).expect("answer");
        assert_eq!(fits.overall_code, Code::Ok, "{rule}");
        assert_eq!(fits.statuses[0].limit_remaining, 285_615, "{rule}");
    }
    for rule in ["ten", "sl"] {
        let counted = with_limit(rule, u32::MAX).expect("answer");
        assert_eq!(counted.statuses[0].limit_remaining, u32::MAX - 1, "{rule}");
    }
}

fn exactly_2_53_is_decided_by_the_limit(limiter: &str) {
    let s = rls::start(limiter, "", RULES);
    let huge = |hits: u64| {
        call(s.rls, &one("costs", "huge", "h", Some(hits)))
            .expect("answer")
            .overall_code
    };
    assert_eq!(huge(1), Code::Ok);
    assert_eq!(quota(&s, "huge", "h"), (TWO_53, TWO_53 - 1));
    // 1 + 2^53 is 2^53 in a double: it must still be refused.
    assert_eq!(
        huge(TWO_53),
        Code::OverLimit,
        "2^53 after 1 of 2^53 admitted"
    );
    assert_eq!(quota(&s, "huge", "h"), (TWO_53, TWO_53 - 1));
    assert_eq!(huge(TWO_53 - 1), Code::Ok);
    assert_eq!(quota(&s, "huge", "h"), (TWO_53, 0));
    assert_eq!(huge(1), Code::OverLimit);
    // A fresh key takes exactly 2^53 at once.
    let fresh = call(s.rls, &one("costs", "huge", "f", Some(TWO_53))).expect("answer");
    assert_eq!(fresh.overall_code, Code::Ok);
    assert_eq!(quota(&s, "huge", "f"), (TWO_53, 0));
    assert_eq!(
        call(s.rls, &one("costs", "huge", "f", Some(1)))
            .expect("answer")
            .overall_code,
        Code::OverLimit
    );
}

#[test]
fn exactly_2_53_is_decided_by_the_limit_on_memory() {
    exactly_2_53_is_decided_by_the_limit("backend = \"memory\"");
}

#[test]
fn exactly_2_53_is_decided_by_the_limit_on_redis() {
    let redis = RedisServer::start();
    exactly_2_53_is_decided_by_the_limit(&redis_limiter(&redis));
}

// ---- Response costs above 2^53.

/// The upstream: `x-units: N` comes back as the header `x-usage-units: N` and, under
/// `/llm`, as an OpenAI body's `usage.total_tokens`, written as its digits.
fn answer(conn: &mut TcpStream, req: &HttpRequest) -> bool {
    let units = req.header("x-units").unwrap_or("1").to_owned();
    let resp = if req.target.starts_with("/llm") {
        let body = format!(
            "{{\"id\":\"c\",\"object\":\"chat.completion\",\"choices\":[],\"usage\":{{\"total_tokens\":{units}}}}}"
        );
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    } else {
        format!("HTTP/1.1 200 OK\r\nx-usage-units: {units}\r\nContent-Length: 2\r\n\r\nok")
    };
    conn.write_all(resp.as_bytes()).is_ok()
}

/// One metered route per algorithm that carries a debt (`/tb`, `/gc`, `/fw`: a cost header),
/// and `/llm` (an OpenAI usage sum); each 100 units an hour, 10 held at admission.
fn metered_config(upstream: std::net::SocketAddr, limiter: &str) -> String {
    let mut out = format!(
        "[server]\nlisten = [\"{{listen}}\"]\naccess_log = \"off\"\n[admin]\nlisten = \"{{admin}}\"\n\
         [limiter]\n{limiter}\n[upstreams.app]\nservers = [\"{upstream}\"]\n"
    );
    for (name, algorithm, cost) in [
        ("tb", "token_bucket", "{ header = \"x-usage-units\" }"),
        ("gc", "gcra", "{ header = \"x-usage-units\" }"),
        ("fw", "fixed_window", "{ header = \"x-usage-units\" }"),
        ("llm", "token_bucket", "{ usage = \"openai\" }"),
    ] {
        out.push_str(&format!(
            "[policies.{name}]\nalgorithm = \"{algorithm}\"\nlimit = 100\nperiod = \"1h\"\nkey = []\n\
             cost = {cost}\nreserve = 10\n\
             [[routes]]\nname = \"{name}\"\npath_prefix = \"/{name}\"\nupstream = \"app\"\npolicies = [\"{name}\"]\n"
        ));
    }
    out
}

fn response_costs_saturate(limiter: &str) {
    let up = Scripted::start(answer);
    let s = Sluice::start(&metered_config(up.addr, limiter));
    for route in ["tb", "gc", "fw", "llm"] {
        let path = format!("/{route}/x");
        // 2^64 - 1 parses as a u64; as a charge it must not wrap into a refund.
        let first = s.get_with(&path, &[("x-units", "18446744073709551615")]);
        assert_eq!(first.status, 200, "{route}: {}", first.body);
        let charged = format!(
            "sluice_policy_units_total{{kind=\"charged\",policy=\"{route}\",route=\"{route}\"}}"
        );
        assert!(
            s.wait_for(Duration::from_secs(2), || s.metric(&charged) > 0.0),
            "{route}: never settled"
        );
        assert_eq!(s.metric(&charged), TWO_53 as f64, "{route}: charged");
        let next = s.get_with(&path, &[("x-units", "1")]);
        assert_eq!(
            next.status, 429,
            "{route}: a cost of 2^64 - 1 left the key open"
        );
    }
    assert_eq!(up.hits(), 4);
}

#[test]
fn a_response_cost_above_2_53_is_charged_as_2_53_on_memory() {
    response_costs_saturate("backend = \"memory\"");
}

#[test]
fn a_response_cost_above_2_53_is_charged_as_2_53_on_redis() {
    let redis = RedisServer::start();
    response_costs_saturate(&redis_limiter(&redis));
}

// ---- A ban answers alike everywhere.

const KEY: &str = "sk_test_costs_5Jd8QmW2rTbX";

/// `/api/` requires a key; `max_failures` bans for 2 s an address that presents three
/// invalid ones within the hour.
fn ban_config(limiter: &str) -> String {
    format!(
        "[server]\nlisten = [\"{{listen}}\"]\naccess_log = \"off\"\n[admin]\nlisten = \"{{admin}}\"\n\
         [limiter]\n{limiter}\n\
         [auth]\nmax_failures = {{ limit = 3, period = \"1h\", ban = \"2s\" }}\n\
         [[consumers]]\nname = \"acme\"\nkeys = [\"{}\"]\n\
         [[routes]]\nname = \"api\"\npath_prefix = \"/api/\"\nauth = \"required\"\nrespond = {{ status = 200 }}\n",
        key_digest(KEY)
    )
}

fn retry_after(r: &http::Response) -> u64 {
    assert_eq!(r.status, 429, "{:?} {}", r.headers, r.body);
    r.header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("Retry-After")
}

/// Three invalid keys on `a`: then `b` (which may be `a`) refuses the address within a
/// second, every Retry-After (on both) is at most the ban's 2 s, and once it is over `b`
/// serves the valid key again, though the failures window (an hour) is still full.
fn ban_answers_its_rest(a: &Sluice, b: &Sluice) {
    assert_eq!(b.get_with("/api/x", &[("x-api-key", KEY)]).status, 200);
    for bad in ["sk_bad_1", "sk_bad_2", "sk_bad_3"] {
        assert_eq!(a.get_with("/api/x", &[("x-api-key", bad)]).status, 401);
    }
    let banned_at = Instant::now();
    assert!(
        b.wait_for(Duration::from_secs(1), || {
            b.get_with("/api/x", &[("x-api-key", KEY)]).status == 429
        }),
        "the address is not banned"
    );
    for s in [a, b] {
        let with_key = retry_after(&s.get_with("/api/x", &[("x-api-key", KEY)]));
        let with_bad = retry_after(&s.get_with("/api/x", &[("x-api-key", "sk_bad_4")]));
        assert!(
            with_key <= 2 && with_bad <= 2,
            "Retry-After {with_key} and {with_bad} during a 2 s ban"
        );
    }
    assert!(
        b.wait_for(Duration::from_secs(4), || {
            b.get_with("/api/x", &[("x-api-key", KEY)]).status == 200
        }),
        "still refused after the ban"
    );
    assert!(banned_at.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_max_failures_ban_answers_its_rest_on_memory() {
    let s = Sluice::start(&ban_config("backend = \"memory\""));
    ban_answers_its_rest(&s, &s);
}

#[test]
fn a_max_failures_ban_answers_its_rest_on_every_instance_of_a_fleet() {
    let redis = RedisServer::start();
    let limiter = format!(
        "backend = \"redis\"\nurl = \"{}\"\ntimeout = \"500ms\"",
        redis.url()
    );
    let (a, b) = (
        Sluice::start(&ban_config(&limiter)),
        Sluice::start(&ban_config(&limiter)),
    );
    ban_answers_its_rest(&a, &b);
}

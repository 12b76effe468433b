//! Charging from the response (DESIGN §12) through the real binary: failed logins counted
//! (and banned) while successful ones are refunded, also when many bad attempts arrive at
//! once; costs an upstream reports in a header charged exactly, a debt carried into the next
//! requests, a response without the header charged its reservation (2xx) or refunded; on
//! the memory backend and across two instances on one Redis.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use common::http::{self, Request, Scripted};
use common::redis::RedisServer;
use common::Sluice;

/// An upstream whose answers the request chooses: `/login?password=right` answers 200,
/// any other login 401; elsewhere `x-units: N` is echoed as `x-usage-units: N` (none when
/// absent) and `x-status: S` sets the status. Each login is held 100 ms, so concurrent
/// attempts are in flight together.
fn upstream() -> Scripted {
    Scripted::start(answer)
}

/// Answers one request; false when the connection must end.
fn answer(conn: &mut TcpStream, req: &Request) -> bool {
    let header = |name: &str| req.header(name).map(str::to_owned);
    let (status, extra) = if req.target.starts_with("/login") {
        std::thread::sleep(Duration::from_millis(100));
        if req.target.contains("password=right") {
            (200, String::new())
        } else {
            (401, String::new())
        }
    } else {
        let status = header("x-status").map_or(200, |s| s.parse().unwrap());
        let units = header("x-units").map_or(String::new(), |u| format!("x-usage-units: {u}\r\n"));
        (status, units)
    };
    let resp = format!("HTTP/1.1 {status} X\r\n{extra}Content-Length: 2\r\n\r\nok");
    conn.write_all(resp.as_bytes()).is_ok()
}

fn config(upstream: SocketAddr, backend: &str) -> String {
    format!(
        "[server]\nlisten = [\"{{listen}}\"]\n[admin]\nlisten = \"{{admin}}\"\n\
         [limiter]\n{backend}\n\
         [upstreams.app]\nservers = [\"{upstream}\"]\n\
         [policies.failed_logins]\nalgorithm = \"fixed_window\"\nlimit = 5\nperiod = \"15m\"\n\
         key = [\"client_ip\"]\nban = \"1h\"\ncount = {{ status = [401, 403, \"500-599\"] }}\n\
         [policies.units]\nalgorithm = \"token_bucket\"\nlimit = 100\nperiod = \"1h\"\n\
         key = [\"header:x-customer\"]\ncost = {{ header = \"x-usage-units\" }}\nreserve = 10\n\
         [[routes]]\nname = \"login\"\npath_prefix = \"/login\"\nupstream = \"app\"\npolicies = [\"failed_logins\"]\n\
         [[routes]]\nname = \"metered\"\npath_prefix = \"/api\"\nupstream = \"app\"\npolicies = [\"units\"]\n"
    )
}

fn login(s: &Sluice, password: &str) -> u16 {
    s.get(&format!("/login?password={password}")).status
}

fn metered(s: &Sluice, customer: &str, units: Option<u64>, status: u16) -> http::Response {
    let units = units.map(|u| u.to_string());
    let status = status.to_string();
    let mut headers = vec![("x-customer", customer), ("x-status", status.as_str())];
    if let Some(u) = &units {
        headers.push(("x-units", u.as_str()));
    }
    s.get_with("/api/call", &headers)
}

fn units(s: &Sluice, kind: &str) -> f64 {
    s.metric(&format!(
        "sluice_policy_units_total{{kind=\"{kind}\",policy=\"units\",route=\"metered\"}}"
    ))
}

#[test]
fn successful_logins_are_refunded_and_failed_ones_counted_then_banned() {
    let up = upstream();
    let s = Sluice::start(&config(up.addr, "backend = \"memory\""));
    // Twenty good logins: each charged at admission and refunded by its 200.
    for _ in 0..20 {
        assert_eq!(login(&s, "right"), 200);
    }
    // Five failures fill the window; the sixth attempt is refused and bans the address.
    for _ in 0..5 {
        assert_eq!(login(&s, "wrong"), 401);
    }
    assert_eq!(login(&s, "wrong"), 429);
    let r = s.get("/login?password=right");
    assert_eq!(r.status, 429, "banned: even the right password waits");
    assert!(r.header("retry-after").unwrap().parse::<u64>().unwrap() > 3_000);
    assert_eq!(up.hits(), 25);
    let refunded = s.metric(
        "sluice_policy_units_total{kind=\"refunded\",policy=\"failed_logins\",route=\"login\"}",
    );
    assert_eq!(refunded, 20.0);
}

#[test]
fn twenty_bad_attempts_at_once_reach_the_upstream_at_most_the_limit() {
    let up = upstream();
    let s = Sluice::start(&config(up.addr, "backend = \"memory\""));
    let addr = s.addr;
    let answers: Vec<u16> = (0..20)
        .map(|_| std::thread::spawn(move || http::get(addr, "/login?password=wrong", &[]).status))
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    assert_eq!(
        answers.iter().filter(|&&s| s == 401).count(),
        5,
        "{answers:?}"
    );
    assert_eq!(
        answers.iter().filter(|&&s| s == 429).count(),
        15,
        "{answers:?}"
    );
    assert_eq!(up.hits(), 5, "only the limit's attempts reach the upstream");
}

#[test]
fn header_costs_are_charged_exactly_and_a_debt_delays_the_next_requests() {
    let up = upstream();
    let s = Sluice::start(&config(up.addr, "backend = \"memory\""));
    // 100 units an hour, 10 held per request: 7 + 13 + 30 = 50 spent.
    for cost in [7, 13, 30] {
        assert_eq!(metered(&s, "acme", Some(cost), 200).status, 200);
    }
    // A 5xx without the header is refunded; a 2xx without it is charged its reservation.
    assert_eq!(metered(&s, "acme", None, 503).status, 503);
    assert_eq!(metered(&s, "acme", None, 200).status, 200);
    assert_eq!(units(&s, "charged"), 60.0);
    assert_eq!(units(&s, "reserved"), 50.0);
    assert_eq!(units(&s, "refunded"), 3.0 + 10.0);
    assert_eq!(
        s.metric("sluice_response_cost_missing_total{policy=\"units\",route=\"metered\"}"),
        2.0
    );
    // 60 spent: a call that costs 70 leaves a debt of 30, so the next call (which must
    // hold 10) waits for 40 units to refill at 100 an hour: about 24 minutes.
    assert_eq!(metered(&s, "acme", Some(70), 200).status, 200);
    let r = metered(&s, "acme", Some(1), 200);
    assert_eq!(r.status, 429, "the debt must be paid first");
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((1_400..=1_500).contains(&retry), "retry-after {retry}");
    // Another customer is untouched.
    assert_eq!(metered(&s, "other", Some(1), 200).status, 200);
}

#[test]
fn two_instances_on_one_redis_settle_into_one_budget() {
    let redis = RedisServer::start();
    let up = upstream();
    let backend = format!(
        "backend = \"redis\"\nurl = \"{}\"\ntimeout = \"500ms\"",
        redis.url()
    );
    let a = Sluice::start(&config(up.addr, &backend));
    let b = Sluice::start(&config(up.addr, &backend));
    // 45 units through A and 45 through B: 90 of 100 spent, whatever instance answered.
    for (s, cost) in [(&a, 20), (&b, 25), (&a, 25), (&b, 20)] {
        assert_eq!(metered(s, "acme", Some(cost), 200).status, 200);
    }
    // 10 left: one more call may hold its 10 and cost 10; then nothing is left on either.
    assert_eq!(metered(&b, "acme", Some(10), 200).status, 200);
    assert_eq!(metered(&a, "acme", Some(1), 200).status, 429);
    assert_eq!(metered(&b, "acme", Some(1), 200).status, 429);
    // Failed logins count across the fleet too.
    for s in [&a, &b, &a, &b, &a] {
        assert_eq!(login(s, "wrong"), 401);
    }
    assert_eq!(login(&b, "wrong"), 429);
    assert_eq!(login(&a, "right"), 429);
}

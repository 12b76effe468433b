//! The limiter end to end through the real binary on the memory backend.

mod common;

use std::time::{Duration, Instant};

use common::http::{self, Upstream};
use common::{burst, config, count_status, one_route_per_algorithm, policy, Sluice};

const COUNTING: [&str; 5] = [
    "fixed_window",
    "sliding_window",
    "sliding_log",
    "token_bucket",
    "gcra",
];

#[test]
fn each_counting_algorithm_admits_exactly_its_limit() {
    let s = Sluice::start(&one_route_per_algorithm("", "", &COUNTING, 5, "1h"));
    for a in COUNTING {
        let statuses: Vec<u16> = (0..8).map(|_| s.get(&format!("/{a}")).status).collect();
        assert_eq!(statuses, [200, 200, 200, 200, 200, 429, 429, 429], "{a}");
        let allowed =
            format!(r#"sluice_decisions_total{{decision="allowed",policy="{a}",route="{a}"}}"#);
        let rejected =
            format!(r#"sluice_decisions_total{{decision="rejected",policy="{a}",route="{a}"}}"#);
        assert_eq!((s.metric(&allowed), s.metric(&rejected)), (5.0, 3.0), "{a}");
    }
}

#[test]
fn two_hundred_at_once_against_fifty_admit_exactly_fifty() {
    let s = Sluice::start(&one_route_per_algorithm(
        "",
        "threads = 4",
        &COUNTING,
        50,
        "1h",
    ));
    for a in COUNTING {
        let responses = burst(s.addr, 200, &format!("/{a}"), &[]);
        assert_eq!(count_status(&responses, 200), 50, "{a}");
        assert_eq!(count_status(&responses, 429), 150, "{a}");
    }
}

#[test]
fn ietf_headers_count_down_and_429_carries_problem_body() {
    let s = Sluice::start(&config(
        "",
        "",
        &policy("per_ip", "fixed_window", 3, "1h", "\"client_ip\"", ""),
        &[("a", "\"per_ip\"")],
    ));
    for left in [2, 1, 0] {
        let r = s.get("/a");
        assert_eq!(r.status, 200);
        assert_eq!(r.header("ratelimit-policy"), Some("\"per_ip\";q=3;w=3600"));
        let state = r.header("ratelimit").unwrap_or_default().to_owned();
        assert!(
            state.starts_with(&format!("\"per_ip\";r={left};t=")),
            "{state}"
        );
    }
    let r = s.get("/a");
    assert_eq!(r.status, 429);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let retry: u64 = r
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("Retry-After");
    assert!((1..=3600).contains(&retry), "{retry}");
    let body: serde_json::Value = serde_json::from_str(&r.body).expect("json body");
    assert_eq!(
        body,
        serde_json::json!({
            "type": "https://iana.org/assignments/http-problem-types#quota-exceeded",
            "title": "Too Many Requests",
            "status": 429,
            "violated-policies": ["per_ip"]
        })
    );
}

#[test]
fn legacy_headers_show_the_most_restrictive_policy() {
    let policies =
        policy("wide", "gcra", 100, "1m", "", "") + &policy("narrow", "gcra", 4, "1m", "", "");
    let s = Sluice::start(&config(
        "",
        "headers = \"legacy\"",
        &policies,
        &[("a", "\"wide\", \"narrow\"")],
    ));
    let r = s.get("/a");
    assert_eq!(r.header("x-ratelimit-limit"), Some("4"));
    assert_eq!(r.header("x-ratelimit-remaining"), Some("3"));
    assert_eq!(r.header("x-ratelimit-reset"), Some("15"));
    assert_eq!(r.header("ratelimit"), None);
    let off = Sluice::start(&config(
        "",
        "headers = \"off\"",
        &policies,
        &[("a", "\"wide\"")],
    ));
    assert_eq!(off.get("/a").header("x-ratelimit-limit"), None);
    assert_eq!(off.get("/a").header("ratelimit"), None);
}

#[test]
fn shadow_policies_never_block_but_are_counted() {
    let s = Sluice::start(&config(
        "",
        "",
        &policy("dry", "fixed_window", 2, "1h", "", "mode = \"shadow\""),
        &[("a", "\"dry\"")],
    ));
    for _ in 0..5 {
        let r = s.get("/a");
        assert_eq!(r.status, 200);
        assert_eq!(
            r.header("ratelimit"),
            None,
            "shadow policies are left out of headers"
        );
    }
    assert_eq!(
        s.metric(r#"sluice_decisions_total{decision="allowed",policy="dry",route="a"}"#),
        2.0
    );
    assert_eq!(
        s.metric(r#"sluice_decisions_total{decision="shadow_rejected",policy="dry",route="a"}"#),
        3.0
    );
}

#[test]
fn a_request_denied_by_one_policy_charges_none() {
    let policies = policy("per_user", "fixed_window", 2, "1h", "\"header:x-user\"", "")
        + &policy("global", "fixed_window", 3, "1h", "", "");
    let s = Sluice::start(&config(
        "",
        "",
        &policies,
        &[("a", "\"per_user\", \"global\"")],
    ));
    let as_user = |u: &str| s.get_with("/a", &[("X-User", u)]).status;
    assert_eq!(
        [as_user("u1"), as_user("u1"), as_user("u1"), as_user("u1")],
        [200, 200, 429, 429]
    );
    // Had u1's denied requests charged `global`, u2 would be refused now.
    assert_eq!(as_user("u2"), 200);
    assert_eq!(as_user("u3"), 429, "global is now spent: 3 admitted");
    let r = s.get_with("/a", &[("X-User", "u4")]);
    assert!(
        r.body.contains("\"violated-policies\":[\"global\"]"),
        "{}",
        r.body
    );
}

#[test]
fn exempt_networks_are_never_limited() {
    let s = Sluice::start(&config(
        "",
        "",
        &policy(
            "p",
            "fixed_window",
            1,
            "1h",
            "\"client_ip\"",
            "exempt = [\"127.0.0.0/8\"]",
        ),
        &[("a", "\"p\"")],
    ));
    for _ in 0..5 {
        assert_eq!(s.get("/a").status, 200);
    }
    assert_eq!(
        s.metric(r#"sluice_decisions_total{decision="exempt",policy="p",route="a"}"#),
        5.0
    );
}

#[test]
fn every_key_part_separates_buckets() {
    let parts = [
        ("hdr", "\"header:x-api-key\""),
        ("qry", "\"query:user\""),
        ("cke", "\"cookie:session\""),
        ("pth", "\"path\""),
        ("mth", "\"method\""),
        ("hst", "\"host\""),
        ("net", "\"client_ip/24\""),
        ("ip", "\"client_ip\""),
        ("rte", "\"route\""),
    ];
    let policies: String = parts
        .iter()
        .map(|(n, k)| policy(n, "fixed_window", 1, "1h", k, ""))
        .collect();
    let mut template = config("", "trusted_proxies = [\"127.0.0.1/32\"]", &policies, &[]);
    for (n, _) in parts {
        template.push_str(&format!(
            "[[routes]]\nname = \"{n}\"\npath_prefix = \"/{n}\"\nrespond = {{ status = 200 }}\npolicies = [\"{n}\"]\n"
        ));
    }
    template.push_str("[[routes]]\nname = \"rte2\"\npath_prefix = \"/second\"\nrespond = { status = 200 }\npolicies = [\"rte\"]\n");
    let s = Sluice::start(&template);
    // (path, headers) for A, A again (limited), then B (a different value: its own bucket).
    type Req<'a> = (&'a str, Vec<(&'a str, &'a str)>);
    let cases: Vec<(&str, Req, Req)> = vec![
        (
            "hdr",
            ("/hdr", vec![("X-Api-Key", "k1")]),
            ("/hdr", vec![("X-Api-Key", "k2")]),
        ),
        ("qry", ("/qry?user=a", vec![]), ("/qry?user=b", vec![])),
        (
            "cke",
            ("/cke", vec![("Cookie", "x=1; session=s1")]),
            ("/cke", vec![("Cookie", "session=s2")]),
        ),
        ("pth", ("/pth/a", vec![]), ("/pth/b", vec![])),
        (
            "hst",
            ("/hst", vec![("Host", "a.example")]),
            ("/hst", vec![("Host", "b.example")]),
        ),
        (
            "net",
            ("/net", vec![("X-Forwarded-For", "198.51.100.7")]),
            ("/net", vec![("X-Forwarded-For", "198.51.101.7")]),
        ),
        (
            "ip",
            ("/ip", vec![("X-Forwarded-For", "198.51.100.7")]),
            ("/ip", vec![("X-Forwarded-For", "198.51.100.8")]),
        ),
        ("rte", ("/rte", vec![]), ("/second", vec![])),
    ];
    for (name, (pa, ha), (pb, hb)) in cases {
        assert_eq!(s.get_with(pa, &ha).status, 200, "{name} first");
        assert_eq!(s.get_with(pa, &ha).status, 429, "{name} same value again");
        assert_eq!(s.get_with(pb, &hb).status, 200, "{name} other value");
    }
    // Same /24: one bucket.
    assert_eq!(
        s.get_with("/net", &[("X-Forwarded-For", "198.51.100.99")])
            .status,
        429
    );
    // method
    assert_eq!(http::request(s.addr, "GET", "/mth", &[], "").status, 200);
    assert_eq!(http::request(s.addr, "GET", "/mth", &[], "").status, 429);
    assert_eq!(http::request(s.addr, "POST", "/mth", &[], "").status, 200);
    // A missing part skips the policy by default.
    assert_eq!(s.get("/hdr").status, 200);
    assert_eq!(s.get("/hdr").status, 200);
    assert_eq!(
        s.metric(r#"sluice_decisions_total{decision="skipped",policy="hdr",route="hdr"}"#),
        2.0
    );
}

#[test]
fn forwarded_for_from_an_untrusted_peer_does_not_evade_client_ip_limits() {
    let s = Sluice::start(&config(
        "",
        "",
        &policy("ip", "gcra", 2, "1h", "\"client_ip\"", ""),
        &[("a", "\"ip\"")],
    ));
    let statuses: Vec<u16> = (0..4)
        .map(|i| {
            s.get_with("/a", &[("X-Forwarded-For", &format!("203.0.113.{i}"))])
                .status
        })
        .collect();
    assert_eq!(statuses, [200, 200, 429, 429]);
}

#[test]
fn on_missing_deny_and_shared() {
    let policies = policy(
        "deny",
        "fixed_window",
        10,
        "1h",
        "\"header:x-key\"",
        "on_missing = \"deny\"\nstatus = 403",
    ) + &policy(
        "shared",
        "fixed_window",
        2,
        "1h",
        "\"header:x-key\"",
        "on_missing = \"shared\"",
    );
    let s = Sluice::start(&config(
        "",
        "",
        &policies,
        &[("d", "\"deny\""), ("s", "\"shared\"")],
    ));
    let r = s.get("/d");
    assert_eq!(r.status, 403);
    assert!(r.body.contains("\"violated-policies\":[\"deny\"]"));
    assert_eq!(s.get_with("/d", &[("X-Key", "k")]).status, 200);
    assert_eq!(
        [s.get("/s").status, s.get("/s").status, s.get("/s").status],
        [200, 200, 429]
    );
    assert_eq!(s.get_with("/s", &[("X-Key", "k")]).status, 200);
}

#[test]
fn cost_charges_several_units() {
    let s = Sluice::start(&config(
        "",
        "",
        &policy("p", "token_bucket", 5, "1h", "", "cost = 2"),
        &[("a", "\"p\"")],
    ));
    assert_eq!(
        [s.get("/a").status, s.get("/a").status, s.get("/a").status],
        [200, 200, 429]
    );
}

#[test]
fn delay_mode_holds_requests_until_they_conform() {
    let s = Sluice::start(&config(
        "",
        "",
        &policy(
            "p",
            "gcra",
            10,
            "1s",
            "",
            "burst = 1\non_exceed = \"delay\"\nmax_delay = \"350ms\"",
        ),
        &[("a", "\"p\"")],
    ));
    let started = Instant::now();
    let responses = burst(s.addr, 6, "/a", &[]);
    // Waits of 0, 100, 200 and 300 ms fit in 350 ms; the rest are rejected.
    assert_eq!(count_status(&responses, 200), 4);
    assert_eq!(count_status(&responses, 429), 2);
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        s.metric(r#"sluice_decisions_total{decision="delayed",policy="p",route="a"}"#),
        3.0
    );
}

#[test]
fn leaky_bucket_shapes_to_exactly_its_rate() {
    let s = Sluice::start(&config(
        "",
        "",
        &policy("p", "leaky_bucket", 10, "1s", "", "burst = 3"),
        &[("a", "\"p\"")],
    ));
    let started = Instant::now();
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(6));
    let addr = s.addr;
    let handles: Vec<_> = (0..6)
        .map(|_| {
            let b = barrier.clone();
            std::thread::spawn(move || {
                b.wait();
                let r = http::get(addr, "/a", &[]);
                (r.status, started.elapsed())
            })
        })
        .collect();
    let mut results: Vec<(u16, Duration)> = handles
        .into_iter()
        .map(|h| h.join().expect("thread"))
        .collect();
    results.sort_by_key(|(_, d)| *d);
    let passed: Vec<Duration> = results
        .iter()
        .filter(|(s, _)| *s == 200)
        .map(|(_, d)| *d)
        .collect();
    assert_eq!(
        passed.len(),
        4,
        "one at once plus a queue of 3: {results:?}"
    );
    // Released one every 100 ms.
    for (i, d) in passed.iter().enumerate() {
        assert!(
            *d >= Duration::from_millis(100 * i as u64),
            "request {i} left at {d:?}"
        );
    }
    assert!(passed[3] < Duration::from_millis(900), "{passed:?}");
}

#[test]
fn concurrency_slots_are_released_when_responses_end() {
    let slow = Upstream::start_with_delay("slow", Duration::from_millis(400));
    let template = format!(
        "[server]\nlisten = [\"{{listen}}\"]\naccess_log = \"off\"\nthreads = 4\n[admin]\nlisten = \"{{admin}}\"\n[upstreams.u]\nservers = [\"{}\"]\n{}[[routes]]\nname = \"a\"\nupstream = \"u\"\npolicies = [\"c\"]\n",
        slow.addr,
        "[policies.c]\nalgorithm = \"concurrency\"\nlimit = 2\nkey = []\n"
    );
    let s = Sluice::start(&template);
    let responses = burst(s.addr, 5, "/", &[]);
    assert_eq!(count_status(&responses, 200), 2);
    assert_eq!(count_status(&responses, 429), 3);
    let ok = responses.iter().find(|r| r.status == 200).expect("a 200");
    assert_eq!(
        ok.header("ratelimit-policy"),
        Some("\"c\";q=2;qu=\"concurrent-requests\"")
    );
    // Slots came back when the responses ended. A slot is freed when the request's last
    // phase runs, just after its response is written, so a client could win that race by
    // microseconds: give the server a moment (it lost the race once on a loaded CI box).
    std::thread::sleep(Duration::from_millis(100));
    let responses = burst(s.addr, 2, "/", &[]);
    assert_eq!(count_status(&responses, 200), 2);
    // A client that gives up mid-request frees its slot too.
    for _ in 0..2 {
        let mut c = std::net::TcpStream::connect(s.addr).expect("connect");
        use std::io::Write;
        c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .expect("write");
        std::thread::sleep(Duration::from_millis(50));
        drop(c);
    }
    std::thread::sleep(Duration::from_millis(600));
    let responses = burst(s.addr, 2, "/", &[]);
    assert_eq!(
        count_status(&responses, 200),
        2,
        "slots of vanished clients were released"
    );
}

#[test]
fn a_reload_that_keeps_a_policy_keeps_its_counts() {
    let template = config(
        "",
        "",
        &policy("p", "fixed_window", 2, "1h", "", ""),
        &[("a", "\"p\"")],
    );
    let s = Sluice::start(&template);
    assert_eq!([s.get("/a").status, s.get("/a").status], [200, 200]);
    s.reload(&template.replace(
        "respond = { status = 200, body = \"ok\\n\" }",
        "respond = { status = 200, body = \"new\\n\" }",
    ));
    assert!(s.wait_for(Duration::from_secs(5), || s
        .metric(r#"sluice_config_reloads_total{result="success"}"#)
        == 1.0));
    assert_eq!(
        s.get("/a").status,
        429,
        "the reload did not reset the limit"
    );
}

#[test]
fn concurrency_slots_are_released_when_the_upstream_fails() {
    let dead = format!("127.0.0.1:{}", common::free_port());
    let template = format!(
        "[server]\nlisten = [\"{{listen}}\"]\naccess_log = \"off\"\n[admin]\nlisten = \"{{admin}}\"\n[upstreams.u]\nservers = [\"{dead}\"]\nconnect_timeout = \"200ms\"\n\
         [policies.c]\nalgorithm = \"concurrency\"\nlimit = 1\nkey = []\n[[routes]]\nname = \"a\"\nupstream = \"u\"\npolicies = [\"c\"]\n"
    );
    let s = Sluice::start(&template);
    // Each request holds the only slot, fails upstream, and must give the slot back.
    for _ in 0..4 {
        assert_eq!(s.get("/").status, 502);
    }
    assert_eq!(
        s.metric(r#"sluice_decisions_total{decision="allowed",policy="c",route="a"}"#),
        4.0
    );
}

/// One policy, three plans: anonymous, gold and partner clients get 3, 10 and 20 requests,
/// each shown its own `q`; the override changes the numbers, not the key.
#[test]
fn overrides_give_each_plan_its_numbers() {
    let s = Sluice::start(&config(
        "",
        "",
        &common::plans_policy(""),
        &[("a", "\"plans\"")],
    ));
    let anon =
        common::admitted_until_rejected(&s, "/a", &[("x-api-key", "k-anon")], "plans", 3, 30);
    let gold = common::admitted_until_rejected(
        &s,
        "/a",
        &[("x-api-key", "k-gold"), ("x-plan", "gold")],
        "plans",
        10,
        30,
    );
    let partner =
        common::admitted_until_rejected(&s, "/a", &[("x-api-key", "k-partner-2")], "plans", 20, 30);
    assert_eq!((anon, gold, partner), (3, 10, 20));
    // The same key without the plan header counts in the same state: over 3 already.
    let r = s.get_with("/a", &[("x-api-key", "k-gold")]);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("ratelimit-policy"), Some("\"plans\";q=3;w=3600"));
    // Legacy headers show the applied limit too.
    let legacy = Sluice::start(&config(
        "",
        "headers = \"legacy\"",
        &common::plans_policy(""),
        &[("a", "\"plans\"")],
    ));
    let r = legacy.get_with("/a", &[("x-api-key", "k-partner-1")]);
    assert_eq!(r.header("x-ratelimit-limit"), Some("20"));
    assert_eq!(r.header("x-ratelimit-remaining"), Some("19"));
}

/// `client_ip` overrides match CIDRs: the test client (127.0.0.1) is inside 127.0.0.0/8
/// and gets 4; a list that misses it leaves the policy's 2.
#[test]
fn a_cidr_override_matches_the_client_network() {
    let policies = policy("inside", "gcra", 2, "1h", "\"client_ip\"", "")
        + "[[policies.inside.overrides]]\nwhen = { \"client_ip\" = [\"10.0.0.0/8\", \"127.0.0.0/8\"] }\nlimit = 4\n"
        + &policy("outside", "gcra", 2, "1h", "\"client_ip\"", "")
        + "[[policies.outside.overrides]]\nwhen = { \"client_ip/24\" = \"10.0.0.0/8\" }\nlimit = 4\n";
    let s = Sluice::start(&config(
        "",
        "",
        &policies,
        &[("in", "\"inside\""), ("out", "\"outside\"")],
    ));
    let statuses = |path: &str| -> Vec<u16> { (0..5).map(|_| s.get(path).status).collect() };
    assert_eq!(statuses("/in"), [200, 200, 200, 200, 429]);
    assert_eq!(statuses("/out"), [200, 200, 429, 429, 429]);
    assert_eq!(
        s.get("/in").header("ratelimit-policy"),
        Some("\"inside\";q=4;w=3600")
    );
}

/// `ban`: the first rejection bans the key for `ban` (the window turning does not lift
/// it), Retry-After counts the ban down, the key then passes again; counted as `banned`.
/// A shadow policy with a ban bans nobody.
#[test]
fn a_ban_holds_for_its_time_then_lifts_and_shadow_bans_nobody() {
    let policies = common::ban_policies();
    let s = Sluice::start(&config(
        "",
        "",
        &policies,
        &[("a", "\"strict\""), ("d", "\"dry\"")],
    ));
    // The first rejection bans; a new window later, still banned, for the rest of the ban.
    let started = common::banned_then_still_banned(&s, &s);
    assert_eq!(
        s.metric(r#"sluice_decisions_total{decision="banned",policy="strict",route="a"}"#),
        1.0
    );
    assert_eq!(
        s.metric(r#"sluice_decisions_total{decision="rejected",policy="strict",route="a"}"#),
        1.0
    );
    let lifted = Duration::from_millis(4_100).saturating_sub(started.elapsed());
    std::thread::sleep(lifted);
    assert_eq!(s.get("/a").status, 200, "the ban lifted");
    for _ in 0..4 {
        assert_eq!(s.get("/d").status, 200);
    }
    std::thread::sleep(Duration::from_millis(1_100));
    assert_eq!(s.get("/d").status, 200);
    assert_eq!(
        s.metric(r#"sluice_decisions_total{decision="banned",policy="dry",route="d"}"#),
        0.0
    );
    assert_eq!(
        s.metric(r#"sluice_decisions_total{decision="allowed",policy="dry",route="d"}"#),
        2.0,
        "the shadow policy's key was not banned: a new window admits again"
    );
}

/// A request refused by one policy (#43 item 10): the access log names the policy that
/// refused it and marks the others `not_charged`, as text and as JSON; a request that
/// passes shows every policy `allowed`.
#[test]
fn the_access_log_says_which_policy_refused_and_that_the_others_were_not_charged() {
    let policies = policy("global", "fixed_window", 100, "1h", "", "")
        + &policy("per_ip", "fixed_window", 1, "1h", "\"client_ip\"", "");
    for format in ["text", "json"] {
        let conf = config("", "", &policies, &[("a", "\"global\", \"per_ip\"")]).replace(
            "access_log = \"off\"",
            &format!("access_log = \"{format}\""),
        );
        let s = Sluice::start(&conf);
        assert_eq!(s.get("/a").status, 200);
        assert_eq!(s.get("/a").status, 429);
        let (passed, refused) = match format {
            "text" => (
                "decisions=global=allowed,per_ip=allowed",
                "decisions=global=not_charged,per_ip=rejected",
            ),
            _ => (
                r#""decisions":{"global":"allowed","per_ip":"allowed"}"#,
                r#""decisions":{"global":"not_charged","per_ip":"rejected"}"#,
            ),
        };
        let logged = s.wait_for(Duration::from_secs(5), || {
            let log = s.stdout();
            log.contains(passed) && log.contains(refused)
        });
        assert!(logged, "{format}: {}", s.stdout());
    }
}

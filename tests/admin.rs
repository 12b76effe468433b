//! The admin API (DESIGN §9.2) end to end: the real binary, and real redis-server for the
//! fleet.

mod common;

use std::time::{Duration, Instant};

use common::http::{self, Response};
use common::redis::RedisServer;
use common::{count_status, policy, Sluice, TempDir};

const TOKEN: &str = "t0ken-for-tests";

/// One route `/r` under a fixed_window policy `per_key` (3 per hour, keyed on x-api-key).
fn template(limiter: &str, token_file: Option<&str>) -> String {
    let admin_extra = token_file
        .map(|f| format!("token_file = \"{f}\"\n"))
        .unwrap_or_default();
    format!(
        "[server]\nlisten = [\"{{listen}}\"]\naccess_log = \"off\"\n[admin]\nlisten = \"{{admin}}\"\n{admin_extra}[limiter]\n{limiter}\n{}\n[[routes]]\nname = \"r\"\npath = \"/r\"\nrespond = {{ status = 200, body = \"ok\\n\" }}\npolicies = [\"per_key\"]\n",
        policy("per_key", "fixed_window", 3, "1h", "\"header:x-api-key\"", "")
    )
}

fn token_file(dir: &TempDir) -> String {
    let path = dir.0.join("token");
    std::fs::write(&path, format!("{TOKEN}\n")).expect("token file");
    path.display().to_string()
}

fn call(s: &Sluice, method: &str, path: &str, body: &str) -> Response {
    let auth = format!("Bearer {TOKEN}");
    http::request(s.admin, method, path, &[("Authorization", &auth)], body)
}

fn hit(s: &Sluice, key: &str) -> u16 {
    s.get_with("/r", &[("x-api-key", key)]).status
}

fn assert_problem(r: &Response, status: u16, detail: &str) {
    assert_eq!(r.status, status, "{}", r.body);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert!(r.body.contains(detail), "{detail:?} not in {}", r.body);
}

#[test]
fn bad_calls_get_their_status_and_problem() {
    let off = Sluice::start(&template("backend = \"memory\"", None));
    let r = http::get(off.admin, "/v1/policies", &[("Authorization", "Bearer x")]);
    assert_problem(&r, 403, "token_file");

    let dir = TempDir::new();
    let s = Sluice::start(&template("backend = \"memory\"", Some(&token_file(&dir))));
    assert_problem(&http::get(s.admin, "/v1/policies", &[]), 401, "missing");
    let wrong = http::get(s.admin, "/v1/policies", &[("Authorization", "Bearer nope")]);
    assert_problem(&wrong, 401, "wrong bearer token");
    assert_problem(&call(&s, "GET", "/v1/quota/nope?key=a", ""), 404, "nope");
    assert_problem(
        &call(&s, "GET", "/v1/quota/per_key", ""),
        400,
        "got 0 key value",
    );
    assert_problem(
        &call(&s, "GET", "/v1/quota/per_key?key=a&key=b", ""),
        400,
        "got 2",
    );
    let bad_json = call(&s, "PUT", "/v1/overrides/per_key?key=a", "{limit: 5");
    assert_problem(&bad_json, 400, "bad JSON");
    let zero = call(&s, "PUT", "/v1/overrides/per_key?key=a", "{\"limit\": 0}");
    assert_problem(&zero, 400, "between 1 and");
    // A rejected call changes nothing.
    assert!(call(&s, "GET", "/v1/overrides/per_key", "").body.trim() == "[]");
    assert_eq!(call(&s, "GET", "/v1/policies", "").status, 200);
    assert_eq!(
        s.metric("sluice_admin_requests_total{endpoint=\"quota\",status=\"401\"}"),
        0.0
    );
    assert_eq!(
        s.metric("sluice_admin_requests_total{endpoint=\"policies\",status=\"401\"}"),
        2.0
    );
}

#[test]
fn a_quota_read_does_not_charge_and_a_reset_unblocks() {
    let dir = TempDir::new();
    let s = Sluice::start(&template("backend = \"memory\"", Some(&token_file(&dir))));
    assert_eq!(hit(&s, "k1"), 200);
    for _ in 0..3 {
        let q = call(&s, "GET", "/v1/quota/per_key?key=k1", "");
        assert_eq!(q.status, 200, "{}", q.body);
        assert!(q.body.contains("\"remaining\": 2"), "{}", q.body);
    }
    assert_eq!(hit(&s, "k1"), 200);
    assert_eq!(hit(&s, "k1"), 200);
    assert_eq!(hit(&s, "k1"), 429);
    assert_eq!(
        call(&s, "DELETE", "/v1/quota/per_key?key=k1", "").status,
        204
    );
    assert_eq!(hit(&s, "k1"), 200);
    // top: k1 is the heaviest, with its rejection.
    let top = call(&s, "GET", "/v1/top/per_key?n=5", "");
    assert!(
        top.body.contains("\"k1\"") && top.body.contains("\"rejected\": 1"),
        "{}",
        top.body
    );
}

/// Requests with `key` on every instance until each rejects; the admitted count per instance.
fn admitted(fleet: &[Sluice], key: &str) -> usize {
    let mut n = 0;
    for s in fleet {
        while hit(s, key) == 200 {
            n += 1;
            assert!(n < 100, "never rejected");
        }
    }
    n
}

#[test]
fn a_raised_limit_reaches_every_instance_and_a_reset_unblocks_the_fleet() {
    let redis = RedisServer::start();
    let limiter = format!(
        "backend = \"redis\"\nurl = \"{}\"\ntimeout = \"500ms\"",
        redis.url()
    );
    let dir = TempDir::new();
    let t = template(&limiter, Some(&token_file(&dir)));
    let fleet: Vec<Sluice> = (0..3).map(|_| Sluice::start(&t)).collect();
    assert_eq!(admitted(&fleet, "k"), 3);
    // Every instance has it in its deny cache now.
    for s in &fleet {
        assert_eq!(hit(s, "k"), 429);
    }
    let put = call(
        &fleet[0],
        "PUT",
        "/v1/overrides/per_key?key=k",
        "{\"limit\": 5}",
    );
    assert_eq!(put.status, 200, "{}", put.body);
    assert!(put.body.contains("\"limit\": 5"), "{}", put.body);
    std::thread::sleep(Duration::from_secs(1));
    // Exactly the difference gets through, whichever instance it asks.
    let through: usize = fleet
        .iter()
        .map(|s| (0..3).filter(|_| hit(s, "k") == 200).count())
        .sum();
    assert_eq!(through, 2);
    let listed = call(&fleet[2], "GET", "/v1/overrides/per_key", "");
    assert!(listed.body.contains("\"k\""), "{}", listed.body);
    assert_eq!(
        call(&fleet[1], "DELETE", "/v1/overrides/per_key?key=k", "").status,
        204
    );
    assert_eq!(
        call(&fleet[1], "DELETE", "/v1/quota/per_key?key=k", "").status,
        204
    );
    std::thread::sleep(Duration::from_secs(1));
    // Config numbers again (3), from a fresh count, on all three at once.
    assert_eq!(admitted(&fleet, "k"), 3);

    // An override with a ttl expires.
    let started = Instant::now();
    let put = call(
        &fleet[0],
        "PUT",
        "/v1/overrides/per_key?key=t",
        "{\"limit\": 1, \"ttl\": \"2s\"}",
    );
    assert_eq!(put.status, 200, "{}", put.body);
    std::thread::sleep(Duration::from_millis(500));
    let responses: Vec<Response> = (0..3)
        .map(|_| fleet[2].get_with("/r", &[("x-api-key", "t")]))
        .collect();
    assert_eq!(count_status(&responses, 200), 1);
    std::thread::sleep(
        Duration::from_secs(2).saturating_sub(started.elapsed()) + Duration::from_millis(300),
    );
    assert_eq!(
        hit(&fleet[2], "t"),
        200,
        "the override expired: limit 3 again"
    );
}

/// `sluice admin …` with the address and token from the config file.
fn cli(s: &Sluice, args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(common::SLUICE)
        .arg("admin")
        .args(args)
        .arg("--config")
        .arg(&s.config)
        .output()
        .expect("run sluice admin");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_admin_cli_reads_address_and_token_from_the_config() {
    let dir = TempDir::new();
    let s = Sluice::start(&template("backend = \"memory\"", Some(&token_file(&dir))));
    for _ in 0..4 {
        hit(&s, "k-cli");
    }
    let (ok, out, err) = cli(&s, &["quota", "per_key", "k-cli"]);
    assert!(ok, "{err}");
    let quota: serde_json::Value = serde_json::from_str(&out).expect("quota JSON");
    assert_eq!(
        (quota["limit"].as_u64(), quota["remaining"].as_u64()),
        (Some(3), Some(0)),
        "{out}"
    );

    let (ok, out, err) = cli(
        &s,
        &[
            "override", "per_key", "k-cli", "--limit", "5", "--ttl", "1h",
        ],
    );
    assert!(ok && out.contains("\"limit\": 5"), "{out}{err}");
    assert_eq!(
        count_status(&[hit_response(&s, "k-cli"), hit_response(&s, "k-cli")], 200),
        2
    );
    assert_eq!(hit(&s, "k-cli"), 429);

    let (ok, out, err) = cli(&s, &["top", "per_key", "-n", "5"]);
    assert!(ok && out.contains("k-cli"), "{out}{err}");

    let (ok, _, err) = cli(&s, &["reset", "per_key", "k-cli"]);
    assert!(ok, "{err}");
    assert_eq!(hit(&s, "k-cli"), 200);

    // A failed call exits 1 with the problem on stderr.
    let (ok, _, err) = cli(&s, &["quota", "nope", "k-cli"]);
    assert!(!ok && err.contains("404") && err.contains("nope"), "{err}");
}

fn hit_response(s: &Sluice, key: &str) -> Response {
    s.get_with("/r", &[("x-api-key", key)])
}

#[test]
fn a_slow_admin_call_does_not_delay_proxied_requests() {
    let redis = RedisServer::start();
    let dir = TempDir::new();
    let limiter = format!(
        "backend = \"redis\"\nurl = \"{}\"\ntimeout = \"2s\"",
        redis.url()
    );
    let mut config = template(&limiter, Some(&token_file(&dir)));
    config.push_str(
        "[[routes]]\nname = \"free\"\npath = \"/free\"\nrespond = { status = 200, body = \"free\\n\" }\n",
    );
    let s = Sluice::start(&config);
    assert_eq!(call(&s, "GET", "/v1/quota/per_key?key=a", "").status, 200);
    // Redis stops answering: admin calls wait on it, up to the 2 s timeout.
    redis.signal("STOP");
    std::thread::scope(|scope| {
        let admin: Vec<_> = (0..3)
            .map(|_| {
                scope.spawn(|| {
                    let started = Instant::now();
                    let status = call(&s, "GET", "/v1/quota/per_key?key=a", "").status;
                    (status, started.elapsed())
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(100));
        // Meanwhile the proxy answers at once.
        let mut slowest = Duration::ZERO;
        for _ in 0..20 {
            let started = Instant::now();
            assert_eq!(s.get("/free").status, 200);
            slowest = slowest.max(started.elapsed());
            std::thread::sleep(Duration::from_millis(50));
        }
        for handle in admin {
            let (status, took) = handle.join().expect("admin call");
            assert!(
                took >= Duration::from_secs(1),
                "the admin call was not slow: {status} in {took:?}"
            );
        }
        assert!(
            slowest < Duration::from_millis(300),
            "a proxied request took {slowest:?}"
        );
    });
    redis.signal("CONT");
}

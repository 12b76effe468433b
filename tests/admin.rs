//! The admin API (DESIGN §9.2) end to end: the real binary, and real redis-server for the
//! fleet.

mod common;

use std::time::{Duration, Instant};

use common::http::{self, Response};
use common::redis::{RedisCluster, RedisSentinel, RedisServer};
use common::relay::Relay;
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
    // What the config refuses is refused at run time too: 2^53 an hour puts limit × period
    // in ms past 2^53, where Redis's Lua numbers stop being exact.
    let inexact = call(
        &s,
        "PUT",
        "/v1/overrides/per_key?key=a",
        "{\"limit\": 9007199254740992}",
    );
    assert_problem(&inexact, 400, "must stay below 2^53");
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

/// Three instances sharing `limiter`: a reset unblocks all three at once, deny caches
/// included; a raised limit reaches every one within a second and lets exactly the
/// difference through; a deleted override restores the config; one with a ttl expires.
fn the_fleet_follows_runtime_changes(limiter: &str) {
    let dir = TempDir::new();
    let t = template(limiter, Some(&token_file(&dir)));
    let fleet: Vec<Sluice> = (0..3).map(|_| Sluice::start(&t)).collect();
    assert_eq!(admitted(&fleet, "k"), 3);
    // Every instance has it in its deny cache now.
    for s in &fleet {
        assert_eq!(hit(s, "k"), 429);
    }
    // A reset through one instance unblocks all three at once (their deny caches forget
    // k): the config's 3 again, from a fresh count, one on each instance.
    assert_eq!(
        call(&fleet[1], "DELETE", "/v1/quota/per_key?key=k", "").status,
        204
    );
    std::thread::sleep(Duration::from_millis(300));
    for s in &fleet {
        assert_eq!(hit(s, "k"), 200);
    }
    assert_eq!(admitted(&fleet, "k"), 0);

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
    // Deleted: the config's 3 apply to the count of 5 so far.
    assert_eq!(
        call(&fleet[1], "DELETE", "/v1/overrides/per_key?key=k", "").status,
        204
    );
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(admitted(&fleet, "k"), 0);
    let listed = call(&fleet[0], "GET", "/v1/overrides/per_key", "");
    assert_eq!(listed.body.trim(), "[]");

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

    // The longest ttl there is saturates: the override holds, it does not wrap into the past.
    let put = call(
        &fleet[0],
        "PUT",
        "/v1/overrides/per_key?key=u",
        "{\"limit\": 1, \"ttl\": \"213503982334d\"}",
    );
    assert_eq!(put.status, 200, "{}", put.body);
    std::thread::sleep(Duration::from_millis(500));
    let responses: Vec<Response> = (0..3)
        .map(|_| fleet[2].get_with("/r", &[("x-api-key", "u")]))
        .collect();
    assert_eq!(
        count_status(&responses, 200),
        1,
        "the override did not hold"
    );
}

#[test]
fn a_fleet_on_one_redis_follows_runtime_changes() {
    let redis = RedisServer::start();
    the_fleet_follows_runtime_changes(&format!(
        "backend = \"redis\"\nurl = \"{}\"\ntimeout = \"500ms\"",
        redis.url()
    ));
}

#[test]
fn a_fleet_on_a_redis_cluster_follows_runtime_changes() {
    let cluster = RedisCluster::start();
    let seeds: Vec<String> = cluster.seeds().iter().map(|s| format!("\"{s}\"")).collect();
    the_fleet_follows_runtime_changes(&format!(
        "backend = \"redis\"\ncluster = [{}]\ntimeout = \"500ms\"",
        seeds.join(", ")
    ));
}

#[test]
fn a_fleet_behind_sentinel_follows_runtime_changes() {
    let master = RedisServer::start();
    let sentinel = RedisSentinel::start(&master, "admin-fleet");
    the_fleet_follows_runtime_changes(&format!(
        "backend = \"redis\"\nsentinel = {{ master = \"admin-fleet\", nodes = [\"{}\"] }}\ntimeout = \"500ms\"",
        sentinel.url()
    ));
}

/// Polls `s`'s override list of `per_key` until it satisfies `cond` (within `within`).
fn overrides_become(s: &Sluice, within: Duration, cond: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + within;
    loop {
        let listed = call(s, "GET", "/v1/overrides/per_key", "").body;
        if cond(&listed) || Instant::now() > deadline {
            return listed;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn an_instance_that_lost_redis_or_restarted_converges_to_the_fleet() {
    let redis = RedisServer::start();
    let dir = TempDir::new();
    let limiter = |url: String| {
        template(
            &format!("backend = \"redis\"\nurl = \"{url}\"\ntimeout = \"500ms\""),
            Some(&token_file(&dir)),
        )
    };
    let direct = Sluice::start(&limiter(redis.url()));
    let relay = Relay::start(format!("127.0.0.1:{}", redis.port()).parse().expect("addr"));
    let cut_off = Sluice::start(&limiter(format!("redis://{}", relay.addr)));
    assert_eq!(admitted(std::slice::from_ref(&cut_off), "k"), 3);

    // `cut_off` loses Redis; meanwhile the fleet raises k's limit and sets another override,
    // announced while it cannot hear.
    relay.cut();
    std::thread::sleep(Duration::from_millis(300));
    for (key, limit) in [("k", 5), ("other", 7)] {
        let put = call(
            &direct,
            "PUT",
            &format!("/v1/overrides/per_key?key={key}"),
            &format!("{{\"limit\": {limit}}}"),
        );
        assert_eq!(put.status, 200, "{}", put.body);
    }
    std::thread::sleep(Duration::from_secs(1));
    let unheard = call(&cut_off, "GET", "/v1/overrides/per_key", "").body;
    assert!(!unheard.contains("other"), "heard through a cut: {unheard}");

    // Back on Redis: it re-reads the overrides in full (its resubscription backs off up to 5 s).
    relay.restore();
    let listed = overrides_become(&cut_off, Duration::from_secs(10), |l| {
        l.contains("\"k\"") && l.contains("\"other\"")
    });
    assert!(
        listed.contains("\"k\"") && listed.contains("\"other\""),
        "never converged: {listed}"
    );
    // And it acts on them: exactly the difference for k.
    let through = (0..4).filter(|_| hit(&cut_off, "k") == 200).count();
    assert_eq!(through, 2);

    // A new instance (a restart) starts with the fleet's overrides.
    let restarted = Sluice::start(&limiter(redis.url()));
    let listed = overrides_become(&restarted, Duration::from_secs(2), |l| {
        l.contains("\"other\"")
    });
    assert!(listed.contains("\"limit\": 7"), "{listed}");
}

/// Every key `key-<r>` for r in 1..=10,000 once, plus 2000/r more (a Zipf-like load): the
/// five heaviest are key-1..key-5 with 2001, 1001, 667, 501 and 401 requests.
fn zipf_requests() -> Vec<String> {
    let mut keys = Vec::new();
    for r in 1..=10_000usize {
        keys.extend(std::iter::repeat_n(format!("key-{r}"), 1 + 2000 / r));
    }
    // A fixed shuffle (an LCG), so heavy and light keys interleave as in real traffic.
    let mut x: u64 = 42;
    for i in (1..keys.len()).rev() {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        keys.swap(i, (x >> 33) as usize % (i + 1));
    }
    keys
}

#[test]
fn top_lists_the_heaviest_of_ten_thousand_keys_in_bounded_memory() {
    let dir = TempDir::new();
    let config = format!(
        "[server]\nlisten = [\"{{listen}}\"]\naccess_log = \"off\"\n[admin]\nlisten = \"{{admin}}\"\ntoken_file = \"{}\"\ntop_keys = 500\n[limiter]\nbackend = \"memory\"\n{}\n[[routes]]\nname = \"r\"\npath = \"/r\"\nrespond = {{ status = 200, body = \"ok\\n\" }}\npolicies = [\"per_key\"]\n",
        token_file(&dir),
        policy("per_key", "fixed_window", 1_000_000, "1h", "\"header:x-api-key\"", "")
    );
    let s = Sluice::start(&config);
    let keys = zipf_requests();
    let total = keys.len();
    // Four keep-alive connections, 100 pipelined requests at a time.
    std::thread::scope(|scope| {
        for part in keys.chunks(total.div_ceil(4)) {
            scope.spawn(|| pipeline(&s, part));
        }
    });
    let top = call(&s, "GET", "/v1/top/per_key?n=10", "");
    assert_eq!(top.status, 200, "{}", top.body);
    let list: serde_json::Value = serde_json::from_str(&top.body).expect("top JSON");
    let named: Vec<&str> = list
        .as_array()
        .expect("a list")
        .iter()
        .map(|e| e["key"][0].as_str().expect("a key"))
        .collect();
    for r in 1..=5 {
        assert!(
            named.contains(&format!("key-{r}").as_str()),
            "key-{r} not in {named:?}"
        );
    }
    // Each estimate is within its reported error of the truth, and the error within the
    // sketch's bound: total requests / slots.
    for e in list.as_array().expect("a list") {
        let r: usize = e["key"][0].as_str().expect("key")[4..]
            .parse()
            .expect("rank");
        let truth = (1 + 2000 / r) as u64;
        let (requests, error) = (
            e["requests"].as_u64().expect("n"),
            e["error"].as_u64().expect("e"),
        );
        assert!(
            requests >= truth && requests - error <= truth,
            "{e} (truth {truth})"
        );
        assert!(error <= (total / 500) as u64, "{e}");
    }
}

/// Sends `keys` as requests on one connection, 100 pipelined at a time; all must pass.
fn pipeline(s: &Sluice, keys: &[String]) {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(s.addr).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    for batch in keys.chunks(100) {
        let mut raw = String::new();
        for key in batch {
            raw.push_str(&format!(
                "GET /r HTTP/1.1\r\nHost: t\r\nx-api-key: {key}\r\n\r\n"
            ));
        }
        conn.write_all(raw.as_bytes()).expect("send");
        let (mut seen, mut buf, mut answers) = (0, [0u8; 65536], Vec::new());
        while seen < batch.len() {
            let n = conn.read(&mut buf).expect("answers");
            assert!(n > 0, "closed after {seen} of {} answers", batch.len());
            answers.extend_from_slice(&buf[..n]);
            seen = count(&answers, b"HTTP/1.1 ");
        }
        assert_eq!(count(&answers, b"HTTP/1.1 200"), batch.len());
    }
}

fn count(haystack: &[u8], needle: &[u8]) -> usize {
    haystack
        .windows(needle.len())
        .filter(|w| w == &needle)
        .count()
}

#[test]
fn the_admin_cli_reads_address_and_token_from_the_config() {
    let dir = TempDir::new();
    let s = Sluice::start(&template("backend = \"memory\"", Some(&token_file(&dir))));
    for _ in 0..4 {
        hit(&s, "k-cli");
    }
    let (ok, out, err) = s.admin_cli(&["quota", "per_key", "k-cli"]);
    assert!(ok, "{err}");
    let quota: serde_json::Value = serde_json::from_str(&out).expect("quota JSON");
    assert_eq!(
        (quota["limit"].as_u64(), quota["remaining"].as_u64()),
        (Some(3), Some(0)),
        "{out}"
    );

    let (ok, out, err) = s.admin_cli(&[
        "override", "per_key", "k-cli", "--limit", "5", "--ttl", "1h",
    ]);
    assert!(ok && out.contains("\"limit\": 5"), "{out}{err}");
    assert_eq!(
        count_status(&[hit_response(&s, "k-cli"), hit_response(&s, "k-cli")], 200),
        2
    );
    assert_eq!(hit(&s, "k-cli"), 429);

    let (ok, out, err) = s.admin_cli(&["overrides", "per_key"]);
    assert!(
        ok && out.contains("k-cli") && out.contains("\"limit\": 5"),
        "{out}{err}"
    );
    let (ok, out, err) = s.admin_cli(&["policies"]);
    assert!(ok && out.contains("per_key"), "{out}{err}");

    let (ok, out, err) = s.admin_cli(&["top", "per_key", "-n", "5"]);
    assert!(ok && out.contains("k-cli"), "{out}{err}");

    let (ok, _, err) = s.admin_cli(&["override", "per_key", "k-cli", "--delete"]);
    assert!(ok, "{err}");
    let (ok, out, err) = s.admin_cli(&["overrides", "per_key"]);
    assert!(ok && out.trim() == "[]", "{out}{err}");

    let (ok, _, err) = s.admin_cli(&["reset", "per_key", "k-cli"]);
    assert!(ok, "{err}");
    assert_eq!(hit(&s, "k-cli"), 200);

    // A failed call exits 1 with the problem on stderr.
    let (ok, _, err) = s.admin_cli(&["quota", "nope", "k-cli"]);
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

/// The algorithms whose state counts units across requests (concurrency holds a slot only
/// while a request is in flight).
const COUNTING: [&str; 6] = [
    "fixed_window",
    "sliding_window",
    "sliding_log",
    "token_bucket",
    "gcra",
    "leaky_bucket",
];

/// One policy and route `/ALGORITHM` per counting algorithm: 3 a day, keyed on x-api-key,
/// each request costing 3 (one request uses the whole quota; a leaky_bucket's queue would
/// hold a second request for 8 hours). A day, so no bucket drains a unit during the test.
fn units_template(limiter: &str, token_file: &str) -> String {
    let policies: String = COUNTING
        .iter()
        .map(|a| policy(a, a, 3, "1d", "\"header:x-api-key\"", "cost = 3"))
        .collect();
    let routes: String = COUNTING
        .iter()
        .map(|a| format!("[[routes]]\nname = \"{a}\"\npath = \"/{a}\"\nrespond = {{ status = 200, body = \"ok\\n\" }}\npolicies = [\"{a}\"]\n"))
        .collect();
    format!("[server]\nlisten = [\"{{listen}}\"]\naccess_log = \"off\"\n[admin]\nlisten = \"{{admin}}\"\ntoken_file = \"{token_file}\"\n[limiter]\n{limiter}\n{policies}{routes}")
}

fn remaining(s: &Sluice, algorithm: &str, key: &str) -> u64 {
    let q = call(s, "GET", &format!("/v1/quota/{algorithm}?key={key}"), "");
    assert_eq!(q.status, 200, "{}", q.body);
    let at = q.body.find("\"remaining\": ").expect("remaining") + 13;
    let digits: String = q.body[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().expect("a number")
}

fn set_limit(s: &Sluice, algorithm: &str, key: &str, limit: u64) {
    let body = format!("{{\"limit\": {limit}}}");
    let put = call(
        s,
        "PUT",
        &format!("/v1/overrides/{algorithm}?key={key}"),
        &body,
    );
    assert_eq!(put.status, 200, "{}", put.body);
}

/// An override changes the limit, not the units used (DESIGN §9.1, #43 item 2): after 3 of
/// 3, a limit of 5,000 (burst 5,000) leaves 4,997 on every algorithm; a limit of 2 leaves
/// none, and 4 leaves 1. Charged through the first instance, changed and read through the
/// last (the same one on memory).
fn overrides_keep_the_units_used(fleet: &[Sluice]) {
    let (first, last) = (&fleet[0], &fleet[fleet.len() - 1]);
    for algorithm in COUNTING {
        for key in ["up", "down"] {
            let r = first.get_with(&format!("/{algorithm}"), &[("x-api-key", key)]);
            assert_eq!(r.status, 200, "{algorithm}");
        }
        set_limit(last, algorithm, "up", 5_000);
        set_limit(last, algorithm, "down", 2);
    }
    std::thread::sleep(Duration::from_secs(1));
    for algorithm in COUNTING {
        // A leaky_bucket counts the requests that could still join its queue (one more).
        let queue = u64::from(algorithm == "leaky_bucket");
        assert_eq!(
            remaining(last, algorithm, "up"),
            4_997 + queue,
            "{algorithm}"
        );
        assert_eq!(
            remaining(first, algorithm, "down"),
            0,
            "{algorithm}: 3 used of 2"
        );
        if algorithm != "leaky_bucket" {
            let path = format!("/{algorithm}");
            assert_eq!(first.get_with(&path, &[("x-api-key", "up")]).status, 200);
            assert_eq!(remaining(first, algorithm, "up"), 4_994, "{algorithm}");
        }
        set_limit(first, algorithm, "down", 4);
    }
    std::thread::sleep(Duration::from_secs(1));
    for algorithm in COUNTING {
        // A leaky_bucket's queue still takes a request of cost 3 (its wait fits in the
        // burst), and the quota counts that request's cost as left.
        let left = if algorithm == "leaky_bucket" { 3 } else { 1 };
        assert_eq!(
            remaining(last, algorithm, "down"),
            left,
            "{algorithm}: 3 used of 4"
        );
    }
}

#[test]
fn an_override_changes_the_limit_not_the_units_used_in_memory() {
    let dir = TempDir::new();
    let t = units_template("backend = \"memory\"", &token_file(&dir));
    overrides_keep_the_units_used(&[Sluice::start(&t)]);
}

#[test]
fn an_override_changes_the_limit_not_the_units_used_across_a_fleet() {
    let redis = RedisServer::start();
    let dir = TempDir::new();
    let limiter = format!(
        "backend = \"redis\"\nurl = \"{}\"\ntimeout = \"500ms\"",
        redis.url()
    );
    let t = units_template(&limiter, &token_file(&dir));
    let fleet: Vec<Sluice> = (0..2).map(|_| Sluice::start(&t)).collect();
    overrides_keep_the_units_used(&fleet);
}

//! The Redis backend end to end: real `redis-server` processes and several real sluice
//! processes sharing them; faults, deny cache, clock skew and Sentinel failover.

mod common;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use common::http;
use common::redis::{RedisSentinel, RedisServer};
use common::{burst, config, count_status, libfaketime, one_route_per_algorithm, policy, Sluice};

fn redis_limiter(redis: &RedisServer, extra: &str) -> String {
    format!("backend = \"redis\"\nurl = \"{}\"\n{extra}", redis.url())
}

const FLEET: [&str; 4] = ["fixed_window", "sliding_log", "token_bucket", "gcra"];

#[test]
fn three_instances_sharing_redis_admit_exactly_the_limit() {
    let redis = RedisServer::start();
    // A generous timeout and fail-closed: a slow answer must not turn into an admission.
    let limiter = redis_limiter(&redis, "timeout = \"2s\"\non_error = \"deny\"");
    let template = one_route_per_algorithm(&limiter, "threads = 2", &FLEET, 50, "1h");
    let fleet: Vec<Sluice> = (0..3).map(|_| Sluice::start(&template)).collect();
    for a in FLEET {
        let barrier = Arc::new(Barrier::new(300));
        let handles: Vec<_> = (0..300)
            .map(|i| {
                let (addr, barrier, path) = (fleet[i % 3].addr, barrier.clone(), format!("/{a}"));
                std::thread::spawn(move || {
                    barrier.wait();
                    http::get(addr, &path, &[])
                })
            })
            .collect();
        let responses: Vec<http::Response> = handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect();
        assert_eq!(count_status(&responses, 200), 50, "{a}");
        assert_eq!(count_status(&responses, 429), 250, "{a}");
    }
}

/// Requests that arrive while a decision is in flight share one script call: 200 requests
/// at once for one key of a limit-50 policy, held up by a paused Redis so that they queue
/// behind the first call, are decided in far fewer calls than requests, each all or
/// nothing on its own: exactly 50 pass.
#[test]
fn concurrent_requests_share_script_calls_and_admit_exactly_the_limit() {
    let redis = RedisServer::start();
    for algorithm in ["gcra", "fixed_window"] {
        redis.cli(&["FLUSHALL"]);
        let s = Sluice::start(&config(
            &redis_limiter(
                &redis,
                "timeout = \"3s\"\non_error = \"deny\"\ndeny_cache = 0",
            ),
            "threads = 2",
            &policy("p", algorithm, 50, "1h", "", ""),
            &[("a", "\"p\"")],
        ));
        redis.cli(&["CONFIG", "RESETSTAT"]);
        redis.cli(&["CLIENT", "PAUSE", "500", "ALL"]);
        let responses = burst(s.addr, 200, "/a", &[]);
        assert_eq!(count_status(&responses, 200), 50, "{algorithm}");
        assert_eq!(count_status(&responses, 429), 150, "{algorithm}");
        let calls = redis.scripts_run();
        assert!(
            (1..100).contains(&calls),
            "{algorithm}: {calls} script calls for 200 requests: {}",
            script_calls(&redis)
        );
        assert_eq!(
            s.metric(r#"sluice_decisions_total{decision="allowed",policy="p",route="a"}"#),
            50.0
        );
    }
}

/// A batch reply too long to pack in one piece (the script packs at most 4000 integers at
/// a time): 200 requests at once on a route of 60 policies, queued behind a paused Redis on
/// one lane, so that fewer than 12 calls decide them and one holds at least 17 requests
/// (17 × 60 checks × 4 integers > 4000). Every request reads its own verdicts: exactly 50
/// pass, and every policy counts them.
#[test]
fn a_batch_reply_of_many_pieces_gives_every_request_its_verdicts() {
    let redis = RedisServer::start();
    let names: Vec<String> = (0..60).map(|i| format!("p{i}")).collect();
    let policies: String = names
        .iter()
        .map(|name| policy(name, "fixed_window", 50, "1h", "", ""))
        .collect();
    let route: Vec<String> = names.iter().map(|name| format!("\"{name}\"")).collect();
    let s = Sluice::start(&config(
        &redis_limiter(
            &redis,
            "timeout = \"3s\"\non_error = \"deny\"\ndeny_cache = 0",
        ),
        "threads = 1",
        &policies,
        &[("a", &route.join(", "))],
    ));
    redis.cli(&["CONFIG", "RESETSTAT"]);
    redis.cli(&["CLIENT", "PAUSE", "500", "ALL"]);
    let responses = burst(s.addr, 200, "/a", &[]);
    assert_eq!(count_status(&responses, 200), 50);
    assert_eq!(count_status(&responses, 429), 150);
    let calls = redis.scripts_run();
    assert!(
        (1..12).contains(&calls),
        "{calls} script calls for 200 requests: {}",
        script_calls(&redis)
    );
    for name in ["p0", "p59"] {
        assert_eq!(
            s.metric(&format!(
                r#"sluice_decisions_total{{decision="allowed",policy="{name}",route="a"}}"#
            )),
            50.0
        );
    }
}

#[test]
fn the_deny_cache_answers_over_limit_keys_without_redis() {
    let redis = RedisServer::start();
    for (cache, expected_hits, expected_calls) in [(1000, 7.0, 3), (0, 0.0, 10)] {
        redis.cli(&["FLUSHALL"]);
        redis.cli(&["CONFIG", "RESETSTAT"]);
        let s = Sluice::start(&config(
            &redis_limiter(&redis, &format!("deny_cache = {cache}\ntimeout = \"1s\"")),
            "threads = 2",
            &policy("p", "gcra", 2, "1m", "", ""),
            &[("a", "\"p\"")],
        ));
        let statuses: Vec<u16> = (0..10).map(|_| s.get("/a").status).collect();
        assert_eq!(
            statuses,
            [200, 200, 429, 429, 429, 429, 429, 429, 429, 429],
            "deny_cache = {cache}"
        );
        assert_eq!(
            s.metric(r#"sluice_deny_cache_hits_total{policy="p"}"#),
            expected_hits
        );
        assert_eq!(
            redis.scripts_run(),
            expected_calls,
            "script calls with deny_cache = {cache}: {}",
            script_calls(&redis)
        );
    }
}

/// Sends requests for about `span`, returning (status, latency) of each.
fn traffic(s: &Sluice, path: &str, n: usize) -> Vec<(u16, Duration)> {
    (0..n)
        .map(|_| {
            let t = Instant::now();
            let status = s.get(path).status;
            (status, t.elapsed())
        })
        .collect()
}

#[test]
fn redis_down_with_on_error_allow_answers_quickly_and_counts() {
    let mut redis = RedisServer::start();
    let s = Sluice::start(&config(
        &redis_limiter(&redis, "timeout = \"50ms\"\non_error = \"allow\""),
        "threads = 2",
        &policy("p", "gcra", 1000, "1m", "", ""),
        &[("a", "\"p\"")],
    ));
    assert_eq!(s.get("/a").status, 200);
    assert_eq!(http::get(s.admin, "/readyz", &[]).status, 200);
    redis.kill();
    let results = traffic(&s, "/a", 30);
    assert!(
        results.iter().all(|(status, _)| *status == 200),
        "{results:?}"
    );
    // Every answer within the timeout plus slack; once the breaker is open, at once.
    assert!(
        results.iter().all(|(_, d)| *d < Duration::from_millis(250)),
        "{results:?}"
    );
    let tail: Vec<Duration> = results[10..].iter().map(|(_, d)| *d).collect();
    assert!(
        tail.iter().all(|d| *d < Duration::from_millis(40)),
        "breaker open: {tail:?}"
    );
    assert_eq!(
        s.metric(r#"sluice_decisions_total{decision="error_allowed",policy="p",route="a"}"#),
        30.0
    );
    assert_eq!(s.metric(r#"sluice_backend_up{backend="redis"}"#), 0.0);
    assert_eq!(http::get(s.admin, "/readyz", &[]).status, 503);

    // Back, empty and without scripts: limiting resumes within seconds.
    redis.restart();
    assert!(
        s.wait_for(Duration::from_secs(10), || {
            s.get("/a").status == 200 && s.metric(r#"sluice_backend_up{backend="redis"}"#) == 1.0
        }),
        "limiting did not resume"
    );
    assert!(
        redis.cli(&["KEYS", "sluice:*"]).contains("sluice:"),
        "state is in Redis again"
    );
    assert_eq!(http::get(s.admin, "/readyz", &[]).status, 200);
}

#[test]
fn redis_down_with_on_error_deny_answers_503_problem() {
    let mut redis = RedisServer::start();
    let s = Sluice::start(&config(
        &redis_limiter(&redis, "timeout = \"50ms\"\non_error = \"deny\""),
        "threads = 2",
        &policy("p", "gcra", 1000, "1m", "", ""),
        &[("a", "\"p\"")],
    ));
    assert_eq!(s.get("/a").status, 200);
    redis.kill();
    for _ in 0..5 {
        let r = s.get("/a");
        assert_eq!(r.status, 503);
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
        assert!(r.body.contains("\"status\":503"), "{}", r.body);
    }
    assert_eq!(
        s.metric(r#"sluice_decisions_total{decision="error_denied",policy="p",route="a"}"#),
        5.0
    );
}

#[test]
fn redis_down_with_on_error_local_limits_in_memory() {
    let mut redis = RedisServer::start();
    let s = Sluice::start(&config(
        &redis_limiter(&redis, "timeout = \"50ms\"\non_error = \"local\""),
        "threads = 2",
        &policy("p", "fixed_window", 3, "1h", "", ""),
        &[("a", "\"p\"")],
    ));
    redis.kill();
    let statuses: Vec<u16> = (0..5).map(|_| s.get("/a").status).collect();
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
}

#[test]
fn a_policy_on_error_overrides_the_limiter_default() {
    let mut redis = RedisServer::start();
    let policies = policy("open", "gcra", 1000, "1m", "", "")
        + &policy("closed", "gcra", 1000, "1m", "", "on_error = \"deny\"");
    let s = Sluice::start(&config(
        &redis_limiter(&redis, "timeout = \"50ms\"\non_error = \"allow\""),
        "threads = 2",
        &policies,
        &[("o", "\"open\""), ("c", "\"closed\"")],
    ));
    redis.kill();
    assert_eq!(s.get("/o").status, 200);
    assert_eq!(s.get("/c").status, 503);
}

const SKEW: &str = "+2h";

#[test]
fn with_clock_redis_a_skewed_proxy_clock_changes_no_decision() {
    let redis = RedisServer::start();
    let libfaketime = libfaketime();
    let run = |clock: &str| -> Vec<u16> {
        redis.cli(&["FLUSHALL"]);
        let template = config(
            &redis_limiter(
                &redis,
                &format!("clock = \"{clock}\"\ntimeout = \"1s\"\ndeny_cache = 0"),
            ),
            "threads = 2",
            &policy("p", "fixed_window", 5, "1h", "", ""),
            &[("a", "\"p\"")],
        );
        let honest = Sluice::start(&template);
        // The same binary, its wall clock two hours ahead (monotonic time left alone).
        let env = [
            ("LD_PRELOAD", libfaketime.as_str()),
            ("FAKETIME", SKEW),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
        ];
        let skewed = Sluice::start_with_env(&template, &env);
        let mut statuses: Vec<u16> = (0..3).map(|_| honest.get("/a").status).collect();
        statuses.extend((0..3).map(|_| skewed.get("/a").status));
        statuses
    };
    assert_eq!(
        run("redis"),
        [200, 200, 200, 200, 200, 429],
        "one shared window"
    );
    // The control: with clock = "local" the skewed instance counts in another window.
    assert_eq!(
        run("local"),
        [200, 200, 200, 200, 200, 200],
        "faketime must skew the local clock"
    );
}

#[test]
fn every_algorithm_works_end_to_end_on_redis_and_leaves_no_key_without_ttl() {
    let redis = RedisServer::start();
    let algorithms = [
        ("fixed_window", ""),
        ("sliding_window", ""),
        ("sliding_log", ""),
        ("token_bucket", ""),
        ("gcra", ""),
        ("leaky_bucket", "burst = 1"),
    ];
    let policies: String = algorithms
        .iter()
        .map(|(a, extra)| policy(a, a, 2, "10s", "", extra))
        .collect();
    let mut routes: Vec<(String, String)> = algorithms
        .iter()
        .map(|(a, _)| (a.to_string(), format!("\"{a}\"")))
        .collect();
    routes.push((
        "all".into(),
        algorithms
            .iter()
            .map(|(a, _)| format!("\"{a}\""))
            .collect::<Vec<_>>()
            .join(", "),
    ));
    let routes: Vec<(&str, &str)> = routes
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    let mut template = config(
        &redis_limiter(&redis, "timeout = \"1s\""),
        "threads = 2",
        &policies,
        &routes,
    );
    template.push_str("[policies.conc]\nalgorithm = \"concurrency\"\nlimit = 2\nkey = [\"client_ip\"]\nlease = \"5s\"\n");
    template.push_str("[[routes]]\nname = \"conc\"\npath = \"/conc\"\nrespond = { status = 200 }\npolicies = [\"conc\"]\n");
    let s = Sluice::start(&template);
    for (a, _) in &algorithms[..5] {
        let statuses: Vec<u16> = (0..3).map(|_| s.get(&format!("/{a}")).status).collect();
        assert_eq!(statuses, [200, 200, 429], "{a}");
    }
    // leaky_bucket: one now, one queued (waits 5 s), the third rejected.
    assert_eq!(s.get("/leaky_bucket").status, 200);
    // A slot is freed just after its response (the next request, on another worker's
    // connection to Redis, may overtake the release): each request gets one within 2 s.
    for _ in 0..3 {
        assert!(
            s.wait_for(Duration::from_secs(2), || s.get("/conc").status == 200),
            "slots are released after each response"
        );
    }
    for _ in 0..3 {
        s.get("/all");
    }
    let keys = redis.cli(&["--scan", "--pattern", "sluice:*"]);
    let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
    assert!(keys.len() >= 7, "{keys:?}");
    for key in keys {
        let ttl: i64 = redis.cli(&["PTTL", key]).parse().unwrap_or(-3);
        assert!(
            ttl > 0 && ttl <= 10_000 + 1_000 + 5_000 * 2,
            "{key} has PTTL {ttl}"
        );
    }
}

#[test]
fn a_fleet_on_a_redis_cluster_shares_limits_across_slots() {
    let cluster = common::redis::RedisCluster::start();
    let seeds: Vec<String> = cluster.seeds().iter().map(|s| format!("\"{s}\"")).collect();
    let limiter = format!(
        "backend = \"redis\"\ncluster = [{}]\ntimeout = \"2s\"\non_error = \"deny\"",
        seeds.join(", ")
    );
    // Two policies on the client key share its slot; the global one lands elsewhere.
    let policies = "[policies.ip_fast]\nalgorithm = \"gcra\"\nlimit = 4\nperiod = \"1h\"\nkey = [\"header:x-client\"]\n\
                    [policies.ip_slow]\nalgorithm = \"fixed_window\"\nlimit = 100\nperiod = \"1h\"\nkey = [\"header:x-client\"]\n\
                    [policies.global]\nalgorithm = \"sliding_log\"\nlimit = 6\nperiod = \"1h\"\nkey = []\n";
    let template = config(
        &limiter,
        "threads = 2",
        policies,
        &[("a", "\"ip_fast\", \"ip_slow\", \"global\"")],
    );
    let a = Sluice::start(&template);
    let b = Sluice::start(&template);
    let client = |s: &Sluice, c: &str| s.get_with("/a", &[("X-Client", c)]).status;
    // c1 spends its 4 across both instances; its denials charge neither other policy.
    let c1: Vec<u16> = (0..6)
        .map(|i| client(if i % 2 == 0 { &a } else { &b }, "c1"))
        .collect();
    assert_eq!(c1, [200, 200, 200, 200, 429, 429]);
    // The global limit (6) still has exactly 2 left.
    let c2: Vec<u16> = (0..3)
        .map(|i| client(if i % 2 == 0 { &b } else { &a }, &format!("c2-{i}")))
        .collect();
    assert_eq!(c2, [200, 200, 429]);
    let keys = cluster
        .nodes()
        .iter()
        .map(|n| n.cli(&["DBSIZE"]).parse::<u64>().unwrap_or(0))
        .filter(|n| *n > 0)
        .count();
    assert!(keys >= 2, "state is spread over several nodes");
}

#[test]
fn rediss_verifies_the_server_against_the_trusted_cas() {
    let dir = common::TempDir::new();
    common::tls_files(&dir.0, "IP:127.0.0.1");
    let tls_port = common::free_port().to_string();
    let file = |name: &str| dir.0.join(name).display().to_string();
    let (cert, key, ca) = (file("srv.pem"), file("srv.key"), file("ca.pem"));
    let redis = RedisServer::start_with(&[
        "--tls-port",
        &tls_port,
        "--tls-cert-file",
        &cert,
        "--tls-key-file",
        &key,
        "--tls-ca-cert-file",
        &ca,
        "--tls-auth-clients",
        "no",
    ]);
    let limiter = format!("backend = \"redis\"\nurl = \"rediss://127.0.0.1:{tls_port}/0\"\ntimeout = \"1s\"\non_error = \"deny\"");
    let template = config(
        &limiter,
        "",
        &policy("p", "gcra", 2, "1m", "", ""),
        &[("a", "\"p\"")],
    );
    // The private CA is trusted the way operators add one: the system store or SSL_CERT_FILE.
    let s = Sluice::start_with_env(&template, &[("SSL_CERT_FILE", ca.as_str())]);
    let statuses: Vec<u16> = (0..3).map(|_| s.get("/a").status).collect();
    assert_eq!(statuses, [200, 200, 429]);
    assert!(
        redis.cli(&["KEYS", "sluice:*"]).contains(":p:gcra"),
        "state went over TLS"
    );
    // Without the CA the server is not trusted: fail closed, never unverified.
    let untrusted = Sluice::start_with_env(&template, &[("SSL_CERT_FILE", "/nonexistent")]);
    assert_eq!(untrusted.get("/a").status, 503);
}

/// A master, its replica and two sentinels watching them as `name`.
struct SentinelSetup {
    master: RedisServer,
    replica: RedisServer,
    sentinels: [RedisSentinel; 2],
    /// A sentinel address where nothing listens.
    dead: String,
}

impl SentinelSetup {
    fn start(name: &str) -> SentinelSetup {
        let master = RedisServer::start();
        let replica = RedisServer::start_replica_of(&master);
        let sentinels = [
            RedisSentinel::start(&master, name),
            RedisSentinel::start(&master, name),
        ];
        for sentinel in &sentinels {
            sentinel.wait_for_replica(name, &replica);
        }
        SentinelSetup {
            master,
            replica,
            sentinels,
            dead: format!("redis://127.0.0.1:{}", common::free_port()),
        }
    }

    /// `[limiter]` lines for sluice on these sentinels, after a node where nothing listens.
    fn limiter(&self, name: &str, extra: &str) -> String {
        format!(
            "backend = \"redis\"\nsentinel = {{ master = \"{name}\", nodes = [\"{}\", \"{}\", \"{}\"] }}\n{extra}",
            self.dead,
            self.sentinels[0].url(),
            self.sentinels[1].url()
        )
    }
}

/// The script calls a Redis has answered since its stats were last reset.
fn script_calls(redis: &RedisServer) -> String {
    redis
        .cli(&["INFO", "commandstats"])
        .lines()
        .filter(|l| {
            l.starts_with("cmdstat_fcall:")
                || l.starts_with("cmdstat_evalsha:")
                || l.starts_with("cmdstat_eval:")
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn a_planned_sentinel_failover_moves_sluice_to_the_new_master_within_a_second() {
    let name = "sluice-ha";
    let ha = SentinelSetup::start(name);
    let policies = policy("p", "fixed_window", 3, "1h", "\"header:x-client\"", "");
    let s = Sluice::start(&config(
        &ha.limiter(
            name,
            "timeout = \"300ms\"\non_error = \"deny\"\ndeny_cache = 0",
        ),
        "threads = 2",
        &policies,
        &[("a", "\"p\"")],
    ));
    let client = |c: &str| -> Vec<u16> {
        (0..4)
            .map(|_| s.get_with("/a", &[("X-Client", c)]).status)
            .collect()
    };
    assert_eq!(client("before"), [200, 200, 200, 429]);
    assert_eq!(ha.master.cli(&["DBSIZE"]), "1", "state is on the master");

    // Requests keep flowing through the failover; none may wait past the limiter timeout.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let during = {
        let (addr, stop) = (s.addr, stop.clone());
        std::thread::spawn(move || {
            let mut slowest = Duration::ZERO;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let t = Instant::now();
                http::get(addr, "/a", &[("X-Client", "during")]);
                slowest = slowest.max(t.elapsed());
                std::thread::sleep(Duration::from_millis(5));
            }
            slowest
        })
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while ha.sentinels[0].cli(&["SENTINEL", "FAILOVER", name]) != "OK" {
        assert!(Instant::now() < deadline, "SENTINEL FAILOVER was refused");
        std::thread::sleep(Duration::from_millis(100));
    }
    while ha.sentinels[0].master_port(name) != Some(ha.replica.port()) {
        assert!(Instant::now() < deadline, "the failover did not complete");
        std::thread::sleep(Duration::from_millis(5));
    }
    let switched = Instant::now();
    assert_eq!(
        ha.master.cli(&["ROLE"]).lines().next(),
        Some("master"),
        "the old master still takes writes until Sentinel demotes it, seconds later"
    );

    std::thread::sleep(Duration::from_secs(1).saturating_sub(switched.elapsed()));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let slowest = during.join().expect("traffic thread");
    assert!(
        slowest < Duration::from_millis(300 + 400),
        "a request waited {slowest:?} during the switch"
    );
    ha.master.cli(&["CONFIG", "RESETSTAT"]);
    ha.replica.cli(&["CONFIG", "RESETSTAT"]);
    // One second after the switch, every decision is made on the new master.
    assert_eq!(client("after"), [200, 200, 200, 429]);
    assert_eq!(
        script_calls(&ha.master),
        "",
        "the old master still receives sluice's writes"
    );
    assert!(
        script_calls(&ha.replica).contains("calls=4"),
        "the new master decides: {}",
        script_calls(&ha.replica)
    );
    // The count carried over: "before" is still over its limit on the new master.
    assert_eq!(client("before"), [429, 429, 429, 429]);
    assert!(
        s.stderr().contains("sentinel announced a new master"),
        "{}",
        s.stderr()
    );
}

#[test]
fn sentinel_subscriptions_come_back_and_end_with_their_backend() {
    let name = "sluice-subs";
    let ha = SentinelSetup::start(name);
    let template = |timeout: &str| {
        config(
            &ha.limiter(name, &format!("timeout = \"{timeout}\"")),
            "threads = 2",
            &policy("p", "gcra", 100, "1m", "", ""),
            &[("a", "\"p\"")],
        )
    };
    let s = Sluice::start(&template("1s"));
    // One subscription on each sentinel that answers.
    let one_each = || {
        s.wait_for(Duration::from_secs(10), || {
            ha.sentinels.iter().all(|x| x.subscribers().len() == 1)
        })
    };
    assert!(one_each(), "sluice follows every sentinel");
    assert_eq!(s.get("/a").status, 200);

    // A dropped subscription is made again.
    let before = ha.sentinels[0].subscribers();
    ha.sentinels[0].cli(&["CLIENT", "KILL", "TYPE", "pubsub"]);
    assert!(
        s.wait_for(Duration::from_secs(10), || {
            let now = ha.sentinels[0].subscribers();
            now.len() == 1 && now != before
        }),
        "sluice subscribes again after the sentinel drops it"
    );

    // A reload that keeps the backend keeps its subscriptions; one that replaces the
    // backend ends the old one's.
    let reloads = r#"sluice_config_reloads_total{result="success"}"#;
    for (n, timeout) in [(1.0, "1s"), (2.0, "900ms"), (3.0, "800ms")] {
        let before: Vec<Vec<String>> = ha.sentinels.iter().map(|x| x.subscribers()).collect();
        s.reload(&template(timeout));
        assert!(
            s.wait_for(Duration::from_secs(10), || s.metric(reloads) == n),
            "reload {n}"
        );
        std::thread::sleep(Duration::from_millis(500));
        assert!(one_each(), "one subscription per sentinel after reload {n}");
        let after: Vec<Vec<String>> = ha.sentinels.iter().map(|x| x.subscribers()).collect();
        if timeout == "1s" {
            assert_eq!(
                before, after,
                "an unchanged backend keeps its subscriptions"
            );
        } else {
            assert_ne!(before, after, "a new backend subscribes anew");
        }
        assert_eq!(s.get("/a").status, 200);
    }
}

/// The plans on Redis: anonymous, gold and partner clients get 3, 10 and 20 requests
/// through one policy, each shown its `q`; every key (state and ban) has a TTL.
#[test]
fn overrides_give_each_plan_its_numbers_on_redis() {
    let redis = RedisServer::start();
    let s = Sluice::start(&config(
        &redis_limiter(&redis, "timeout = \"1s\""),
        "",
        &common::plans_policy("ban = \"30s\""),
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
        common::admitted_until_rejected(&s, "/a", &[("x-api-key", "k-partner-1")], "plans", 20, 30);
    assert_eq!((anon, gold, partner), (3, 10, 20));
    let keys = redis.cli(&["--scan", "--pattern", "sluice:*"]);
    let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
    assert_eq!(
        keys.iter().filter(|k| k.ends_with(":ban")).count(),
        3,
        "each plan's key was banned once: {keys:?}"
    );
    for key in keys {
        let ttl: i64 = redis.cli(&["PTTL", key]).parse().unwrap_or(-3);
        let most = if key.ends_with(":ban") {
            30_000
        } else {
            3_600_000
        };
        assert!(ttl > 0 && ttl <= most, "{key} has PTTL {ttl}");
    }
}

/// A ban holds across two instances sharing Redis (one rejects, the other then answers
/// `banned` without a window's help), Retry-After counts the ban down on both, and it
/// lifts after `ban`; the shadow policy bans nobody.
#[test]
fn a_ban_holds_across_the_fleet_then_lifts() {
    let redis = RedisServer::start();
    let policies = common::ban_policies();
    let template = config(
        &redis_limiter(&redis, "timeout = \"1s\""),
        "",
        &policies,
        &[("a", "\"strict\""), ("d", "\"dry\"")],
    );
    let (one, two) = (Sluice::start(&template), Sluice::start(&template));
    // Banned on one; on another instance, a new window later: still banned, by the key in
    // Redis.
    let started = common::banned_then_still_banned(&one, &two);
    assert_eq!(
        two.metric(r#"sluice_decisions_total{decision="banned",policy="strict",route="a"}"#),
        1.0
    );
    let ban_keys = redis.cli(&["--scan", "--pattern", "sluice:*:ban"]);
    for key in ban_keys.lines().filter(|k| !k.is_empty()) {
        let ttl: i64 = redis.cli(&["PTTL", key]).parse().unwrap_or(-3);
        assert!(ttl > 0 && ttl <= 4_000, "{key} has PTTL {ttl}");
    }
    std::thread::sleep(Duration::from_millis(4_100).saturating_sub(started.elapsed()));
    assert_eq!(two.get("/a").status, 200, "the ban lifted");
    assert_eq!(one.get("/a").status, 200, "the ban lifted everywhere");
    for _ in 0..3 {
        assert_eq!(one.get("/d").status, 200);
    }
    std::thread::sleep(Duration::from_millis(1_100));
    assert_eq!(two.get("/d").status, 200);
    assert_eq!(
        two.metric(r#"sluice_decisions_total{decision="allowed",policy="dry",route="d"}"#),
        1.0,
        "the shadow policy's key was not banned: a new window admits again"
    );
    let keys = redis.cli(&["--scan", "--pattern", "sluice:*"]);
    assert!(
        !keys
            .lines()
            .any(|k| k.contains(":dry:") && k.ends_with(":ban")),
        "a shadow policy set a ban: {keys}"
    );
}

/// The calls one command made since the server's stats were reset ("" when none).
fn command_calls(redis: &RedisServer, command: &str) -> String {
    let prefix = format!("cmdstat_{command}:");
    redis
        .cli(&["INFO", "commandstats"])
        .lines()
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_default()
        .to_owned()
}

/// Decisions go by FCALL of the function library; a server that lost it (FUNCTION FLUSH,
/// as after a restart without persistence or a failover to a node that never had it) gets
/// it again and the decision goes through, exactly counted.
#[test]
fn decisions_call_the_function_library_and_load_it_again_when_it_is_gone() {
    let redis = RedisServer::start();
    let s = Sluice::start(&config(
        &redis_limiter(
            &redis,
            "timeout = \"2s\"\non_error = \"deny\"\ndeny_cache = 0",
        ),
        "threads = 2",
        &policy("p", "gcra", 4, "1h", "", ""),
        &[("a", "\"p\"")],
    ));
    redis.cli(&["CONFIG", "RESETSTAT"]);
    assert_eq!(s.get("/a").status, 200);
    assert!(
        command_calls(&redis, "fcall").contains("calls=1,"),
        "{}",
        command_calls(&redis, "fcall")
    );
    assert_eq!(command_calls(&redis, "evalsha"), "");
    assert_eq!(redis.cli(&["FUNCTION", "FLUSH"]), "OK");
    let statuses: Vec<u16> = (0..4).map(|_| s.get("/a").status).collect();
    assert_eq!(statuses, [200, 200, 200, 429]);
    assert!(
        redis.cli(&["FUNCTION", "LIST"]).contains("sluice_"),
        "the library is loaded again"
    );
}

/// A server without Redis functions (Redis < 7; here FUNCTION and FCALL renamed away):
/// sluice says so once and decides by EVALSHA, exactly as by FCALL.
#[test]
fn a_server_without_functions_is_decided_by_evalsha() {
    let redis = RedisServer::start_with(&[
        "--rename-command",
        "FUNCTION",
        "",
        "--rename-command",
        "FCALL",
        "",
    ]);
    let s = Sluice::start(&config(
        &redis_limiter(
            &redis,
            "timeout = \"2s\"\non_error = \"deny\"\ndeny_cache = 0",
        ),
        "threads = 2",
        &two_policies(),
        &[("a", "\"p\""), ("b", "\"q\"")],
    ));
    redis.cli(&["CONFIG", "RESETSTAT"]);
    let a: Vec<u16> = (0..4).map(|_| s.get("/a").status).collect();
    let b: Vec<u16> = (0..3).map(|_| s.get("/b").status).collect();
    assert_eq!((a, b), (vec![200, 200, 200, 429], vec![200, 200, 429]));
    // Seven decisions (a first call of each script answers NOSCRIPT, which does not count).
    assert_eq!(
        redis.scripts_run(),
        7,
        "{}",
        command_calls(&redis, "evalsha")
    );
    assert!(command_calls(&redis, "evalsha").contains("calls="));
    assert!(
        s.stderr().contains("deciding by EVALSHA instead"),
        "{}",
        s.stderr()
    );
}

fn two_policies() -> String {
    format!(
        "{}\n{}",
        policy("p", "fixed_window", 3, "1h", "", ""),
        policy("q", "token_bucket", 2, "1h", "", "")
    )
}

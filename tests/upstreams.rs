//! Upstream health and balancing end to end (DESIGN §8): HTTP health checks, passive
//! checks, consistent hashing, and `sluice_upstream_health`, against real upstream servers.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::http::Upstream;
use common::{free_port, Sluice};

fn config(upstream: &str) -> String {
    format!(
        r#"
[server]
listen = ["{{listen}}"]
access_log = "off"
trusted_proxies = ["127.0.0.1/32"]
[admin]
listen = "{{admin}}"
[upstreams.u]
{upstream}
[[routes]]
name = "all"
upstream = "u"
"#
    )
}

fn servers(addrs: &[SocketAddr]) -> String {
    let quoted: Vec<String> = addrs.iter().map(|a| format!("\"{a}\"")).collect();
    format!("servers = [{}]", quoted.join(", "))
}

/// `sluice_upstream_health` of one server of upstream `u`; `None` when the series is absent.
fn health(s: &Sluice, server: SocketAddr) -> Option<f64> {
    let sample = format!("sluice_upstream_health{{server=\"{server}\",upstream=\"u\"}}");
    s.metrics()
        .lines()
        .find_map(|l| l.strip_prefix(&sample).and_then(|v| v.trim().parse().ok()))
}

fn wait_health(s: &Sluice, server: SocketAddr, want: f64, within: Duration) {
    assert!(
        s.wait_for(within, || health(s, server) == Some(want)),
        "sluice_upstream_health of {server} is {:?}, expected {want}",
        health(s, server)
    );
}

/// The name of the upstream server that answered (the first word of its body).
fn served_by(s: &Sluice, client: &str) -> String {
    let r = s.get_with("/", &[("X-Forwarded-For", client)]);
    assert_eq!(r.status, 200, "{client}: {}", r.body);
    r.body.split_whitespace().next().unwrap_or("").to_owned()
}

#[test]
fn a_server_failing_its_http_health_check_is_skipped_until_it_passes_again() {
    let a = Upstream::start("a");
    let b = Upstream::start("b");
    let s = Sluice::start(&config(&format!(
        "{}\nhealth_check = {{ interval = \"100ms\", path = \"/healthz\", timeout = \"500ms\" }}",
        servers(&[a.addr, b.addr])
    )));
    assert_eq!(health(&s, a.addr), Some(1.0));
    assert_eq!(health(&s, b.addr), Some(1.0));

    b.health.store(500, Ordering::SeqCst);
    wait_health(&s, b.addr, 0.0, Duration::from_secs(5));
    let (a0, b0) = (a.hits(), b.hits());
    for _ in 0..20 {
        assert_eq!(s.get("/").status, 200);
    }
    assert_eq!(
        (a.hits() - a0, b.hits() - b0),
        (20, 0),
        "b answers 500 on /healthz"
    );
    assert_eq!(health(&s, a.addr), Some(1.0));

    // A redirect is healthy too (2xx and 3xx are).
    b.health.store(302, Ordering::SeqCst);
    wait_health(&s, b.addr, 1.0, Duration::from_secs(5));
    let b1 = b.hits();
    for _ in 0..20 {
        assert_eq!(s.get("/").status, 200);
    }
    assert_eq!(b.hits() - b1, 10, "b is back in the round robin");
}

#[test]
fn a_server_failing_max_fails_times_is_out_for_fail_timeout_then_tried_again() {
    let a = Upstream::start("a");
    // Nothing listens here yet: every connect is refused. No active check in this test.
    let b_addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
    let s = Sluice::start(&config(&format!(
        "{}\nmax_fails = 2\nfail_timeout = \"3s\"\nconnect_timeout = \"500ms\"",
        servers(&[a.addr, b_addr])
    )));
    assert_eq!(health(&s, b_addr), Some(1.0));
    let mut requests = 0;
    while health(&s, b_addr) != Some(0.0) {
        requests += 1;
        assert!(requests <= 10, "b never taken out");
        // b's refusals are retried on a: the client never sees them.
        assert_eq!(s.get("/").status, 200);
    }
    let out_at = Instant::now();
    assert!(
        requests >= 2,
        "out after {requests} requests, before max_fails"
    );
    assert!(s.stderr().contains("after 2 failures"), "{}", s.stderr());

    // b comes up, but it is out until fail_timeout has passed: nothing is sent to it.
    let b = Upstream::start_at("b", b_addr);
    for _ in 0..10 {
        assert_eq!(s.get("/").status, 200);
    }
    assert!(
        out_at.elapsed() < Duration::from_secs(3),
        "too slow to tell"
    );
    assert_eq!(b.hits(), 0);
    assert_eq!(health(&s, b_addr), Some(0.0));

    wait_health(&s, b_addr, 1.0, Duration::from_secs(6));
    assert!(out_at.elapsed() >= Duration::from_millis(2900));
    for _ in 0..10 {
        assert_eq!(s.get("/").status, 200);
    }
    assert_eq!(b.hits(), 5, "b is tried again after fail_timeout");
}

#[test]
fn with_hash_a_server_leaving_moves_only_its_own_clients() {
    let ups: Vec<Upstream> = (0..3).map(|i| Upstream::start(&format!("s{i}"))).collect();
    let addrs: Vec<SocketAddr> = ups.iter().map(|u| u.addr).collect();
    let upstream = |addrs: &[SocketAddr]| {
        config(&format!(
            "{}\nbalance = \"hash\"\nhealth_check = {{ interval = \"100ms\" }}\nconnect_timeout = \"300ms\"",
            servers(addrs)
        ))
    };
    let s = Sluice::start(&upstream(&addrs));
    let clients: Vec<String> = (1..=90).map(|i| format!("10.9.{}.{}", i / 7, i)).collect();
    let before: HashMap<&str, String> = clients
        .iter()
        .map(|c| (c.as_str(), served_by(&s, c)))
        .collect();
    for name in ["s0", "s1", "s2"] {
        let n = before.values().filter(|v| *v == name).count();
        assert!(n >= 10, "{name} has {n} of 90 clients: {before:?}");
    }

    // s1 goes away: its health check takes it out; the ring itself does not change.
    let mut ups = ups;
    drop(ups.remove(1));
    wait_health(&s, addrs[1], 0.0, Duration::from_secs(5));
    let mut moved = 0;
    let mut during: HashMap<&str, String> = HashMap::new();
    for c in &clients {
        let now = served_by(&s, c);
        if before[c.as_str()] == "s1" {
            assert_ne!(now, "s1");
            moved += 1;
        } else {
            assert_eq!(
                now,
                before[c.as_str()],
                "{c} moved although its server stayed"
            );
        }
        during.insert(c.as_str(), now);
    }
    assert!(moved >= 10);

    // A reload without s1 builds a ring without it: every client stays where it is now,
    // and s1's series is dropped.
    s.reload(&upstream(&[addrs[0], addrs[2]]));
    assert!(s.wait_for(Duration::from_secs(5), || {
        s.metric("sluice_config_reloads_total{result=\"success\"}") == 1.0
    }));
    for c in &clients {
        assert_eq!(served_by(&s, c), during[c.as_str()], "{c} moved on reload");
    }
    assert_eq!(health(&s, addrs[1]), None, "{}", s.metrics());
    assert_eq!(health(&s, addrs[0]), Some(1.0));
}

#[test]
fn reloads_do_not_leave_old_health_checks_running() {
    let a = Upstream::start("a");
    let template = config(&format!(
        "{}\nhealth_check = {{ interval = \"100ms\", path = \"/healthz\" }}",
        servers(&[a.addr])
    ));
    let s = Sluice::start(&template);
    for n in 1..=5 {
        s.reload(&template);
        assert!(s.wait_for(Duration::from_secs(5), || {
            s.metric("sluice_config_reloads_total{result=\"success\"}") == f64::from(n)
        }));
    }
    // One pool is checked every 100ms; six would be if the replaced ones kept going.
    std::thread::sleep(Duration::from_millis(300));
    let before = a.health_checks.load(Ordering::SeqCst);
    std::thread::sleep(Duration::from_secs(1));
    let checks = a.health_checks.load(Ordering::SeqCst) - before;
    assert!((5..=13).contains(&checks), "{checks} health checks in 1s");
    assert_eq!(health(&s, a.addr), Some(1.0));
}

//! `retries` of an upstream (DESIGN §20), through the real binary: a pool of two servers where
//! one resets connections or answers 503; GETs are retried on the other and served, POSTs are
//! not; the budget holds under a burst; a retried request is decided and charged once.

mod common;

use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::Duration;

use common::http::{self, read_request, Listening, Scripted, Upstream};
use common::Sluice;

/// A config with one upstream `flaky` of `servers` with `extra` lines, a route `/` to it and
/// `policies` on the route.
fn config(servers: &[SocketAddr], extra: &str, policies: &str) -> String {
    let servers: Vec<String> = servers.iter().map(|s| format!("\"{s}\"")).collect();
    format!(
        r#"
[server]
listen = ["{{listen}}"]
access_log = "off"
[admin]
listen = "{{admin}}"
[policies.per_ip]
algorithm = "fixed_window"
limit = 3
period = "1h"
key = ["client_ip"]
[upstreams.flaky]
servers = [{}]
{extra}
[[routes]]
name = "all"
path_prefix = "/"
upstream = "flaky"
policies = [{policies}]
"#,
        servers.join(", ")
    )
}

fn retries(s: &Sluice, reason: &str) -> f64 {
    s.metric(&format!(
        "sluice_upstream_retries_total{{reason=\"{reason}\",upstream=\"flaky\"}}"
    ))
}

/// Reads a request and closes the connection without a word.
fn resets() -> Scripted {
    Scripted::start(|_, _| false)
}

/// Answers every request 503.
fn unavailable() -> Scripted {
    Scripted::start(|conn, _| {
        let body = "down\n";
        let resp = format!(
            "HTTP/1.1 503 Service Unavailable\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        conn.write_all(resp.as_bytes()).is_ok()
    })
}

#[test]
fn gets_are_retried_on_the_other_server_after_a_reset_and_posts_are_not() {
    let (bad, good) = (resets(), Upstream::start("good"));
    let s = Sluice::start(&config(
        &[bad.addr, good.addr],
        r#"retries = { attempts = 1, on = ["reset"] }"#,
        "",
    ));
    for i in 0..6 {
        let r = s.get(&format!("/get/{i}"));
        assert_eq!(r.status, 200, "GET {i}: {}", s.stderr());
        assert!(r.body.starts_with("good GET"), "{}", r.body);
    }
    let reset_gets = bad.hits();
    assert!(
        reset_gets >= 1,
        "round robin sent some GETs to the resetting server"
    );
    assert_eq!(retries(&s, "reset"), reset_gets as f64);

    let mut failed = 0;
    for i in 0..6 {
        let r = http::request(s.addr, "POST", &format!("/post/{i}"), &[], "x=1");
        match r.status {
            200 => assert!(r.body.starts_with("good POST"), "{}", r.body),
            502 => failed += 1,
            other => panic!("POST {i}: {other}"),
        }
    }
    assert!(failed >= 1);
    assert_eq!(
        failed,
        bad.hits() - reset_gets,
        "each POST the reset met failed"
    );
    assert_eq!(
        retries(&s, "reset"),
        reset_gets as f64,
        "POSTs never retried"
    );
    assert_eq!(retries(&s, "connect"), 0.0);
}

#[test]
fn without_retries_a_reset_reaches_the_client() {
    let (bad, good) = (resets(), Upstream::start("good"));
    let s = Sluice::start(&config(&[bad.addr, good.addr], "", ""));
    let statuses: Vec<u16> = (0..4).map(|i| s.get(&format!("/{i}")).status).collect();
    assert!(statuses.contains(&502), "{statuses:?}");
    assert!(!s.metrics().contains("sluice_upstream_retries_total{"));
}

#[test]
fn a_503_is_retried_for_gets_and_passed_through_for_posts() {
    let (bad, good) = (unavailable(), Upstream::start("good"));
    let s = Sluice::start(&config(
        &[bad.addr, good.addr],
        r#"retries = { attempts = 2, on = ["connect", "503"], budget = "20%" }"#,
        "",
    ));
    for i in 0..6 {
        let r = s.get(&format!("/get/{i}"));
        assert_eq!((r.status, &r.body[..8]), (200, "good GET"), "GET {i}");
    }
    let unavailable_gets = bad.hits();
    assert!(unavailable_gets >= 1);
    assert_eq!(retries(&s, "503"), unavailable_gets as f64);
    // Primed for every reason in `on`, and only those.
    assert!(s
        .metrics()
        .contains("sluice_upstream_retries_total{reason=\"connect\",upstream=\"flaky\"} 0"));
    assert!(!s.metrics().contains("reason=\"reset\""));

    let mut passed = 0;
    for i in 0..6 {
        let r = http::request(s.addr, "POST", &format!("/post/{i}"), &[], "x=1");
        if r.status == 503 {
            assert_eq!(r.body, "down\n", "the upstream's own answer");
            passed += 1;
        } else {
            assert_eq!(r.status, 200);
        }
    }
    assert!(passed >= 1);
    assert_eq!(passed, bad.hits() - unavailable_gets);
    assert_eq!(retries(&s, "503"), unavailable_gets as f64);
}

#[test]
fn the_last_try_s_503_goes_through_when_every_server_answers_it() {
    let (a, b) = (unavailable(), unavailable());
    let s = Sluice::start(&config(
        &[a.addr, b.addr],
        r#"retries = { attempts = 2, on = ["503"] }"#,
        "",
    ));
    let r = s.get("/");
    assert_eq!((r.status, r.body.as_str()), (503, "down\n"));
    assert_eq!(a.hits() + b.hits(), 3, "one try and two retries");
    assert_eq!(retries(&s, "503"), 2.0);
}

#[test]
fn a_failed_connect_is_retried_for_any_method() {
    // A port nobody listens on.
    let dead: SocketAddr = format!("127.0.0.1:{}", common::free_port())
        .parse()
        .expect("addr");
    let good = Upstream::start("good");
    let s = Sluice::start(&config(
        &[dead, good.addr],
        r#"retries = { attempts = 1, on = ["connect"] }"#,
        "",
    ));
    assert_eq!(s.get("/a").status, 200);
    assert_eq!(
        http::request(s.addr, "POST", "/b", &[], "x=1").status,
        200,
        "nothing of the request left: a POST is tried again too"
    );
}

#[test]
fn a_retried_request_is_decided_and_charged_once() {
    let (bad, good) = (resets(), Upstream::start("good"));
    let s = Sluice::start(&config(
        &[bad.addr, good.addr],
        r#"retries = { attempts = 1, on = ["reset"] }"#,
        "\"per_ip\"",
    ));
    // limit = 3: three GETs pass whether or not they were retried, the fourth is denied.
    for i in 0..3 {
        assert_eq!(s.get(&format!("/{i}")).status, 200, "GET {i}");
    }
    assert!(
        retries(&s, "reset") >= 1.0,
        "at least one of them was retried"
    );
    assert_eq!(s.get("/3").status, 429);
    assert_eq!(
        s.metric(r#"sluice_decisions_total{decision="allowed",policy="per_ip",route="all"}"#),
        3.0
    );
}

/// Two servers sharing one script: the first `first` requests are each held until all of
/// them have arrived and then answered 503; any later request (a retry) is held until
/// `release`, then answered 200.
struct Burst {
    addrs: [SocketAddr; 2],
    state: Arc<(Mutex<(usize, bool)>, Condvar)>,
    _servers: [Listening; 2],
}

impl Burst {
    fn start(first: usize) -> Burst {
        let state = Arc::new((Mutex::new((0usize, false)), Condvar::new()));
        let serve = |state: Arc<(Mutex<(usize, bool)>, Condvar)>| {
            let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
            Listening::serve(listener, move |conn: TcpStream| {
                let mut reader = std::io::BufReader::new(conn.try_clone().expect("clone"));
                let mut conn = conn;
                if read_request(&mut reader).is_none() {
                    return;
                }
                let (lock, cv) = &*state;
                let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
                st.0 += 1;
                let n = st.0;
                cv.notify_all();
                // A first try waits for all the others; a retry for the release.
                let first_try = n <= first;
                let status = if first_try { 503 } else { 200 };
                let (st, _) = cv
                    .wait_timeout_while(st, Duration::from_secs(20), |st| {
                        if first_try {
                            st.0 < first
                        } else {
                            !st.1
                        }
                    })
                    .unwrap_or_else(|e| e.into_inner());
                drop(st);
                let resp = format!(
                    "HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                );
                let _ = conn.write_all(resp.as_bytes());
            })
        };
        let servers = [serve(state.clone()), serve(state.clone())];
        Burst {
            addrs: [servers[0].addr, servers[1].addr],
            state,
            _servers: servers,
        }
    }

    fn release(&self) {
        let (lock, cv) = &*self.state;
        lock.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
        cv.notify_all();
    }
}

/// `n` concurrent GETs against a pool where each first try is answered 503 once all `n` are
/// in flight: returns the retries granted while they were, and every status.
fn burst(n: usize, budget: &str) -> (f64, Vec<u16>) {
    let servers = Burst::start(n);
    let s = Sluice::start(&config(
        &servers.addrs,
        &format!(r#"retries = {{ attempts = 1, on = ["503"], budget = "{budget}" }}"#),
        "",
    ));
    let (tx, rx) = mpsc::channel();
    for i in 0..n {
        let (tx, addr) = (tx.clone(), s.addr);
        std::thread::spawn(move || {
            let status = http::get(addr, &format!("/{i}"), &[]).status;
            let _ = tx.send(status);
        });
    }
    // Every request not granted a retry ends with its 503; the retried ones are held.
    let mut statuses: Vec<u16> = Vec::new();
    let settled = s.wait_for(Duration::from_secs(20), || {
        statuses.extend(rx.try_iter());
        statuses.len() + retries(&s, "503") as usize == n
    });
    assert!(settled, "{statuses:?}: {}", s.stderr());
    let granted = retries(&s, "503");
    servers.release();
    while statuses.len() < n {
        statuses.push(
            rx.recv_timeout(Duration::from_secs(20))
                .expect("a response"),
        );
    }
    (granted, statuses)
}

#[test]
fn the_budget_caps_concurrent_retries_at_its_share_of_requests_in_flight() {
    // 40 in flight, 20%: 8 may be retrying at once.
    let (granted, statuses) = burst(40, "20%");
    assert_eq!(granted, 8.0);
    assert_eq!(count(&statuses, 200), 8);
    assert_eq!(count(&statuses, 503), 32);
}

#[test]
fn a_quiet_upstream_can_still_retry_three_at_once() {
    // 5 in flight, 20% is 1: the floor of 3 applies.
    let (granted, statuses) = burst(5, "20%");
    assert_eq!(granted, 3.0);
    assert_eq!(count(&statuses, 200), 3);
    assert_eq!(count(&statuses, 503), 2);
}

fn count(statuses: &[u16], status: u16) -> usize {
    statuses.iter().filter(|s| **s == status).count()
}

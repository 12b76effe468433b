//! The proxy end to end: the real binary against real upstream servers.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::http::{self, Upstream};
use common::{free_port, render, Sluice, TempDir, SLUICE};

fn base(extra: &str) -> String {
    format!(
        r#"
[server]
listen = ["{{listen}}"]
threads = 2
access_log = "json"
grace_period = "3s"
[admin]
listen = "{{admin}}"
{extra}
"#
    )
}

#[test]
fn routes_by_host_path_regex_and_method_first_match_wins() {
    let a = Upstream::start("a");
    let b = Upstream::start("b");
    let s = Sluice::start(&base(&format!(
        r#"
[upstreams.a]
servers = ["{}"]
[upstreams.b]
servers = ["{}"]
[[routes]]
name = "host"
hosts = ["api.example.com", "*.example.org"]
upstream = "b"
[[routes]]
name = "users"
path_regex = "^/users/[0-9]+$"
methods = ["GET"]
upstream = "b"
[[routes]]
name = "hello"
path = "/hello"
respond = {{ status = 201, body = "hi\n", content_type = "text/x-hi" }}
[[routes]]
name = "v1"
path_prefix = "/v1/"
upstream = "a"
"#,
        a.addr, b.addr
    )));
    let body = |path: &str, host: &str| http::get(s.addr, path, &[("Host", host)]);
    assert!(body("/v1/x?q=1", "localhost")
        .body
        .starts_with("a GET /v1/x?q=1 "));
    assert!(body("/v1/x", "API.example.com:8080")
        .body
        .starts_with("b GET /v1/x "));
    assert!(body("/v1/x", "deep.sub.example.org").body.starts_with("b "));
    assert!(body("/v1/x", "example.org").body.starts_with("a "));
    assert!(body("/users/42", "localhost")
        .body
        .starts_with("b GET /users/42"));
    let post = http::request(s.addr, "POST", "/users/42", &[], "");
    assert_eq!(post.status, 404, "method does not match");
    let hello = body("/hello", "localhost");
    assert_eq!((hello.status, hello.body.as_str()), (201, "hi\n"));
    assert_eq!(hello.header("content-type"), Some("text/x-hi"));
    assert_eq!(body("/nope", "localhost").status, 404);
    assert_eq!(
        s.metric(r#"sluice_http_requests_total{protocol="http1",route="unmatched",status="404"}"#),
        2.0
    );
    assert_eq!(
        s.metric(r#"sluice_http_requests_total{protocol="http1",route="hello",status="201"}"#),
        1.0
    );
    assert_eq!(
        s.metric(r#"sluice_http_requests_total{protocol="http1",route="v1",status="200"}"#),
        2.0
    );
}

#[test]
fn upstream_sees_method_path_query_body_and_forwarded_for() {
    let up = Upstream::start("u");
    let s = Sluice::start(&base(&format!(
        "[upstreams.u]\nservers = [\"{}\"]\n[[routes]]\nname = \"all\"\nupstream = \"u\"\n",
        up.addr
    )));
    let r = http::request(
        s.addr,
        "PUT",
        "/a/b?x=1&y=2",
        &[("X-Forwarded-For", "203.0.113.9")],
        "hello body",
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        r.body,
        "u PUT /a/b?x=1&y=2 xff=203.0.113.9, 127.0.0.1 body=10\n"
    );
    let r = http::get(s.addr, "/", &[]);
    assert!(r.body.contains("xff=127.0.0.1 "), "{}", r.body);
}

#[test]
fn round_robin_spreads_requests_evenly() {
    let ups: Vec<Upstream> = (0..3).map(|i| Upstream::start(&format!("s{i}"))).collect();
    let servers: Vec<String> = ups.iter().map(|u| format!("\"{}\"", u.addr)).collect();
    let s = Sluice::start(&base(&format!(
        "[upstreams.u]\nservers = [{}]\n[[routes]]\nname = \"all\"\nupstream = \"u\"\n",
        servers.join(", ")
    )));
    for _ in 0..30 {
        assert_eq!(s.get("/").status, 200);
    }
    let hits: Vec<usize> = ups.iter().map(Upstream::hits).collect();
    assert_eq!(hits, vec![10, 10, 10]);
}

#[test]
fn hash_balance_keeps_a_client_on_one_server() {
    let ups: Vec<Upstream> = (0..3).map(|i| Upstream::start(&format!("s{i}"))).collect();
    let servers: Vec<String> = ups.iter().map(|u| format!("\"{}\"", u.addr)).collect();
    let s = Sluice::start(&base(&format!(
        "[upstreams.u]\nservers = [{}]\nbalance = \"hash\"\n[[routes]]\nname = \"all\"\nupstream = \"u\"\n",
        servers.join(", ")
    )));
    for _ in 0..12 {
        assert_eq!(s.get("/").status, 200);
    }
    let mut hits: Vec<usize> = ups.iter().map(Upstream::hits).collect();
    hits.sort_unstable();
    assert_eq!(hits, vec![0, 0, 12]);
}

#[test]
fn health_checks_skip_a_dead_server() {
    let live = Upstream::start("live");
    let dead = format!("127.0.0.1:{}", free_port());
    let s = Sluice::start(&base(&format!(
        "[upstreams.u]\nservers = [\"{dead}\", \"{}\"]\nhealth_check = {{ interval = \"100ms\" }}\nconnect_timeout = \"200ms\"\n[[routes]]\nname = \"all\"\nupstream = \"u\"\n",
        live.addr
    )));
    std::thread::sleep(Duration::from_millis(400));
    for _ in 0..20 {
        let r = s.get("/");
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert_eq!(live.hits(), 20);
}

#[test]
fn a_dead_upstream_gives_502_quickly() {
    let dead = format!("127.0.0.1:{}", free_port());
    let s = Sluice::start(&base(&format!(
        "[upstreams.u]\nservers = [\"{dead}\"]\nconnect_timeout = \"500ms\"\n[[routes]]\nname = \"all\"\nupstream = \"u\"\n"
    )));
    let started = Instant::now();
    let r = s.get("/");
    assert_eq!(r.status, 502);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        s.metric(r#"sluice_http_requests_total{protocol="http1",route="all",status="502"}"#),
        1.0
    );
}

#[test]
fn a_client_that_hangs_up_before_the_response_is_counted_499() {
    let slow = Upstream::start_with_delay("slow", Duration::from_millis(1500));
    let s = Sluice::start(&base(&format!(
        "[upstreams.u]\nservers = [\"{}\"]\n[[routes]]\nname = \"all\"\nupstream = \"u\"\n",
        slow.addr
    )));
    let mut client = TcpStream::connect(s.addr).expect("connect to sluice");
    client
        .write_all(b"GET /slow HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .expect("send the request");
    assert!(
        s.wait_for(Duration::from_secs(1), || s
            .metric("sluice_requests_in_flight")
            == 1.0),
        "the waiting request is in flight"
    );
    drop(client);
    let counted =
        || s.metric(r#"sluice_http_requests_total{protocol="http1",route="all",status="499"}"#);
    assert!(
        s.wait_for(Duration::from_secs(5), || counted() == 1.0),
        "{}",
        s.metrics()
    );
    assert!(!s.metrics().contains(r#"route="all",status="502""#));
    assert!(s.wait_for(Duration::from_secs(2), || s
        .metric("sluice_requests_in_flight")
        == 0.0));
}

const RELOAD_A: &str = r#"
[[routes]]
name = "one"
path = "/x"
respond = { status = 200, body = "one\n" }
"#;

const RELOAD_B: &str = r#"
[[routes]]
name = "two"
path = "/x"
respond = { status = 200, body = "two\n" }
"#;

#[test]
fn sighup_reloads_good_configs_and_keeps_the_old_one_on_bad() {
    let s = Sluice::start(&base(RELOAD_A));
    let pid = s.pid();
    assert_eq!(s.get("/x").body, "one\n");

    // A client hammering throughout must never see a failure.
    let addr = s.addr;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stop.clone();
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let sent2 = sent.clone();
    let hammer = std::thread::spawn(move || {
        let mut failures = 0;
        let mut n = 0;
        while !stop2.load(std::sync::atomic::Ordering::SeqCst) {
            if http::get(addr, "/x", &[]).status != 200 {
                failures += 1;
            }
            n += 1;
            sent2.store(n, std::sync::atomic::Ordering::SeqCst);
        }
        (n, failures)
    });

    s.reload(&base(RELOAD_B));
    assert!(s.wait_for(Duration::from_secs(5), || s.get("/x").body == "two\n"));
    // The new config answers as soon as it is stored; the reload is counted just after.
    assert!(s.wait_for(Duration::from_secs(5), || s
        .metric(r#"sluice_config_reloads_total{result="success"}"#)
        == 1.0));

    s.reload(&base(
        "[[routes]]\nname = \"bad\"\nupstream = \"nowhere\"\n",
    ));
    assert!(s.wait_for(Duration::from_secs(5), || {
        s.metric(r#"sluice_config_reloads_total{result="failure"}"#) == 1.0
    }));
    assert_eq!(s.get("/x").body, "two\n", "the old config stays in force");
    assert!(
        s.stderr().contains("unknown upstream \"nowhere\""),
        "{}",
        s.stderr()
    );

    // The reloads take tens of milliseconds; on a loaded machine the hammer may not have
    // had ten turns yet (it once counted exactly 10).
    s.wait_for(Duration::from_secs(5), || {
        sent.load(std::sync::atomic::Ordering::SeqCst) > 10
    });
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let (n, failures) = hammer.join().expect("hammer thread");
    assert!(n > 10, "only {n} requests during reloads");
    assert_eq!(failures, 0);
    assert_eq!(s.pid(), pid);
    assert!(s.child_alive());
}

#[test]
fn sigterm_drains_in_flight_requests_then_exits_zero() {
    let slow = Upstream::start_with_delay("slow", Duration::from_millis(700));
    let mut s = Sluice::start(&base(&format!(
        "[upstreams.u]\nservers = [\"{}\"]\n[[routes]]\nname = \"all\"\nupstream = \"u\"\n",
        slow.addr
    )));
    let addr = s.addr;
    let pending = std::thread::spawn(move || http::get(addr, "/slow", &[]));
    std::thread::sleep(Duration::from_millis(200));
    let started = Instant::now();
    s.signal("TERM");
    let r = pending.join().expect("request thread");
    assert_eq!(r.status, 200, "the in-flight request finished");
    let status = s.child.wait().expect("wait for exit");
    assert!(status.success(), "{status}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "exited once drained: {:?}",
        started.elapsed()
    );
}

#[test]
fn sigterm_with_nothing_in_flight_exits_at_once() {
    let mut s = Sluice::start(&base(RELOAD_A));
    let started = Instant::now();
    s.signal("TERM");
    let status = s.child.wait().expect("wait for exit");
    assert!(status.success());
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn admin_endpoints_answer() {
    let s = Sluice::start(&base(RELOAD_A));
    assert_eq!(http::get(s.admin, "/healthz", &[]).status, 200);
    assert_eq!(http::get(s.admin, "/readyz", &[]).status, 200);
    assert_eq!(http::get(s.admin, "/nope", &[]).status, 404);
    let m = s.metrics();
    assert!(m.contains("sluice_build_info{version=\""), "{m}");
    assert!(m.contains("sluice_backend_up{backend=\"memory\"} 1"), "{m}");
}

#[test]
fn access_log_lines_are_json_with_route_status_and_client() {
    let s = Sluice::start(&base(RELOAD_A));
    assert_eq!(s.get("/x").status, 200);
    assert!(s.wait_for(Duration::from_secs(2), || s
        .stdout()
        .contains("\"route\":\"one\"")));
    let line = s
        .stdout()
        .lines()
        .find(|l| l.contains("\"route\":\"one\""))
        .unwrap_or_default()
        .to_owned();
    let v: serde_json::Value = serde_json::from_str(&line).expect("json access log");
    assert_eq!(v["status"], 200);
    assert_eq!(v["client_ip"], "127.0.0.1");
    assert_eq!(v["method"], "GET");
}

#[test]
fn hostile_requests_never_take_the_process_down() {
    let up = Upstream::start("u");
    let s = Sluice::start(&base(&format!(
        r#"
[upstreams.u]
servers = ["{}"]
[policies.h]
algorithm = "gcra"
limit = 1000000
period = "1s"
key = ["header:x-key", "cookie:c", "query:q"]
on_missing = "shared"
[[routes]]
name = "all"
upstream = "u"
policies = ["h"]
"#,
        up.addr
    )));
    let big = "a".repeat(16 * 1024);
    let hostile: Vec<Vec<u8>> = vec![
        b"GARBAGE\r\n\r\n".to_vec(),
        b"GET\r\n\r\n".to_vec(),
        b"GET / HTTP/9.9\r\n\r\n".to_vec(),
        b"GET /%%%% HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        format!("GET / HTTP/1.1\r\nHost: x\r\nX-Big: {big}\r\nConnection: close\r\n\r\n").into_bytes(),
        b"GET /?q=\xff\xfe HTTP/1.1\r\nHost: \xc3\x28\r\nX-Key: \xff\x00\x80\r\nCookie: c=\xfe\r\nX-Forwarded-For: \xff\r\nConnection: close\r\n\r\n".to_vec(),
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\nshort".to_vec(),
        b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n".to_vec(),
        vec![0u8; 4096],
    ];
    for raw in &hostile {
        // Some of these never complete a request: do not wait long for an answer.
        let _ = http::send_raw_within(s.addr, raw, Duration::from_millis(500));
    }
    // A connection that sends half a request and vanishes.
    if let Ok(mut c) = TcpStream::connect(s.addr) {
        let _ = c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nX-Partial: ");
    }
    assert_eq!(
        s.get("/after").status,
        200,
        "still serving after hostile input"
    );
    assert!(s.child_alive());
}

#[test]
fn thousands_of_distinct_clients_stay_bounded_and_served() {
    let s = Sluice::start(
        r#"
[server]
listen = ["{listen}"]
access_log = "off"
trusted_proxies = ["127.0.0.1/32"]
[admin]
listen = "{admin}"
[limiter]
max_keys = 500
[policies.per_ip]
algorithm = "fixed_window"
limit = 1
period = "1h"
key = ["client_ip"]
[[routes]]
name = "all"
respond = { status = 200 }
policies = ["per_ip"]
"#,
    );
    for i in 0..3000u32 {
        let ip = format!("10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255);
        let r = s.get_with("/", &[("X-Forwarded-For", &ip)]);
        assert_eq!(r.status, 200, "client {ip} has its own bucket");
    }
    // The newest clients are still tracked: a second request is over the limit.
    assert_eq!(
        s.get_with("/", &[("X-Forwarded-For", "10.0.11.183")])
            .status,
        429
    );
    assert!(s.child_alive());
}

#[test]
fn tls_upstream_is_verified_against_its_sni_name() {
    let dir = common::TempDir::new();
    let d = dir.0.as_path();
    // A private CA and a certificate valid only for "upstream.test".
    common::tls_files(d, "DNS:upstream.test");
    let portfile = d.join("port");
    let mut server = std::process::Command::new("python3")
        .arg("tests/tls_upstream.py")
        .arg(d.join("srv.pem"))
        .arg(d.join("srv.key"))
        .arg(&portfile)
        .spawn()
        .expect("python3 for the TLS upstream");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !portfile.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let port = std::fs::read_to_string(&portfile).expect("TLS upstream port");
    let template = |sni: &str| {
        base(&format!(
            "[upstreams.u]\nservers = [\"127.0.0.1:{port}\"]\ntls = true\nsni = \"{sni}\"\n[[routes]]\nname = \"all\"\nupstream = \"u\"\n"
        ))
    };
    let ca = d.join("ca.pem").display().to_string();
    let s = Sluice::start_with_env(
        &template("upstream.test"),
        &[("SSL_CERT_FILE", ca.as_str())],
    );
    let r = s.get("/secure?x=1");
    assert_eq!(
        (r.status, r.body.as_str()),
        (200, "tls sni=upstream.test path=/secure?x=1\n")
    );
    // The wrong name fails verification: 502, not a silently trusted peer.
    let wrong = Sluice::start_with_env(&template("other.test"), &[("SSL_CERT_FILE", ca.as_str())]);
    assert_eq!(wrong.get("/secure").status, 502);
    let _ = server.kill();
    let _ = server.wait();
}

/// With `threads = 2` each worker listens on a socket of its own (SO_REUSEPORT: the kernel
/// spreads new connections over them) and so serves its connections on its own thread;
/// every connection is answered.
#[test]
fn every_worker_listens_on_a_socket_of_its_own() {
    let s = Sluice::start(&base(
        r#"
[[routes]]
name = "all"
path_prefix = "/"
respond = { status = 200, body = "ok\n" }
"#,
    ));
    // Ready once one worker answers; the other may open its socket a moment later.
    s.wait_for(Duration::from_secs(5), || {
        listening_sockets(s.addr.port()) == 2
    });
    assert_eq!(listening_sockets(s.addr.port()), 2, "one per worker thread");
    for _ in 0..16 {
        assert_eq!(http::get(s.addr, "/", &[]).status, 200);
    }
}

/// TCP sockets in state LISTEN on `port`, from /proc/net/tcp and tcp6.
fn listening_sockets(port: u16) -> usize {
    let local = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|path| std::fs::read_to_string(path).ok())
        .flat_map(|table| {
            table
                .lines()
                .skip(1)
                .map(|line| {
                    line.split_whitespace()
                        .map(str::to_owned)
                        .collect::<Vec<_>>()
                })
                .collect::<Vec<_>>()
        })
        .filter(|fields| fields.len() > 3 && fields[1].ends_with(&local) && fields[3] == "0A")
        .count()
}

/// The workers' SO_REUSEPORT sockets would as gladly share their port with a second sluice
/// and split the traffic in silence: a second instance on a port already served fails to
/// start, saying so, and the first keeps every connection.
#[test]
fn a_second_instance_on_a_served_port_fails_to_start() {
    let template = base(
        r#"
[[routes]]
name = "all"
path_prefix = "/"
respond = { status = 200, body = "first\n" }
"#,
    );
    let first = Sluice::start(&template);
    let dir = TempDir::new();
    let config = dir.0.join("second.toml");
    let admin: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
    std::fs::write(&config, render(&template, first.addr, admin)).expect("write config");
    let mut second = Command::new(SLUICE)
        .arg("run")
        .arg("--config")
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the second sluice");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = second.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = second.kill();
            let _ = second.wait();
            panic!(
                "a second sluice started on {}, which the first serves",
                first.addr
            );
        }
        std::thread::sleep(Duration::from_millis(25));
    };
    let mut stderr = String::new();
    if let Some(mut pipe) = second.stderr.take() {
        std::io::Read::read_to_string(&mut pipe, &mut stderr).expect("read stderr");
    }
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("cannot listen on {}", first.addr)),
        "{stderr}"
    );
    for _ in 0..16 {
        assert_eq!(http::get(first.addr, "/", &[]).body, "first\n");
    }
}

//! Hostile and strict clients against the real binary over raw sockets (DESIGN §10):
//! slowloris, stalled bodies, idle connections, per-address caps, body limits, pipelining,
//! absolute-form targets and missing Host.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::http::{self, Upstream};
use common::Sluice;

/// A config with `[server]` extras, a `respond` route at /hello, a proxied route at /api/
/// (to `upstream`) and a proxied route /big/ whose body limit is raised to 10KB.
fn config(server_extra: &str, upstream: SocketAddr) -> String {
    format!(
        r#"
[server]
listen = ["{{listen}}"]
access_log = "off"
threads = 2
{server_extra}

[admin]
listen = "{{admin}}"

[upstreams.up]
servers = ["{upstream}"]

[[routes]]
name = "hello"
path = "/hello"
respond = {{ status = 200, body = "hello\n" }}

[[routes]]
name = "big"
path_prefix = "/big/"
upstream = "up"
max_request_body = "10KB"

[[routes]]
name = "api"
upstream = "up"
"#
    )
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect to sluice");
    s.set_nodelay(true).expect("nodelay");
    s
}

/// A connection from `local` (another loopback address than the harness's 127.0.0.1), so a
/// per-address count sees only this test's connections: `Sluice::start`'s readiness probe,
/// accepted late by a loaded worker thread, once took one of them.
fn connect_from(local: [u8; 4], addr: SocketAddr) -> TcpStream {
    let s =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    s.bind(&SocketAddr::from((local, 0)).into())
        .expect("bind a loopback address");
    s.connect(&addr.into()).expect("connect to sluice");
    let s = TcpStream::from(s);
    s.set_nodelay(true).expect("nodelay");
    s
}

/// Reads until the peer closes or `limit` passes; returns the bytes and when it closed.
fn read_until_closed(s: &mut TcpStream, limit: Duration) -> (Vec<u8>, Option<Duration>) {
    let start = Instant::now();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    while start.elapsed() < limit {
        s.set_read_timeout(Some(Duration::from_millis(50)))
            .expect("read timeout");
        match s.read(&mut buf) {
            Ok(0) => return (out, Some(start.elapsed())),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return (out, Some(start.elapsed())),
        }
    }
    (out, None)
}

/// Reads one response with a Content-Length body from a kept-alive connection.
fn read_response(s: &mut TcpStream) -> http::Response {
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("read timeout");
    let mut raw = Vec::new();
    let mut byte = [0u8; 1];
    while !raw.ends_with(b"\r\n\r\n") {
        match s.read(&mut byte) {
            Ok(1) => raw.push(byte[0]),
            _ => break,
        }
    }
    let head = http::parse(&raw);
    let length: usize = head
        .header("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    s.read_exact(&mut body).expect("response body");
    raw.extend_from_slice(&body);
    http::parse(&raw)
}

#[test]
fn a_partial_header_is_answered_408_and_closed_while_normal_clients_are_served() {
    let up = Upstream::start("up");
    let sluice = Sluice::start(&config(r#"header_timeout = "1s""#, up.addr));
    // 60 slowloris connections: half a header, then a byte every 200 ms.
    let mut slow: Vec<TcpStream> = (0..60)
        .map(|_| {
            let mut s = connect(sluice.addr);
            s.write_all(b"GET /hello HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
                .expect("partial header");
            s
        })
        .collect();
    let started = Instant::now();
    let trickle = thread::spawn(move || {
        let mut closed_at = vec![None; slow.len()];
        let mut answers = vec![Vec::new(); slow.len()];
        while started.elapsed() < Duration::from_secs(4) {
            for (i, s) in slow.iter_mut().enumerate() {
                if closed_at[i].is_some() {
                    continue;
                }
                let _ = s.write_all(b"a");
                s.set_nonblocking(true).expect("nonblocking");
                let mut buf = [0u8; 512];
                match s.read(&mut buf) {
                    Ok(0) => closed_at[i] = Some(started.elapsed()),
                    Ok(n) => answers[i].extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(_) => closed_at[i] = Some(started.elapsed()),
                }
                s.set_nonblocking(false).expect("blocking");
            }
            thread::sleep(Duration::from_millis(200));
        }
        (closed_at, answers)
    });
    // Normal clients keep being served while the slow ones are held and cut.
    let mut normal = Vec::new();
    while started.elapsed() < Duration::from_secs(3) {
        normal.push(sluice.get("/hello").status);
        thread::sleep(Duration::from_millis(50));
    }
    let (closed_at, answers) = trickle.join().expect("trickle thread");
    assert!(
        normal.len() > 20 && normal.iter().all(|s| *s == 200),
        "{normal:?}"
    );
    for (i, closed) in closed_at.iter().enumerate() {
        let closed = closed.unwrap_or_else(|| panic!("slow connection {i} still open after 4 s"));
        assert!(
            closed >= Duration::from_millis(900) && closed < Duration::from_millis(2500),
            "connection {i} closed after {closed:?}, header_timeout is 1 s"
        );
        let answer = String::from_utf8_lossy(&answers[i]);
        assert!(
            answer.starts_with("HTTP/1.1 408 "),
            "connection {i}: {answer:?}"
        );
    }
    assert_eq!(
        sluice.metric(r#"sluice_connections_rejected_total{reason="header_timeout"}"#),
        60.0
    );
}

#[test]
fn a_connection_that_sends_nothing_is_closed_after_header_timeout() {
    let up = Upstream::start("up");
    let sluice = Sluice::start(&config(r#"header_timeout = "1s""#, up.addr));
    let mut s = connect(sluice.addr);
    let (bytes, closed) = read_until_closed(&mut s, Duration::from_secs(4));
    let closed = closed.expect("closed");
    assert!(bytes.is_empty(), "{bytes:?}");
    assert!(
        closed >= Duration::from_millis(900) && closed < Duration::from_millis(2500),
        "{closed:?}"
    );
}

#[test]
fn a_stalled_body_is_cut_with_408_after_body_timeout() {
    let up = Upstream::start("up");
    let sluice = Sluice::start(&config(r#"body_timeout = "1s""#, up.addr));
    let mut s = connect(sluice.addr);
    s.write_all(
        b"POST /api/upload HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\n0123456789",
    )
    .expect("request");
    let (bytes, closed) = read_until_closed(&mut s, Duration::from_secs(5));
    let closed = closed.expect("closed after the stall");
    assert!(
        closed >= Duration::from_millis(900) && closed < Duration::from_millis(3000),
        "{closed:?}"
    );
    let response = http::parse(&bytes);
    assert_eq!(response.status, 408, "{response:?}");
    assert_eq!(up.hits(), 0, "the upstream never got a whole request");
    assert_eq!(
        sluice.metric(r#"sluice_connections_rejected_total{reason="body_timeout"}"#),
        1.0
    );
    // A body sent with pauses shorter than body_timeout passes.
    let mut s = connect(sluice.addr);
    s.write_all(b"POST /api/slow HTTP/1.1\r\nHost: localhost\r\nContent-Length: 6\r\nConnection: close\r\n\r\nabc")
        .expect("request");
    thread::sleep(Duration::from_millis(600));
    s.write_all(b"def").expect("rest of body");
    let (bytes, _) = read_until_closed(&mut s, Duration::from_secs(5));
    let response = http::parse(&bytes);
    assert_eq!(response.status, 200);
    assert!(
        response.body.contains("POST /api/slow"),
        "{}",
        response.body
    );
}

#[test]
fn an_idle_keep_alive_connection_is_closed_after_idle_timeout() {
    let up = Upstream::start("up");
    let sluice = Sluice::start(&config(r#"idle_timeout = "1s""#, up.addr));
    let mut s = connect(sluice.addr);
    // A client that comes back within idle_timeout keeps its connection.
    for _ in 0..3 {
        s.write_all(b"GET /hello HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .expect("request");
        assert_eq!(read_response(&mut s).status, 200);
        thread::sleep(Duration::from_millis(600));
    }
    let mut proxied = connect(sluice.addr);
    proxied
        .write_all(b"GET /api/x HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .expect("request");
    assert_eq!(read_response(&mut proxied).status, 200);
    let (_, closed) = read_until_closed(&mut proxied, Duration::from_secs(4));
    let closed = closed.expect("the idle proxied connection was closed");
    assert!(
        closed >= Duration::from_millis(900) && closed < Duration::from_millis(2500),
        "{closed:?}"
    );
    let (_, closed) = read_until_closed(&mut s, Duration::from_secs(4));
    assert!(closed.is_some(), "the idle connection was closed");
    // An idle close is not a rejection.
    assert_eq!(
        sluice.metric(r#"sluice_connections_rejected_total{reason="header_timeout"}"#),
        0.0
    );
}

#[test]
fn the_per_ip_cap_closes_the_next_connection_and_counts_it() {
    const CLIENT: [u8; 4] = [127, 0, 0, 2];
    let up = Upstream::start("up");
    let sluice = Sluice::start(&config("max_connections_per_ip = 3", up.addr));
    let hello = |s: &mut TcpStream| {
        s.write_all(b"GET /hello HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .expect("request");
        read_response(s).status
    };
    let mut held: Vec<TcpStream> = (0..3)
        .map(|_| {
            let mut s = connect_from(CLIENT, sluice.addr);
            assert_eq!(hello(&mut s), 200);
            s
        })
        .collect();
    assert!(sluice.wait_for(Duration::from_secs(2), || {
        sluice.metric(r#"sluice_connections{protocol="http1"}"#) == 3.0
    }));
    let mut fourth = connect_from(CLIENT, sluice.addr);
    let _ = fourth.write_all(b"GET /hello HTTP/1.1\r\nHost: localhost\r\n\r\n");
    let (bytes, closed) = read_until_closed(&mut fourth, Duration::from_secs(2));
    assert!(bytes.is_empty(), "{}", String::from_utf8_lossy(&bytes));
    assert!(
        closed.is_some_and(|d| d < Duration::from_secs(1)),
        "{closed:?}"
    );
    assert_eq!(
        sluice.metric(r#"sluice_connections_rejected_total{reason="per_ip"}"#),
        1.0
    );
    // Another address is not counted with this one.
    assert_eq!(sluice.get("/hello").status, 200);
    // The held connections still work, and closing one frees a slot.
    assert_eq!(hello(&mut held[0]), 200);
    drop(held.pop());
    assert!(sluice.wait_for(Duration::from_secs(2), || {
        sluice.metric(r#"sluice_connections{protocol="http1"}"#) == 2.0
    }));
    assert_eq!(hello(&mut connect_from(CLIENT, sluice.addr)), 200);
}

/// An upstream that records every byte it receives and answers 200 once a request's
/// header has arrived and the connection goes quiet.
struct RecordingUpstream {
    addr: SocketAddr,
    bytes: Arc<AtomicUsize>,
}

impl RecordingUpstream {
    fn start() -> RecordingUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let bytes = Arc::new(AtomicUsize::new(0));
        let counted = bytes.clone();
        thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                let counted = counted.clone();
                thread::spawn(move || {
                    let mut buf = [0u8; 65536];
                    conn.set_read_timeout(Some(Duration::from_millis(300)))
                        .expect("timeout");
                    let mut seen = Vec::new();
                    loop {
                        match conn.read(&mut buf) {
                            Ok(0) => return,
                            Ok(n) => {
                                counted.fetch_add(n, Ordering::SeqCst);
                                seen.extend_from_slice(&buf[..n]);
                            }
                            Err(_) => {
                                if !seen.is_empty() {
                                    let _ = conn.write_all(
                                        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n",
                                    );
                                }
                                return;
                            }
                        }
                    }
                });
            }
        });
        RecordingUpstream { addr, bytes }
    }
}

#[test]
fn bodies_over_max_request_body_get_413_and_never_reach_the_upstream() {
    let up = RecordingUpstream::start();
    let sluice = Sluice::start(&config(r#"max_request_body = "1KB""#, up.addr));
    // By Content-Length: refused before the upstream is even contacted.
    let big = "x".repeat(2000);
    let response = http::request(sluice.addr, "POST", "/api/upload", &[], &big);
    assert_eq!(response.status, 413, "{response:?}");
    assert_eq!(
        response.header("content-type"),
        Some("application/problem+json")
    );
    assert!(
        response.body.contains("\"status\":413"),
        "{}",
        response.body
    );
    assert_eq!(up.bytes.load(Ordering::SeqCst), 0);
    // The route's own limit (10KB) lets the same body through.
    let response = http::request(sluice.addr, "POST", "/big/upload", &[], &big);
    assert_eq!(response.status, 200, "{response:?}");
    let forwarded = up.bytes.load(Ordering::SeqCst);
    assert!(forwarded > 2000, "{forwarded}");

    // Chunked: cut as soon as the body passes 1KB; the upstream sees less than that.
    let mut s = connect(sluice.addr);
    s.write_all(
        b"POST /api/stream HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n",
    )
    .expect("header");
    let chunk = format!("200\r\n{}\r\n", "y".repeat(0x200));
    let mut answer = Vec::new();
    for _ in 0..64 {
        if s.write_all(chunk.as_bytes()).is_err() {
            break;
        }
        thread::sleep(Duration::from_millis(10));
        s.set_nonblocking(true).expect("nonblocking");
        let mut buf = [0u8; 1024];
        if let Ok(n @ 1..) = s.read(&mut buf) {
            answer.extend_from_slice(&buf[..n]);
            break;
        }
        s.set_nonblocking(false).expect("blocking");
    }
    s.set_nonblocking(false).expect("blocking");
    let (rest, _) = read_until_closed(&mut s, Duration::from_secs(3));
    answer.extend_from_slice(&rest);
    let response = http::parse(&answer);
    assert_eq!(response.status, 413, "{}", String::from_utf8_lossy(&answer));
    thread::sleep(Duration::from_millis(500));
    let chunked_bytes = up.bytes.load(Ordering::SeqCst) - forwarded;
    assert!(
        chunked_bytes < 1024 + 512,
        "the upstream received {chunked_bytes} bytes of a body limited to 1KB"
    );
}

#[test]
fn pipelined_requests_are_answered_in_order() {
    let up = Upstream::start("up");
    let sluice = Sluice::start(&config("", up.addr));
    let mut s = connect(sluice.addr);
    s.write_all(
        b"GET /hello HTTP/1.1\r\nHost: localhost\r\n\r\n\
          GET /api/one?n=1 HTTP/1.1\r\nHost: localhost\r\n\r\n\
          GET /hello HTTP/1.1\r\nHost: localhost\r\n\r\n\
          POST /api/two HTTP/1.1\r\nHost: localhost\r\nContent-Length: 3\r\n\r\nabc\
          GET /api/three HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
    )
    .expect("pipelined requests");
    let bodies: Vec<String> = (0..5).map(|_| read_response(&mut s).body).collect();
    assert_eq!(bodies[0], "hello\n");
    assert!(
        bodies[1].starts_with("up GET /api/one?n=1 "),
        "{}",
        bodies[1]
    );
    assert_eq!(bodies[2], "hello\n");
    assert!(
        bodies[3].starts_with("up POST /api/two ") && bodies[3].contains("body=3"),
        "{}",
        bodies[3]
    );
    assert!(bodies[4].starts_with("up GET /api/three "), "{}", bodies[4]);
    let (rest, closed) = read_until_closed(&mut s, Duration::from_secs(2));
    assert!(rest.is_empty() && closed.is_some());
    assert_eq!(up.hits(), 3);
}

#[test]
fn an_absolute_form_target_reaches_the_upstream_in_origin_form() {
    let up = Upstream::start("up");
    let sluice = Sluice::start(&config("", up.addr));
    let raw = b"GET http://localhost/api/abs?z=2 HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    let response = http::parse(&http::send_raw(sluice.addr, raw).expect("answer"));
    assert_eq!(response.status, 200);
    assert!(
        response.body.starts_with("up GET /api/abs?z=2 "),
        "{}",
        response.body
    );
    // Routed by the target's host and path, like any request.
    let raw =
        b"GET http://localhost/hello HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    assert_eq!(
        http::parse(&http::send_raw(sluice.addr, raw).expect("answer")).body,
        "hello\n"
    );
}

#[test]
fn http11_without_host_or_with_two_hosts_is_400() {
    let up = Upstream::start("up");
    let sluice = Sluice::start(&config("", up.addr));
    for raw in [
        &b"GET /api/x HTTP/1.1\r\nConnection: close\r\n\r\n"[..],
        b"GET /api/x HTTP/1.1\r\nHost: a\r\nHost: b\r\nConnection: close\r\n\r\n",
        b"POST /api/x HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: xchunked\r\nConnection: close\r\n\r\n",
    ] {
        let response = http::parse(&http::send_raw(sluice.addr, raw).expect("answer"));
        assert_eq!(response.status, 400, "{}", String::from_utf8_lossy(raw));
    }
    assert_eq!(up.hits(), 0);
    // HTTP/1.0 needs no Host.
    let response =
        http::parse(&http::send_raw(sluice.addr, b"GET /hello HTTP/1.0\r\n\r\n").expect("answer"));
    assert_eq!(response.status, 200);
}

/// RSS of a process, in KiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("proc status")
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS")
}

#[test]
fn idle_keep_alive_connections_stay_small() {
    // The bound is DESIGN's 16 KiB with room for noise; a regression to waiting inside
    // Pingora's request future (about 35 KiB per connection) fails it.
    let up = Upstream::start("up");
    let sluice = Sluice::start(&config("", up.addr));
    for _ in 0..20 {
        assert_eq!(sluice.get("/hello").status, 200);
    }
    thread::sleep(Duration::from_millis(300));
    let before = rss_kib(sluice.pid());
    let n = 500;
    let mut conns: Vec<TcpStream> = (0..n).map(|_| connect(sluice.addr)).collect();
    for batch in conns.chunks_mut(50) {
        for s in batch.iter_mut() {
            s.write_all(b"GET /hello HTTP/1.1\r\nHost: localhost\r\n\r\n")
                .expect("request");
        }
        for s in batch.iter_mut() {
            assert_eq!(read_response(s).status, 200);
        }
    }
    thread::sleep(Duration::from_millis(500));
    let per_conn = (rss_kib(sluice.pid()) - before) as f64 / n as f64;
    assert!(per_conn < 20.0, "{per_conn:.1} KiB per idle connection");
    assert!(sluice.wait_for(Duration::from_secs(2), || {
        sluice.metric(r#"sluice_connections{protocol="http1"}"#) == n as f64
    }));
}

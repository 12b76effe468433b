//! Upstream connection reuse (DESIGN §18): with more concurrent requests than Pingora's
//! default pool held (128), every upstream connection is kept for the next request, so the
//! upstream sees no more connections than the peak concurrency; idle connections are closed
//! after `keepalive_timeout`, past the pool's `keepalive` size, or when the upstream closes them.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

use common::http::{read_request, Listening};
use common::Sluice;

/// Client connections, each one request at a time, all at once in every round.
const CLIENTS: usize = 300;
const ROUNDS: usize = 6;

/// An upstream that counts the connections it accepts and those that ended (read EOF), and
/// answers each request after `delay`; with `close_after`, it closes each connection that
/// long after its first response, as an upstream with a short idle timeout does.
fn watching_upstream(
    delay: Duration,
    close_after: Option<Duration>,
) -> (Listening, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let accepted = Arc::new(AtomicUsize::new(0));
    let ended = Arc::new(AtomicUsize::new(0));
    let (seen, gone) = (accepted.clone(), ended.clone());
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind upstream");
    let listening = Listening::serve(listener, move |conn: TcpStream| {
        seen.fetch_add(1, Ordering::SeqCst);
        let mut reader = BufReader::new(conn.try_clone().expect("clone stream"));
        let mut conn = conn;
        while read_request(&mut reader).is_some() {
            thread::sleep(delay);
            if conn
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
                .is_err()
            {
                break;
            }
            if let Some(after) = close_after {
                thread::sleep(after);
                break;
            }
        }
        gone.fetch_add(1, Ordering::SeqCst);
    });
    (listening, accepted, ended)
}

/// Sends one keep-alive GET on `conn` and reads its 200 response whole.
fn one_request(conn: &mut TcpStream, reader: &mut BufReader<TcpStream>) {
    conn.write_all(b"GET / HTTP/1.1\r\nHost: pool.test\r\n\r\n")
        .expect("send request");
    let mut length = 0usize;
    let mut status = String::new();
    reader.read_line(&mut status).expect("status line");
    assert!(status.starts_with("HTTP/1.1 200"), "status: {status}");
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).expect("header line");
        if line == "\r\n" || line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().expect("content-length");
            }
        }
    }
    let mut body = vec![0u8; length];
    reader.read_exact(&mut body).expect("body");
}

#[test]
fn more_concurrent_requests_than_the_old_pool_held_reuse_their_connections() {
    let (upstream, accepted, _) = watching_upstream(Duration::ZERO, None);
    let sluice = Sluice::start(&pool_config(upstream.addr, ""));
    let addr: SocketAddr = sluice.addr;
    let barrier = Arc::new(Barrier::new(CLIENTS));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let barrier = barrier.clone();
            thread::spawn(move || {
                let mut conn = TcpStream::connect(addr).expect("connect to sluice");
                conn.set_read_timeout(Some(Duration::from_secs(30))).ok();
                let mut reader = BufReader::new(conn.try_clone().expect("clone"));
                for _ in 0..ROUNDS {
                    // Every client sends at once: CLIENTS requests in flight together.
                    barrier.wait();
                    one_request(&mut conn, &mut reader);
                    // Every response is in before the next round, and each upstream
                    // connection has had time to go back to the pool.
                    barrier.wait();
                    thread::sleep(Duration::from_millis(100));
                }
            })
        })
        .collect();
    for client in clients {
        client.join().expect("client thread");
    }
    let connections = accepted.load(Ordering::SeqCst);
    assert!(
        connections <= CLIENTS,
        "{ROUNDS} rounds of {CLIENTS} concurrent requests opened {connections} upstream connections: \
         idle connections were closed although the next round needed them"
    );
}

fn pool_config(upstream: SocketAddr, pool: &str) -> String {
    format!(
        r#"
[server]
listen = ["{{listen}}"]
threads = 1
access_log = "off"
[admin]
listen = "{{admin}}"
[upstreams.u]
servers = ["{upstream}"]
{pool}
[[routes]]
name = "all"
upstream = "u"
"#
    )
}

fn request_on_new_connection(addr: SocketAddr) {
    let mut conn = TcpStream::connect(addr).expect("connect to sluice");
    conn.set_read_timeout(Some(Duration::from_secs(10))).ok();
    let mut reader = BufReader::new(conn.try_clone().expect("clone"));
    one_request(&mut conn, &mut reader);
}

/// Waits up to `within` for `counter` to reach `want`; its value then.
fn wait_for(counter: &AtomicUsize, want: usize, within: Duration) -> usize {
    let start = std::time::Instant::now();
    while counter.load(Ordering::SeqCst) < want && start.elapsed() < within {
        thread::sleep(Duration::from_millis(20));
    }
    counter.load(Ordering::SeqCst)
}

#[test]
fn an_idle_upstream_connection_is_kept_then_closed_after_keepalive_timeout() {
    let (upstream, accepted, ended) = watching_upstream(Duration::ZERO, None);
    let sluice = Sluice::start(&pool_config(upstream.addr, r#"keepalive_timeout = "1s""#));
    request_on_new_connection(sluice.addr);
    let answered = std::time::Instant::now();
    // Kept for the next request: a second one within the timeout reuses it.
    thread::sleep(Duration::from_millis(300));
    request_on_new_connection(sluice.addr);
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "the idle connection was not reused"
    );
    assert_eq!(
        ended.load(Ordering::SeqCst),
        0,
        "the idle connection was closed early"
    );
    // Then closed once idle for keepalive_timeout (checked every second).
    assert_eq!(
        wait_for(&ended, 1, Duration::from_secs(5)),
        1,
        "never closed"
    );
    let idle_for = answered.elapsed();
    assert!(
        idle_for >= Duration::from_millis(1200),
        "closed after {idle_for:?}, before its keepalive_timeout"
    );
}

#[test]
fn a_connection_the_upstream_closed_while_idle_is_not_reused() {
    let (upstream, accepted, ended) =
        watching_upstream(Duration::ZERO, Some(Duration::from_millis(100)));
    let sluice = Sluice::start(&pool_config(upstream.addr, ""));
    for round in 1..=3 {
        // Each answer is a 200 although the pooled connection was closed by the upstream.
        request_on_new_connection(sluice.addr);
        assert_eq!(wait_for(&ended, round, Duration::from_secs(5)), round);
        thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 3);
}

#[test]
fn the_pool_keeps_at_most_keepalive_idle_connections() {
    const AT_ONCE: usize = 5;
    let (upstream, accepted, ended) = watching_upstream(Duration::from_millis(300), None);
    let sluice = Sluice::start(&pool_config(upstream.addr, "keepalive = 2"));
    let addr = sluice.addr;
    let clients: Vec<_> = (0..AT_ONCE)
        .map(|_| thread::spawn(move || request_on_new_connection(addr)))
        .collect();
    for client in clients {
        client.join().expect("client thread");
    }
    assert_eq!(accepted.load(Ordering::SeqCst), AT_ONCE);
    // Past the pool's size, the connections released first are closed as the others come
    // back; two stay open for the next requests.
    assert_eq!(
        wait_for(&ended, AT_ONCE - 2, Duration::from_secs(5)),
        AT_ONCE - 2
    );
    thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        ended.load(Ordering::SeqCst),
        AT_ONCE - 2,
        "a kept connection was closed"
    );
    request_on_new_connection(addr);
    request_on_new_connection(addr);
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        AT_ONCE,
        "a kept connection was not reused"
    );
}

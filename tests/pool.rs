//! Upstream connection reuse (DESIGN §18): with more concurrent requests than Pingora's
//! default pool held (128), every upstream connection is kept for the next request, so the
//! upstream sees no more connections than the peak concurrency.

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

/// A keep-alive upstream answering 200 to every request, counting the connections it accepts.
fn counting_upstream() -> (Listening, Arc<AtomicUsize>) {
    let accepted = Arc::new(AtomicUsize::new(0));
    let seen = accepted.clone();
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind upstream");
    let listening = Listening::serve(listener, move |conn: TcpStream| {
        seen.fetch_add(1, Ordering::SeqCst);
        let mut reader = BufReader::new(conn.try_clone().expect("clone stream"));
        let mut conn = conn;
        while read_request(&mut reader).is_some() {
            if conn
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
                .is_err()
            {
                return;
            }
        }
    });
    (listening, accepted)
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
    let (upstream, accepted) = counting_upstream();
    let sluice = Sluice::start(&format!(
        r#"
[server]
listen = ["{{listen}}"]
threads = 1
access_log = "off"
[admin]
listen = "{{admin}}"
[upstreams.u]
servers = ["{}"]
[[routes]]
name = "all"
upstream = "u"
"#,
        upstream.addr
    ));
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

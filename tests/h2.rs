//! HTTP/2 from clients end to end (DESIGN §8): curl over TLS (ALPN h2) and with prior
//! knowledge (h2c), and a Rust `h2` client, see the limits, headers and 429 bodies that
//! HTTP/1.1 sees; each stream of one connection is decided on its own.

mod common;

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::Duration;

use common::{free_port, http, tls_files, Sluice, TempDir};

/// A config with a cleartext listener (h2c on), a TLS listener on `tls_port` with the
/// certificate in `dir`, and a route `/hello` under a fixed window of `limit` per minute,
/// keyed by the `x-client` header so each client below has its own bucket.
fn config(tls_port: u16, dir: &TempDir, limit: u32) -> String {
    let d = dir.0.display();
    format!(
        r#"
[server]
listen = ["{{listen}}"]
tls_listen = ["127.0.0.1:{tls_port}"]
h2c = true
access_log = "json"
[admin]
listen = "{{admin}}"
[[certificates]]
hosts = ["sluice.test"]
cert = "{d}/srv.pem"
key = "{d}/srv.key"
[policies.per_client]
algorithm = "fixed_window"
limit = {limit}
period = "1m"
key = ["header:x-client"]
[[routes]]
name = "hello"
path = "/hello"
respond = {{ status = 200, body = "hello\n" }}
policies = ["per_client"]
"#
    )
}

fn start(limit: u32) -> (Sluice, u16, TempDir) {
    let dir = TempDir::new();
    tls_files(&dir.0, "IP:127.0.0.1");
    let tls_port = free_port();
    let s = Sluice::start(&config(tls_port, &dir, limit));
    let up = s.wait_for(Duration::from_secs(10), || {
        TcpStream::connect(("127.0.0.1", tls_port)).is_ok()
    });
    assert!(up, "TLS listener on {tls_port} not up: {}", s.stderr());
    (s, tls_port, dir)
}

/// One answer, whatever the client: status, lower-case headers, body.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: HashMap<String, String>,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> &str {
        self.headers.get(name).map_or("", String::as_str)
    }

    /// What must be equal across protocols: status, body and the rate-limit headers
    /// (without `t=` and Retry-After's value, which move with the clock).
    fn comparable(&self) -> String {
        let without_t: String = self
            .header("ratelimit")
            .split(';')
            .filter(|p| !p.starts_with("t="))
            .collect::<Vec<_>>()
            .join(";");
        format!(
            "{} | {} | {} | {} | retry-after={} | {}",
            self.status,
            self.header("content-type"),
            self.header("ratelimit-policy"),
            without_t,
            !self.header("retry-after").is_empty(),
            self.body
        )
    }
}

/// A request over curl with `args` (e.g. `--http2-prior-knowledge`); asserts the HTTP
/// version curl used.
fn curl(url: &str, client: &str, args: &[&str], version: &str) -> Answer {
    let out = Command::new("curl")
        .args(["-s", "-i", "--max-time", "5", "-H"])
        .arg(format!("x-client: {client}"))
        .args(["-w", "\n%{http_version}"])
        .args(args)
        .arg(url)
        .output()
        .expect("curl with HTTP/2 is needed: apt-get install curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (response, used) = text.rsplit_once('\n').expect("curl output");
    assert_eq!(
        used, version,
        "curl {args:?} {url} used HTTP/{used}: {text}"
    );
    let (head, body) = response.split_once("\r\n\r\n").expect("a response");
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Answer {
        status,
        headers,
        body: body.to_owned(),
    }
}

fn http1(addr: SocketAddr, client: &str) -> Answer {
    let r = http::get(addr, "/hello", &[("x-client", client)]);
    Answer {
        status: r.status,
        headers: r
            .headers
            .iter()
            .map(|(k, v)| (k.to_ascii_lowercase(), v.clone()))
            .collect(),
        body: r.body,
    }
}

/// Sends `n` GET /hello at once as streams of ONE prior-knowledge HTTP/2 connection with the
/// Rust `h2` client; `during` runs while the connection is still open, after the answers.
fn h2_streams(addr: SocketAddr, client: &str, n: usize, during: impl FnOnce()) -> Vec<Answer> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    rt.block_on(async {
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (send, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
        let driver = tokio::spawn(connection);
        // Until the server's SETTINGS arrive the client assumes no stream limit, and streams
        // beyond the server's (100) would be refused: one answered request first guarantees
        // they have. It matches no route, so it counts under `unmatched`, not `hello`.
        let warm_up = ::http::Request::get(format!("http://{addr}/warm-up"))
            .body(())
            .expect("a request");
        let (response, _) = send
            .clone()
            .ready()
            .await
            .expect("a stream slot")
            .send_request(warm_up, true)
            .expect("send");
        assert_eq!(response.await.expect("a response").status(), 404);
        let mut streams = Vec::new();
        for _ in 0..n {
            let send = send.clone();
            let req = ::http::Request::get(format!("http://{addr}/hello"))
                .header("x-client", client)
                .body(())
                .expect("a request");
            streams.push(tokio::spawn(async move {
                let mut send = send.ready().await.expect("a stream slot");
                let (response, _) = send.send_request(req, true).expect("send");
                let (parts, mut body) = response.await.expect("a response").into_parts();
                let mut data = Vec::new();
                while let Some(chunk) = body.data().await {
                    let chunk = chunk.expect("body data");
                    let _ = body.flow_control().release_capacity(chunk.len());
                    data.extend_from_slice(&chunk);
                }
                Answer {
                    status: parts.status.as_u16(),
                    headers: parts
                        .headers
                        .iter()
                        .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("").to_owned()))
                        .collect(),
                    body: String::from_utf8_lossy(&data).into_owned(),
                }
            }));
        }
        let mut answers = Vec::new();
        for s in streams {
            answers.push(s.await.expect("stream task"));
        }
        during();
        drop(send);
        driver.abort();
        answers
    })
}

#[test]
fn http2_over_tls_and_h2c_sees_what_http1_sees() {
    let (s, tls_port, dir) = start(2);
    let ca = dir.0.join("ca.pem");
    let ca = ca.to_str().expect("path");
    let plain = format!("http://{}/hello", s.addr);
    let tls = format!("https://127.0.0.1:{tls_port}/hello");

    let by_http1: Vec<Answer> = (0..3).map(|_| http1(s.addr, "one")).collect();
    let by_curl_tls: Vec<Answer> = (0..3)
        .map(|_| curl(&tls, "two", &["--http2", "--cacert", ca], "2"))
        .collect();
    let by_curl_h2c: Vec<Answer> = (0..3)
        .map(|_| curl(&plain, "three", &["--http2-prior-knowledge"], "2"))
        .collect();
    let by_curl_http1_tls: Vec<Answer> = (0..3)
        .map(|_| curl(&tls, "four", &["--http1.1", "--cacert", ca], "1.1"))
        .collect();
    let mut by_rust_h2 = Vec::new();
    for _ in 0..3 {
        by_rust_h2.extend(h2_streams(s.addr, "five", 1, || {}));
    }

    let expected: Vec<String> = by_http1.iter().map(Answer::comparable).collect();
    assert_eq!(
        by_http1.iter().map(|a| a.status).collect::<Vec<_>>(),
        [200, 200, 429]
    );
    assert!(expected[0].contains("\"per_client\";r=1"), "{expected:?}");
    assert!(
        by_http1[2]
            .body
            .contains("\"violated-policies\":[\"per_client\"]"),
        "{}",
        by_http1[2].body
    );
    for (name, answers) in [
        ("curl --http2 over TLS", &by_curl_tls),
        ("curl --http2-prior-knowledge", &by_curl_h2c),
        ("curl --http1.1 over TLS", &by_curl_http1_tls),
        ("Rust h2 client (h2c)", &by_rust_h2),
    ] {
        let seen: Vec<String> = answers.iter().map(Answer::comparable).collect();
        assert_eq!(seen, expected, "{name}");
    }

    // Counted by protocol; the access log names it too.
    let m = |protocol: &str, status: u16| {
        s.metric(&format!(
            r#"sluice_http_requests_total{{protocol="{protocol}",route="hello",status="{status}"}}"#
        ))
    };
    assert_eq!(m("h2", 200), 6.0, "{}", s.metrics());
    assert_eq!(m("h2", 429), 3.0);
    assert_eq!(m("http1", 200), 4.0);
    assert_eq!(m("http1", 429), 2.0);
    let log = s.stdout();
    let h2_lines = log
        .lines()
        .filter(|l| l.contains(r#""protocol":"h2""#) && l.contains(r#""route":"hello""#))
        .count();
    assert_eq!(h2_lines, 9, "{log}");
}

#[test]
fn two_hundred_streams_on_one_connection_against_a_limit_of_50_admit_exactly_50() {
    let (s, _, _dir) = start(50);
    let gauge =
        |protocol: &str| s.metric(&format!(r#"sluice_connections{{protocol="{protocol}"}}"#));
    let mut open = (0.0, 0.0);
    let answers = h2_streams(s.addr, "many", 200, || {
        open = (gauge("h2"), gauge("http1"));
    });
    assert_eq!(answers.len(), 200);
    let admitted = answers.iter().filter(|a| a.status == 200).count();
    let rejected: Vec<&Answer> = answers.iter().filter(|a| a.status == 429).collect();
    assert_eq!(admitted, 50);
    assert_eq!(rejected.len(), 150);
    for a in rejected {
        assert_eq!(a.header("content-type"), "application/problem+json");
        assert!(
            a.body
                .contains("quota-exceeded\",\"title\":\"Too Many Requests\",\"status\":429"),
            "{}",
            a.body
        );
        assert!(a.header("ratelimit").contains("\"per_client\";r=0"));
        assert!(!a.header("retry-after").is_empty());
    }
    // One client connection, recognised as h2 by its preface (h2c prior knowledge).
    assert_eq!(open, (1.0, 0.0), "sluice_connections while open");
    assert_eq!(
        s.metric(r#"sluice_http_requests_total{protocol="h2",route="hello",status="200"}"#),
        50.0
    );
}

#[test]
fn h2c_off_keeps_cleartext_listeners_http1_only() {
    let template = "[server]\nlisten = [\"{listen}\"]\naccess_log = \"off\"\n[admin]\nlisten = \"{admin}\"\n[[routes]]\nname = \"hello\"\npath = \"/hello\"\nrespond = { status = 200, body = \"hello\\n\" }\n";
    let s = Sluice::start(template);
    let out = Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--max-time",
            "5",
        ])
        .arg("--http2-prior-knowledge")
        .arg(format!("http://{}/hello", s.addr))
        .output()
        .expect("curl with HTTP/2 is needed: apt-get install curl");
    assert_ne!(String::from_utf8_lossy(&out.stdout), "200");
    assert_eq!(s.get("/hello").status, 200);
}

#[test]
fn h2c_tells_http1_apart_at_once_a_stalled_preface_meets_header_timeout_and_idle_h2_closes() {
    let template = "[server]\nlisten = [\"{listen}\"]\nh2c = true\nheader_timeout = \"300ms\"\nidle_timeout = \"500ms\"\naccess_log = \"off\"\n[admin]\nlisten = \"{admin}\"\n[[routes]]\nname = \"hello\"\npath = \"/hello\"\nrespond = { status = 200, body = \"hello\\n\" }\n";
    let s = Sluice::start(template);
    // Shorter than the 24-byte preface: answered at once, not after a wait for more bytes.
    let started = std::time::Instant::now();
    let raw = http::send_raw_within(
        s.addr,
        b"GET /hello HTTP/1.0\r\n\r\n",
        Duration::from_secs(5),
    )
    .expect("an answer");
    let answer = String::from_utf8_lossy(&raw);
    assert!(
        answer.starts_with("HTTP/1.0 200") || answer.starts_with("HTTP/1.1 200"),
        "{answer}"
    );
    assert!(
        started.elapsed() < Duration::from_millis(250),
        "{:?}",
        started.elapsed()
    );
    // Half a preface, then nothing: closed at header_timeout and counted.
    let started = std::time::Instant::now();
    let raw = http::send_raw_within(s.addr, b"PRI * HTTP/2.0\r\n", Duration::from_secs(5))
        .expect("the connection closes");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}: {}",
        started.elapsed(),
        String::from_utf8_lossy(&raw)
    );
    assert!(s.wait_for(Duration::from_secs(2), || {
        s.metric(r#"sluice_connections_rejected_total{reason="header_timeout"}"#) == 1.0
    }));
    // An HTTP/2 connection without streams is closed after idle_timeout (and not before
    // header_timeout would have cut an HTTP/1 one: the preface read ends that deadline).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let idle = rt.block_on(async {
        let tcp = tokio::net::TcpStream::connect(s.addr)
            .await
            .expect("connect");
        let (_send, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
        let started = tokio::time::Instant::now();
        let closed = tokio::time::timeout(Duration::from_secs(3), connection).await;
        (closed.is_ok(), started.elapsed())
    });
    assert!(idle.0, "an idle h2c connection stayed open");
    assert!(
        idle.1 >= Duration::from_millis(400),
        "closed too early: {:?}",
        idle.1
    );
}

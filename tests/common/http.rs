//! A tiny HTTP/1.1 client and upstream server over std sockets: tests see raw bytes.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    /// Lower-case names; repeated headers joined with ", ".
    pub headers: HashMap<String, String>,
    pub body: String,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(&name.to_ascii_lowercase())
            .map(String::as_str)
    }
}

/// Sends raw request bytes and reads the whole response (the request should close).
pub fn send_raw(addr: SocketAddr, raw: &[u8]) -> std::io::Result<Vec<u8>> {
    send_raw_within(addr, raw, Duration::from_secs(15))
}

/// `send_raw`, giving up on the answer after `wait`.
pub fn send_raw_within(addr: SocketAddr, raw: &[u8], wait: Duration) -> std::io::Result<Vec<u8>> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(wait))?;
    s.write_all(raw)?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)?;
    Ok(out)
}

pub fn parse(raw: &[u8]) -> Response {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let mut headers: HashMap<String, String> = HashMap::new();
    for line in lines {
        if let Some((k, v)) = line.split_once(':') {
            headers
                .entry(k.trim().to_ascii_lowercase())
                .and_modify(|e| {
                    e.push_str(", ");
                    e.push_str(v.trim());
                })
                .or_insert_with(|| v.trim().to_owned());
        }
    }
    let body = if headers
        .get("transfer-encoding")
        .is_some_and(|v| v.contains("chunked"))
    {
        dechunk(body)
    } else {
        body.to_owned()
    };
    Response {
        status,
        headers,
        body,
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// GET `path` with extra headers; `Host` defaults to "localhost".
pub fn get(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Response {
    request(addr, "GET", path, headers, "")
}

pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Response {
    let mut raw = format!("{method} {path} HTTP/1.1\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        raw.push_str("Host: localhost\r\n");
    }
    for (k, v) in headers {
        raw.push_str(&format!("{k}: {v}\r\n"));
    }
    raw.push_str(&format!(
        "Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    ));
    match send_raw(addr, raw.as_bytes()) {
        Ok(bytes) => parse(&bytes),
        Err(e) => Response {
            status: 0,
            headers: HashMap::new(),
            body: e.to_string(),
        },
    }
}

/// An upstream that answers every request with 200 and a body naming itself and echoing
/// the request: "NAME METHOD PATH?QUERY xff=X-FORWARDED-FOR body=N". `GET /healthz` is
/// answered apart, with the status in `health` (200 at first), and not counted in `hits`.
pub struct Upstream {
    pub addr: SocketAddr,
    pub hits: Arc<AtomicUsize>,
    pub health: Arc<AtomicU16>,
    /// `GET /healthz` requests answered.
    pub health_checks: Arc<AtomicUsize>,
    _listening: Listening,
}

impl Upstream {
    pub fn start(name: &str) -> Upstream {
        Self::start_with_delay(name, Duration::ZERO)
    }

    /// Each response is sent after `delay` (for in-flight and drain tests).
    pub fn start_with_delay(name: &str, delay: Duration) -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind upstream");
        Self::serve_on(listener, name, delay)
    }

    /// Listens on `addr` (e.g. one a test chose before the server was up).
    pub fn start_at(name: &str, addr: SocketAddr) -> Upstream {
        let listener = TcpListener::bind(addr).expect("bind upstream at its address");
        Self::serve_on(listener, name, Duration::ZERO)
    }

    fn serve_on(listener: TcpListener, name: &str, delay: Duration) -> Upstream {
        let hits = Arc::new(AtomicUsize::new(0));
        let health = Arc::new(AtomicU16::new(200));
        let health_checks = Arc::new(AtomicUsize::new(0));
        let (name, h) = (name.to_owned(), hits.clone());
        let hs = (health.clone(), health_checks.clone());
        let listening = Listening::serve(listener, move |conn| serve(conn, &name, &h, &hs, delay));
        Upstream {
            addr: listening.addr,
            hits,
            health,
            health_checks,
            _listening: listening,
        }
    }

    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

fn serve(
    conn: TcpStream,
    name: &str,
    hits: &AtomicUsize,
    (health, checks): &(Arc<AtomicU16>, Arc<AtomicUsize>),
    delay: Duration,
) {
    let mut reader = BufReader::new(conn.try_clone().expect("clone stream"));
    let mut conn = conn;
    while let Some(req) = read_request(&mut reader) {
        let (method, target, length) = (&req.method, &req.target, req.body.len());
        let xff = req.header("x-forwarded-for").unwrap_or("");
        if target == "/healthz" {
            checks.fetch_add(1, Ordering::SeqCst);
            let status = health.load(Ordering::SeqCst);
            let resp = format!("HTTP/1.1 {status} Health\r\nContent-Length: 0\r\n\r\n");
            if conn.write_all(resp.as_bytes()).is_err() {
                return;
            }
            continue;
        }
        hits.fetch_add(1, Ordering::SeqCst);
        if !delay.is_zero() {
            thread::sleep(delay);
        }
        let text = format!("{name} {method} {target} xff={xff} body={length}\n");
        let resp = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n{text}",
            text.len()
        );
        if conn.write_all(resp.as_bytes()).is_err() {
            return;
        }
    }
}

/// A test server's listening socket, served on a thread (one more thread per connection)
/// until dropped.
pub struct Listening {
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl Listening {
    /// Serves every connection on `listener` with `handle` until this is dropped.
    pub fn serve(
        listener: TcpListener,
        handle: impl Fn(TcpStream) + Clone + Send + 'static,
    ) -> Listening {
        let addr = listener.local_addr().expect("test server address");
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        thread::spawn(move || {
            for conn in listener.incoming() {
                if st.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(conn) = conn else { continue };
                let handle = handle.clone();
                thread::spawn(move || handle(conn));
            }
        });
        Listening { addr, stop }
    }
}

impl Drop for Listening {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
    }
}

/// A test upstream that answers each request it reads with `answer` (false: the
/// connection ends) and counts them.
pub struct Scripted {
    pub addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    _listening: Listening,
}

impl Scripted {
    pub fn start(answer: fn(&mut TcpStream, &Request) -> bool) -> Scripted {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the upstream");
        let hits = Arc::new(AtomicUsize::new(0));
        let counted = hits.clone();
        let listening = Listening::serve(listener, move |conn| {
            let mut reader = BufReader::new(conn.try_clone().expect("clone stream"));
            let mut conn = conn;
            while let Some(req) = read_request(&mut reader) {
                counted.fetch_add(1, Ordering::SeqCst);
                if !answer(&mut conn, &req) {
                    return;
                }
            }
        });
        Scripted {
            addr: listening.addr,
            hits,
            _listening: listening,
        }
    }

    /// Requests read so far.
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

/// One request as a test server reads it.
pub struct Request {
    pub method: String,
    pub target: String,
    /// Lower-case names, in order, repeated ones kept.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Reads the next request (with its Content-Length body); None when the connection ends.
pub fn read_request(reader: &mut impl BufRead) -> Option<Request> {
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_owned();
    let target = parts.next().unwrap_or("").to_owned();
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 {
            return None;
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
        }
    }
    let length = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    reader.read_exact(&mut body).ok()?;
    Some(Request {
        method,
        target,
        headers,
        body,
    })
}

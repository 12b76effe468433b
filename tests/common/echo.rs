//! An upstream that shows what it was sent (tests of identity headers, header rules,
//! rewritten paths and request ids).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;

use serde_json::{json, Value};

use super::http::Response;

/// An upstream that answers every request with 200 and a JSON body of what it received:
/// `{"target": "/path?query", "headers": {"lower-case-name": "value, value"}}`.
pub struct EchoUpstream {
    pub addr: SocketAddr,
    pub hits: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl EchoUpstream {
    pub fn start() -> EchoUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the echo upstream");
        let addr = listener.local_addr().expect("echo upstream address");
        let hits = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (h, st) = (hits.clone(), stop.clone());
        thread::spawn(move || {
            for conn in listener.incoming() {
                if st.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(conn) = conn else { continue };
                let h = h.clone();
                thread::spawn(move || echo(conn, &h));
            }
        });
        EchoUpstream { addr, hits, stop }
    }

    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

impl Drop for EchoUpstream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
    }
}

fn echo(conn: TcpStream, hits: &AtomicUsize) {
    let mut reader = BufReader::new(conn.try_clone().expect("clone stream"));
    let mut conn = conn;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let target = line.split_whitespace().nth(1).unwrap_or("").to_owned();
        let mut headers: BTreeMap<String, String> = BTreeMap::new();
        let mut length = 0usize;
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                let (k, v) = (k.trim().to_ascii_lowercase(), v.trim().to_owned());
                if k == "content-length" {
                    length = v.parse().unwrap_or(0);
                }
                headers
                    .entry(k)
                    .and_modify(|e| {
                        e.push_str(", ");
                        e.push_str(&v);
                    })
                    .or_insert(v);
            }
        }
        let mut body = vec![0u8; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        hits.fetch_add(1, Ordering::SeqCst);
        let text = json!({"target": target, "headers": headers}).to_string();
        let resp = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{text}",
            text.len()
        );
        if conn.write_all(resp.as_bytes()).is_err() {
            return;
        }
    }
}

/// The header `name` as the upstream received it (from an EchoUpstream's answer).
pub fn upstream_saw(r: &Response, name: &str) -> Option<String> {
    let v: Value = serde_json::from_str(&r.body).unwrap_or_else(|e| {
        panic!(
            "not an echo from the upstream ({e}): {} {}",
            r.status, r.body
        )
    });
    v["headers"][name].as_str().map(str::to_owned)
}

/// The request target (path and query) the upstream received.
pub fn upstream_target(r: &Response) -> String {
    let v: Value = serde_json::from_str(&r.body).unwrap_or_else(|e| {
        panic!(
            "not an echo from the upstream ({e}): {} {}",
            r.status, r.body
        )
    });
    v["target"].as_str().unwrap_or_default().to_owned()
}

//! An upstream that shows what it was sent (tests of identity headers, header rules,
//! rewritten paths and request ids).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use serde_json::{json, Value};

use super::http::{read_request, Listening, Response};

/// An upstream that answers every request with 200 and a JSON body of what it received:
/// `{"target": "/path?query", "headers": {"lower-case-name": "value, value"}}`.
pub struct EchoUpstream {
    pub addr: SocketAddr,
    pub hits: Arc<AtomicUsize>,
    _listening: Listening,
}

impl EchoUpstream {
    pub fn start() -> EchoUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the echo upstream");
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        let listening = Listening::serve(listener, move |conn| echo(conn, &h));
        EchoUpstream {
            addr: listening.addr,
            hits,
            _listening: listening,
        }
    }

    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

fn echo(conn: TcpStream, hits: &AtomicUsize) {
    let mut reader = BufReader::new(conn.try_clone().expect("clone stream"));
    let mut conn = conn;
    while let Some(req) = read_request(&mut reader) {
        // Repeated headers joined with ", ", as one would read them.
        let mut headers: BTreeMap<String, String> = BTreeMap::new();
        for (k, v) in req.headers {
            headers
                .entry(k)
                .and_modify(|e| {
                    e.push_str(", ");
                    e.push_str(&v);
                })
                .or_insert(v);
        }
        hits.fetch_add(1, Ordering::SeqCst);
        let text = json!({"target": req.target, "headers": headers}).to_string();
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

//! The `sluice admin …` client: calls the `/v1/` API of a running sluice for operators, with
//! the admin address and token taken from the config file, so nobody hand-writes curl calls.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Duration;

use base64::Engine;

use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};

use crate::cli::{AdminCall, KeyAction};
use crate::config::Admin;

/// The answer of one call: its status and body (pretty-printed when it is JSON).
pub struct Answer {
    pub status: u16,
    pub body: String,
}

/// Makes `call` against the admin listener of `admin`.
pub fn call(admin: &Admin, call: &AdminCall) -> Result<Answer, String> {
    if let AdminCall::Token { .. } = call {
        return Err("`admin token` writes a file (`write_token`) and calls nothing".into());
    }
    let token = admin
        .token
        .as_ref()
        .ok_or("the config has no [admin] token_file: the admin API answers every call with 403")?;
    let (method, path, body) = request(call);
    let addr = reachable(admin.listen);
    let timeout = Duration::from_secs(10);
    let mut stream = TcpStream::connect_timeout(&addr, timeout)
        .map_err(|e| format!("cannot reach the admin listener at {addr}: {e}"))?;
    let _ = stream.set_read_timeout(Some(timeout));
    let _ = stream.set_write_timeout(Some(timeout));
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        token.0,
        body.len()
    );
    stream
        .write_all(head.as_bytes())
        .and_then(|()| stream.write_all(body.as_bytes()))
        .map_err(|e| format!("sending to {addr}: {e}"))?;
    let mut raw = Vec::new();
    stream
        .read_to_end(&mut raw)
        .map_err(|e| format!("reading from {addr}: {e}"))?;
    parse(&raw).ok_or_else(|| format!("{addr} did not answer HTTP"))
}

/// `sluice admin token FILE`: a new random 256-bit token (base64url, 43 characters) in a new
/// file readable by its owner only. An existing file is kept: a running sluice would go on
/// answering to the token it read, so replacing it is a deliberate `rm` first.
pub fn write_token(path: &Path) -> Result<(), String> {
    let secret: [u8; 32] = rand::random();
    let token = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(secret);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| writeln!(f, "{token}"))
        .map_err(|e| format!("cannot create {}: {e}", path.display()))
}

/// Method, path with query, and JSON body of `call`.
fn request(call: &AdminCall) -> (&'static str, String, String) {
    let keyed = |kind: &str, policy: &str, key: &[String]| {
        let query: Vec<String> = key
            .iter()
            .map(|v| format!("key={}", utf8_percent_encode(v, NON_ALPHANUMERIC)))
            .collect();
        format!(
            "/v1/{kind}/{}?{}",
            utf8_percent_encode(policy, NON_ALPHANUMERIC),
            query.join("&")
        )
    };
    match call {
        AdminCall::Quota { policy, key } => ("GET", keyed("quota", policy, key), String::new()),
        AdminCall::Reset { policy, key } => ("DELETE", keyed("quota", policy, key), String::new()),
        AdminCall::Policies => ("GET", "/v1/policies".to_owned(), String::new()),
        AdminCall::Overrides { policy } => (
            "GET",
            format!(
                "/v1/overrides/{}",
                utf8_percent_encode(policy, NON_ALPHANUMERIC)
            ),
            String::new(),
        ),
        AdminCall::Override {
            policy,
            key,
            delete: true,
            ..
        } => ("DELETE", keyed("overrides", policy, key), String::new()),
        AdminCall::Override {
            policy,
            key,
            limit,
            burst,
            period,
            ttl,
            delete: false,
        } => {
            let mut body = serde_json::json!({ "limit": limit });
            if let Some(burst) = burst {
                body["burst"] = (*burst).into();
            }
            if let Some(period) = period {
                body["period"] = period.as_str().into();
            }
            if let Some(ttl) = ttl {
                body["ttl"] = ttl.as_str().into();
            }
            ("PUT", keyed("overrides", policy, key), body.to_string())
        }
        AdminCall::Consumers => ("GET", "/v1/consumers".to_owned(), String::new()),
        AdminCall::Consumer {
            name, delete: true, ..
        } => ("DELETE", consumer_path(name, ""), String::new()),
        AdminCall::Consumer { name, plan, .. } => (
            "PUT",
            consumer_path(name, ""),
            serde_json::json!({ "plan": plan }).to_string(),
        ),
        AdminCall::Key {
            action: KeyAction::Create { name },
        } => ("POST", consumer_path(name, "/keys"), String::new()),
        AdminCall::Key {
            action: KeyAction::Revoke { name, id },
        } => (
            "DELETE",
            consumer_path(
                name,
                &format!("/keys/{}", utf8_percent_encode(id, NON_ALPHANUMERIC)),
            ),
            String::new(),
        ),
        // Never sent: `call` refuses it, and main.rs writes the file before reading a config.
        AdminCall::Token { .. } => ("GET", String::new(), String::new()),
        AdminCall::Top { policy, n } => (
            "GET",
            format!(
                "/v1/top/{}?n={n}",
                utf8_percent_encode(policy, NON_ALPHANUMERIC)
            ),
            String::new(),
        ),
    }
}

fn consumer_path(name: &str, rest: &str) -> String {
    format!(
        "/v1/consumers/{}{rest}",
        utf8_percent_encode(name, NON_ALPHANUMERIC)
    )
}

/// A listener bound to every address is reached on loopback.
fn reachable(listen: SocketAddr) -> SocketAddr {
    match listen.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(Ipv4Addr::LOCALHOST.into(), listen.port())
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(Ipv6Addr::LOCALHOST.into(), listen.port())
        }
        _ => listen,
    }
}

fn parse(raw: &[u8]) -> Option<Answer> {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let body = match serde_json::from_str::<serde_json::Value>(body) {
        Ok(json) => serde_json::to_string_pretty(&json).unwrap_or_else(|_| body.to_owned()),
        Err(_) => body.to_owned(),
    };
    Some(Answer { status, body })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_become_requests() {
        let key = vec!["203.0.113.9".to_owned(), "a b/c".to_owned()];
        let (m, p, b) = request(&AdminCall::Quota {
            policy: "per_ip".into(),
            key: key.clone(),
        });
        assert_eq!(
            (m, p.as_str(), b.as_str()),
            (
                "GET",
                "/v1/quota/per%5Fip?key=203%2E0%2E113%2E9&key=a%20b%2Fc",
                ""
            )
        );
        let (m, p, b) = request(&AdminCall::Override {
            policy: "p".into(),
            key: vec!["k".into()],
            limit: Some(10),
            burst: None,
            period: Some("1m".into()),
            ttl: Some("30d".into()),
            delete: false,
        });
        assert_eq!((m, p.as_str()), ("PUT", "/v1/overrides/p?key=k"));
        let body: serde_json::Value = serde_json::from_str(&b).unwrap_or_default();
        assert_eq!(
            body,
            serde_json::json!({"limit": 10, "period": "1m", "ttl": "30d"})
        );
        let (m, p, b) = request(&AdminCall::Override {
            policy: "p".into(),
            key: vec!["k".into()],
            limit: None,
            burst: None,
            period: None,
            ttl: None,
            delete: true,
        });
        assert_eq!(
            (m, p.as_str(), b.as_str()),
            ("DELETE", "/v1/overrides/p?key=k", "")
        );
    }

    #[test]
    fn answers_are_parsed() {
        let a =
            parse(b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\n{\"a\":1}").expect("answer");
        assert_eq!(a.status, 404);
        assert_eq!(a.body, "{\n  \"a\": 1\n}");
    }
}

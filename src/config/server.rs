//! `[server]` (listeners, client limits, logs) and `[admin]`: their types and readers.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use ipnet::IpNet;

use super::nets::NetSet;
use super::read::{header_name, socket_addr, Problems, Table};
use super::tree::{Node, Spanned};

#[derive(Debug, Clone)]
pub struct Server {
    /// Plain HTTP listeners; may be empty when `tls_listen` is not.
    pub listen: Vec<SocketAddr>,
    /// HTTPS listeners.
    pub tls_listen: Vec<SocketAddr>,
    pub threads: usize,
    pub grace_period: Duration,
    pub trusted_proxies: Vec<IpNet>,
    /// Lower-case header name.
    pub client_ip_header: String,
    pub access_log: AccessLog,
    pub headers: HeaderStyle,
    /// The whole request header must arrive within this (else 408 and close).
    pub header_timeout: Duration,
    /// Longest pause between two reads of a request body (else 408 and close).
    pub body_timeout: Duration,
    /// A keep-alive connection waiting for its next request is closed after this.
    pub idle_timeout: Duration,
    /// Bytes; 0 = unlimited. Routes may override it.
    pub max_request_body: u64,
    /// Open client connections one address may hold; 0 = unlimited.
    pub max_connections_per_ip: u32,
    /// Cleartext listeners also accept prior-knowledge HTTP/2 (read at start-up).
    pub h2c: bool,
    /// `request_id`: the header carrying each request's id (DESIGN §14); None = off.
    pub request_id: Option<http::HeaderName>,
    /// Repeated slashes in a path are merged before routing (DESIGN §17), as nginx's
    /// `merge_slashes on`.
    pub merge_slashes: bool,
    /// What a path's `%2F` or `%5C` (an encoded slash or backslash) gets (DESIGN §17).
    pub escaped_slashes: EscapedSlashes,
    /// Routes match paths with ASCII case ignored (DESIGN §21), for upstreams that do.
    pub case_insensitive_paths: bool,
    /// `max_failures` bans and `max_connections_per_ip` count an IPv6 client by its network
    /// of this many bits (DESIGN §21): one host has a /64, not one address.
    pub ipv6_prefix: u8,
    /// `resolvers`: the DNS servers of upstreams with `resolve` (DESIGN §20); empty: those of
    /// /etc/resolv.conf.
    pub resolvers: Vec<SocketAddr>,
    /// `deny`: client addresses (DESIGN §2.1) answered 403 before anything else (§20).
    pub deny: NetSet,
}

/// `[server] escaped_slashes`: an encoded slash or backslash in a path is kept as those
/// three characters, never decoded, or the request is refused with 400.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EscapedSlashes {
    Keep,
    Reject,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccessLog {
    Json,
    Text,
    Off,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderStyle {
    Ietf,
    Legacy,
    Off,
}

#[derive(Debug, Clone)]
pub struct Admin {
    pub listen: SocketAddr,
    /// The bearer token of the `/v1/` API, read from `token_file` at load (None: no file,
    /// every `/v1/` call answers 403).
    pub token: Option<Token>,
    /// Heavy-hitter slots per policy for `/v1/top` (0: off).
    pub top_keys: usize,
}

/// A secret that never shows in `Debug` output or logs.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(pub String);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(..)")
    }
}

impl Admin {
    pub const DEFAULT_TOP_KEYS: usize = 1000;
}

pub(super) fn server(p: &Problems, node: &Spanned<Node>) -> Option<Server> {
    let t = Table::new(p, "[server]", node)?;
    // (whether the key holds addresses or was already reported, the good addresses)
    let addresses = |key: &str| -> (bool, Vec<SocketAddr>) {
        let given = t.strings(key);
        let list = given
            .as_ref()
            .map(|v| v.iter().filter_map(|s| socket_addr(p, s, key)).collect())
            .unwrap_or_default();
        let wrong_type = given.is_none() && t.get(key).is_some();
        (wrong_type || given.is_some_and(|v| !v.is_empty()), list)
    };
    let (has_plain, listen) = addresses("listen");
    let (has_tls, tls_listen) = addresses("tls_listen");
    let (_, resolvers) = addresses("resolvers");
    if !has_plain && !has_tls {
        let at = if t.get("listen").is_some() {
            t.key_span("listen")
        } else {
            t.span.clone()
        };
        p.at(
            &at,
            "[server] needs at least one address in `listen` or `tls_listen`",
        );
    }
    let threads = t
        .int("threads", 1..=1024)
        .map(|n| n.value as usize)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let grace_period = t
        .duration("grace_period")
        .map_or(Duration::from_secs(5), |d| d.value);
    let trusted_proxies = t.cidrs("trusted_proxies");
    let deny = NetSet::new(t.cidrs("deny"));
    let client_ip_header = t
        .choice(
            "client_ip_header",
            &[
                ("x-forwarded-for", "x-forwarded-for"),
                ("x-real-ip", "x-real-ip"),
            ],
        )
        .unwrap_or("x-forwarded-for")
        .to_owned();
    let access_log = t
        .choice(
            "access_log",
            &[
                ("json", AccessLog::Json),
                ("text", AccessLog::Text),
                ("off", AccessLog::Off),
            ],
        )
        .unwrap_or(AccessLog::Json);
    let headers = t
        .choice(
            "headers",
            &[
                ("ietf", HeaderStyle::Ietf),
                ("legacy", HeaderStyle::Legacy),
                ("off", HeaderStyle::Off),
            ],
        )
        .unwrap_or(HeaderStyle::Ietf);
    let header_timeout = t.positive_duration("header_timeout", Duration::from_secs(10));
    let body_timeout = t.positive_duration("body_timeout", Duration::from_secs(30));
    let idle_timeout = t.positive_duration("idle_timeout", Duration::from_secs(60));
    let max_request_body = t.size("max_request_body").unwrap_or(0);
    let max_connections_per_ip = t
        .int("max_connections_per_ip", 0..=i64::from(u32::MAX))
        .map_or(0, |n| n.value as u32);
    let request_id = t
        .string("request_id")
        .filter(|s| !s.value.is_empty())
        .and_then(|s| header_name(p, &s, "request_id"));
    let h2c = t.bool("h2c").unwrap_or(false);
    let merge_slashes = t.bool("merge_slashes").unwrap_or(true);
    let escaped_slashes = t
        .choice(
            "escaped_slashes",
            &[
                ("keep", EscapedSlashes::Keep),
                ("reject", EscapedSlashes::Reject),
            ],
        )
        .unwrap_or(EscapedSlashes::Keep);
    let case_insensitive_paths = t.bool("case_insensitive_paths").unwrap_or(false);
    let ipv6_prefix = t.int("ipv6_prefix", 48..=128).map_or(64, |n| n.value as u8);
    if h2c && !has_plain {
        p.at(
            &t.key_span("h2c"),
            "`h2c` applies to cleartext listeners: it needs an address in `listen`",
        );
    }
    t.finish();
    Some(Server {
        listen,
        tls_listen,
        threads,
        grace_period,
        trusted_proxies,
        client_ip_header,
        access_log,
        headers,
        header_timeout,
        body_timeout,
        idle_timeout,
        max_request_body,
        max_connections_per_ip,
        h2c,
        request_id,
        merge_slashes,
        escaped_slashes,
        case_insensitive_paths,
        ipv6_prefix,
        resolvers,
        deny,
    })
}

pub(super) fn admin(p: &Problems, node: &Spanned<Node>, dir: &Path) -> Option<Admin> {
    let t = Table::new(p, "[admin]", node)?;
    let listen = t.required("listen").and_then(|_| t.string("listen"));
    // Read now, so a reload picks up a new token and a missing file is a located error.
    let token = t.string("token_file").and_then(|path| {
        match std::fs::read_to_string(dir.join(&path.value)) {
            Ok(text) => {
                let line = text.lines().next().unwrap_or("").trim().to_owned();
                if line.is_empty() {
                    p.at(
                        &path.span,
                        format!("`token_file`: {} holds no token", path.value),
                    );
                    None
                } else {
                    Some(Token(line))
                }
            }
            Err(e) => {
                p.at(
                    &path.span,
                    format!("`token_file`: cannot read {}: {e}", path.value),
                );
                None
            }
        }
    });
    let top_keys = t
        .int("top_keys", 0..=1_000_000)
        .map_or(Admin::DEFAULT_TOP_KEYS, |n| n.value as usize);
    t.finish();
    Some(Admin {
        listen: socket_addr(p, &listen?, "listen")?,
        token,
        top_keys,
    })
}

//! `[upstreams.NAME]`: servers, balancing, timeouts and health checks.

use std::path::Path;
use std::time::Duration;

use super::adaptive::{adaptive, Adaptive};
use super::read::{check_name, Problems, Table};
use super::retries::{retries, Retries};
use super::tree::{Node, Spanned};
use super::upstream_tls::{upstream_tls, UpstreamTls};

/// Idle connections kept per upstream and worker thread unless `keepalive` says otherwise:
/// enough that a proxy at a thousand concurrent requests never closes one it needs again.
pub const DEFAULT_KEEPALIVE: usize = 1024;
const MAX_KEEPALIVE: i64 = 1 << 20;

#[derive(Debug, Clone)]
pub struct Upstream {
    pub name: String,
    pub servers: Vec<String>,
    pub balance: Balance,
    pub tls: bool,
    pub sni: String,
    pub connect_timeout: Duration,
    pub read_timeout: Duration,
    /// Active checks; `None`: servers are only judged by the requests they serve.
    pub health_check: Option<HealthCheck>,
    /// Passive checks (nginx's names): this many consecutive connect errors or timeouts
    /// take a server out for `fail_timeout`.
    pub max_fails: u32,
    pub fail_timeout: Duration,
    /// `keepalive`: idle connections to this upstream each worker thread keeps for reuse
    /// (nginx's `keepalive`); read at start-up (the pools are sized then).
    pub keepalive: usize,
    /// `keepalive_timeout`: an idle pooled connection is closed after this.
    pub keepalive_timeout: Duration,
    pub protocol: UpstreamProtocol,
    /// `ca_file`, `client_cert`, `client_key` (DESIGN §20), read from their files.
    pub tls_files: UpstreamTls,
    /// `retries` (DESIGN §20); `None`: only a failed connect moves to another server.
    pub retries: Option<Retries>,
    /// `resolve`: server hostnames are re-resolved this often (DESIGN §20); `None`: only at
    /// load and reload.
    pub resolve: Option<Duration>,
    /// `[upstreams.NAME.adaptive]` (DESIGN §22): a concurrency limit learnt from latency;
    /// `None`: requests are not held back for this upstream's sake.
    pub adaptive: Option<Adaptive>,
}

/// What an upstream speaks: HTTP/2 is over TLS with ALPN, or prior-knowledge h2c without.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamProtocol {
    Http1,
    H2,
}

/// `health_check = { interval, path, timeout }` of an upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheck {
    pub interval: Duration,
    /// `Some`: an HTTP GET of this path, healthy on 2xx/3xx; `None`: a TCP connect.
    pub path: Option<String>,
    /// The whole check (connect, request, response header and body) must end within this.
    pub timeout: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Balance {
    RoundRobin,
    Random,
    Hash,
}

pub(super) fn upstream(
    p: &Problems,
    name: &Spanned<String>,
    node: &Spanned<Node>,
    dir: &Path,
) -> Option<Upstream> {
    check_name(p, name, "upstream");
    let t = Table::new(p, &format!("[upstreams.{}]", name.value), node)?;
    let servers: Vec<String> = t
        .required("servers")
        .and_then(|_| t.strings("servers"))
        .unwrap_or_default()
        .into_iter()
        .filter_map(|s| {
            let ok = s.value.rsplit_once(':').is_some_and(|(host, port)| {
                !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0)
            });
            if !ok {
                p.at(
                    &s.span,
                    format!("`servers`: bad server \"{}\" (expected HOST:PORT)", s.value),
                );
            }
            ok.then_some(s.value)
        })
        .collect();
    if servers.is_empty() && t.get("servers").is_some() {
        p.at(
            &t.key_span("servers"),
            "`servers` needs at least one HOST:PORT",
        );
    }
    let balance = t
        .choice(
            "balance",
            &[
                ("round_robin", Balance::RoundRobin),
                ("random", Balance::Random),
                ("hash", Balance::Hash),
            ],
        )
        .unwrap_or(Balance::RoundRobin);
    let tls = t.bool("tls").unwrap_or(false);
    let sni = t.string("sni").map(|s| s.value).unwrap_or_default();
    let protocol = t
        .choice(
            "protocol",
            &[
                ("http1", UpstreamProtocol::Http1),
                ("h2", UpstreamProtocol::H2),
            ],
        )
        .unwrap_or(UpstreamProtocol::Http1);
    let connect_timeout = t
        .duration("connect_timeout")
        .map_or(Duration::from_secs(2), |d| d.value);
    let read_timeout = t
        .duration("read_timeout")
        .map_or(Duration::from_secs(30), |d| d.value);
    for (key, d) in [
        ("connect_timeout", connect_timeout),
        ("read_timeout", read_timeout),
    ] {
        if d.is_zero() {
            p.at(&t.key_span(key), format!("`{key}` must be at least 1ms"));
        }
    }
    let health_check = t
        .get("health_check")
        .and_then(|node| health_check(p, &name.value, node, connect_timeout));
    let max_fails = t
        .int("max_fails", 1..=i64::MAX)
        .map_or(1, |n| u32::try_from(n.value).unwrap_or(u32::MAX));
    let fail_timeout = t.positive_duration("fail_timeout", Duration::from_secs(10));
    let keepalive = t
        .int("keepalive", 1..=MAX_KEEPALIVE)
        .map_or(DEFAULT_KEEPALIVE, |n| n.value as usize);
    let keepalive_timeout = t.positive_duration("keepalive_timeout", Duration::from_secs(60));
    let resolve = resolve(p, &t, &servers);
    let tls_files = upstream_tls(p, &t, dir, tls);
    let retries = t
        .get("retries")
        .and_then(|node| retries(p, &name.value, node));
    let adaptive = t
        .get("adaptive")
        .and_then(|node| adaptive(p, &name.value, node));
    t.finish();
    Some(Upstream {
        name: name.value.clone(),
        servers,
        balance,
        tls,
        sni,
        connect_timeout,
        read_timeout,
        health_check,
        max_fails,
        fail_timeout,
        keepalive,
        keepalive_timeout,
        protocol,
        tls_files,
        retries,
        resolve,
        adaptive,
    })
}

/// `resolve = "30s"`: at least 1s; a warning when every server is an IP address.
fn resolve(p: &Problems, t: &Table, servers: &[String]) -> Option<Duration> {
    let d = t.duration("resolve")?;
    if d.value < Duration::from_secs(1) {
        p.at(&d.span, "`resolve` must be at least 1s");
        return None;
    }
    let literal = |s: &String| {
        s.rsplit_once(':').is_some_and(|(host, _)| {
            host.trim_start_matches('[')
                .trim_end_matches(']')
                .parse::<std::net::IpAddr>()
                .is_ok()
        })
    };
    if !servers.is_empty() && servers.iter().all(literal) {
        p.warn(
            &d.span,
            "`resolve`: every server is an IP address, there is nothing to re-resolve",
        );
    }
    Some(d.value)
}

/// `health_check = { interval, path, timeout }`; `timeout` defaults to the smaller of
/// `connect_timeout` and `interval`.
fn health_check(
    p: &Problems,
    upstream: &str,
    node: &Spanned<Node>,
    connect_timeout: Duration,
) -> Option<HealthCheck> {
    let h = Table::new(
        p,
        &format!("`health_check` of [upstreams.{upstream}]"),
        node,
    )?;
    let interval = h.required("interval").and_then(|_| h.duration("interval"));
    if interval.as_ref().is_some_and(|d| d.value.is_zero()) {
        p.at(&h.key_span("interval"), "`interval` must be at least 1ms");
    }
    let path = h.string("path");
    if let Some(path) = &path {
        // It becomes a request line: an origin-form target, nothing else.
        let origin_form = path.value.starts_with('/')
            && path.value.parse::<http::uri::PathAndQuery>().is_ok()
            && !path.value.contains('#');
        if !origin_form {
            p.at(
                &path.span,
                format!(
                    "`path`: bad health check path \"{}\" (expected a path starting with '/', e.g. \"/healthz\")",
                    path.value
                ),
            );
        }
    }
    let timeout = h.duration("timeout");
    if timeout.as_ref().is_some_and(|d| d.value.is_zero()) {
        p.at(&h.key_span("timeout"), "`timeout` must be at least 1ms");
    }
    h.finish();
    let interval = interval?.value;
    Some(HealthCheck {
        interval,
        path: path.map(|s| s.value),
        timeout: timeout.map_or(connect_timeout.min(interval), |d| d.value),
    })
}

//! `[limiter]`: the backend (memory, Redis, Cluster, Sentinel) and how it is asked.

use std::time::Duration;

use super::read::{Problems, Table};
use super::tree::{Node, Spanned};

#[derive(Debug, Clone, PartialEq)]
pub struct Limiter {
    pub backend: Backend,
    pub timeout: Duration,
    pub key_prefix: String,
    pub clock: ClockSource,
    pub on_error: OnError,
    pub deny_cache: usize,
    pub max_keys: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    Memory,
    Redis(String),
    Cluster(Vec<String>),
    Sentinel { master: String, nodes: Vec<String> },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClockSource {
    Redis,
    Local,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnError {
    Allow,
    Deny,
    Local,
}

impl Default for Limiter {
    fn default() -> Self {
        Limiter {
            backend: Backend::Memory,
            timeout: Duration::from_millis(20),
            key_prefix: "sluice:".to_owned(),
            clock: ClockSource::Redis,
            on_error: OnError::Allow,
            deny_cache: 100_000,
            max_keys: 1_000_000,
        }
    }
}

fn redis_url(p: &Problems, s: &Spanned<String>, key: &str) -> Option<String> {
    let ok = s.value.starts_with("redis://") || s.value.starts_with("rediss://");
    if !ok || redis::parse_redis_url(&s.value).is_none() {
        p.at(
            &s.span,
            format!("`{key}`: bad Redis URL \"{}\" (expected redis://[user:password@]host:port[/db] or rediss://...)", s.value),
        );
        return None;
    }
    Some(s.value.clone())
}

pub(super) fn limiter(p: &Problems, node: &Spanned<Node>) -> Option<Limiter> {
    let t = Table::new(p, "[limiter]", node)?;
    let defaults = Limiter::default();
    let kind = t
        .choice("backend", &[("memory", false), ("redis", true)])
        .unwrap_or(false);
    let url = t.string("url").and_then(|s| redis_url(p, &s, "url"));
    let cluster: Option<Vec<String>> = t.strings("cluster").map(|v| {
        v.iter()
            .filter_map(|s| redis_url(p, s, "cluster"))
            .collect()
    });
    let sentinel = t.get("sentinel").and_then(|n| sentinel(p, n));
    let given: Vec<&str> = [
        ("url", url.is_some()),
        ("cluster", cluster.is_some()),
        ("sentinel", sentinel.is_some()),
    ]
    .iter()
    .filter(|(_, present)| *present)
    .map(|(k, _)| *k)
    .collect();
    let backend = if kind {
        match (url, cluster, sentinel) {
            (Some(url), None, None) => Backend::Redis(url),
            (None, Some(seeds), None) if !seeds.is_empty() => Backend::Cluster(seeds),
            (None, None, Some((master, nodes))) => Backend::Sentinel { master, nodes },
            _ if given.len() > 1 => {
                p.at(
                    &t.key_span(given[1]),
                    "backend = \"redis\" takes only one of `url`, `cluster` and `sentinel`",
                );
                Backend::Memory
            }
            // A bad `url`, `cluster` or `sentinel` was reported already.
            _ if t
                .get("url")
                .or(t.get("cluster"))
                .or(t.get("sentinel"))
                .is_some() =>
            {
                Backend::Memory
            }
            _ => {
                let at = if t.get("backend").is_some() {
                    t.key_span("backend")
                } else {
                    t.span.clone()
                };
                p.at(
                    &at,
                    "backend = \"redis\" needs `url`, `cluster` or `sentinel`",
                );
                Backend::Memory
            }
        }
    } else {
        Backend::Memory
    };
    let timeout = t.duration("timeout").map_or(defaults.timeout, |d| d.value);
    if timeout.is_zero() {
        p.at(&t.key_span("timeout"), "`timeout` must be at least 1ms");
    }
    let key_prefix = t
        .string("key_prefix")
        .map_or(defaults.key_prefix, |s| s.value);
    let clock = t
        .choice(
            "clock",
            &[("redis", ClockSource::Redis), ("local", ClockSource::Local)],
        )
        .unwrap_or(defaults.clock);
    let on_error = on_error(&t).unwrap_or(defaults.on_error);
    let deny_cache = t
        .int("deny_cache", 0..=100_000_000)
        .map_or(defaults.deny_cache, |n| n.value as usize);
    let max_keys = t
        .int("max_keys", 1..=1_000_000_000)
        .map_or(defaults.max_keys, |n| n.value as usize);
    t.finish();
    Some(Limiter {
        backend,
        timeout,
        key_prefix,
        clock,
        on_error,
        deny_cache,
        max_keys,
    })
}

pub(super) fn on_error(t: &Table) -> Option<OnError> {
    t.choice(
        "on_error",
        &[
            ("allow", OnError::Allow),
            ("deny", OnError::Deny),
            ("local", OnError::Local),
        ],
    )
}

fn sentinel(p: &Problems, node: &Spanned<Node>) -> Option<(String, Vec<String>)> {
    let t = Table::new(p, "`sentinel`", node)?;
    let master = t.required("master").and_then(|_| t.string("master"));
    let nodes: Vec<String> = t
        .required("nodes")
        .and_then(|_| t.strings("nodes"))
        .unwrap_or_default()
        .iter()
        .filter_map(|s| redis_url(p, s, "nodes"))
        .collect();
    t.finish();
    if nodes.is_empty() {
        return None;
    }
    Some((master?.value, nodes))
}

//! Turns the spanned TOML tree into the `Config` model, collecting every problem.

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::num::NonZeroU64;
use std::ops::Range;
use std::path::Path;
use std::time::Duration;

use ipnet::IpNet;
use regex::Regex;

use super::certs;
use super::tree::{Node, Spanned};
use super::*;

/// Largest value exact integer arithmetic may reach in Redis's Lua (doubles): 2^53.
const EXACT_LIMIT: u128 = 1 << 53;

pub(super) type Entries = [(Spanned<String>, Spanned<Node>)];

/// Problems found so far, as (byte offset, message); warnings apart; and problems of other
/// files the config names (`consumer_files`), already located.
#[derive(Default)]
pub(super) struct Problems(
    pub(super) RefCell<Vec<(usize, String)>>,
    RefCell<Vec<(usize, String)>>,
    pub(super) RefCell<Vec<ConfigError>>,
);

impl Problems {
    pub(super) fn at(&self, span: &Range<usize>, message: impl Into<String>) {
        self.0.borrow_mut().push((span.start, message.into()));
    }

    pub(super) fn warn(&self, span: &Range<usize>, message: impl Into<String>) {
        self.1
            .borrow_mut()
            .push((span.start, format!("warning: {}", message.into())));
    }
}

/// Reads the keys of one table, remembering which were used so the rest can be reported.
pub(super) struct Table<'a> {
    p: &'a Problems,
    name: String,
    pub(super) span: Range<usize>,
    pub(super) entries: &'a Entries,
    used: RefCell<Vec<bool>>,
}

impl<'a> Table<'a> {
    pub(super) fn new(p: &'a Problems, name: &str, node: &'a Spanned<Node>) -> Option<Table<'a>> {
        match &node.value {
            Node::Table(entries) => Some(Table {
                p,
                name: name.to_owned(),
                span: node.span.clone(),
                entries,
                used: RefCell::new(vec![false; entries.len()]),
            }),
            other => {
                p.at(
                    &node.span,
                    format!("`{name}` must be a table, found {}", other.kind()),
                );
                None
            }
        }
    }

    pub(super) fn get(&self, key: &str) -> Option<&'a Spanned<Node>> {
        let i = self.entries.iter().position(|(k, _)| k.value == key)?;
        self.used.borrow_mut()[i] = true;
        Some(&self.entries[i].1)
    }

    pub(super) fn key_span(&self, key: &str) -> Range<usize> {
        self.entries
            .iter()
            .find(|(k, _)| k.value == key)
            .map_or(self.span.clone(), |(k, _)| k.span.clone())
    }

    pub(super) fn required(&self, key: &str) -> Option<&'a Spanned<Node>> {
        let found = self.get(key);
        if found.is_none() {
            self.p.at(
                &self.span,
                format!("missing required key `{key}` in {}", self.name),
            );
        }
        found
    }

    /// Reports keys nobody asked for.
    pub(super) fn finish(self) {
        let used = self.used.borrow();
        for ((key, _), used) in self.entries.iter().zip(used.iter()) {
            if !used {
                self.p.at(
                    &key.span,
                    format!("unknown key `{}` in {}", key.value, self.name),
                );
            }
        }
    }

    fn wrong_type(&self, key: &str, node: &Spanned<Node>, expected: &str) {
        self.p.at(
            &node.span,
            format!("`{key}` must be {expected}, found {}", node.value.kind()),
        );
    }

    pub(super) fn string(&self, key: &str) -> Option<Spanned<String>> {
        let node = self.get(key)?;
        match &node.value {
            Node::Str(s) => Some(Spanned {
                value: s.clone(),
                span: node.span.clone(),
            }),
            _ => {
                self.wrong_type(key, node, "a string");
                None
            }
        }
    }

    pub(super) fn bool(&self, key: &str) -> Option<bool> {
        let node = self.get(key)?;
        match node.value {
            Node::Bool(b) => Some(b),
            _ => {
                self.wrong_type(key, node, "a boolean");
                None
            }
        }
    }

    /// An integer within `range`.
    pub(super) fn int(
        &self,
        key: &str,
        range: std::ops::RangeInclusive<i64>,
    ) -> Option<Spanned<i64>> {
        let node = self.get(key)?;
        match node.value {
            Node::Int(i) if range.contains(&i) => Some(Spanned {
                value: i,
                span: node.span.clone(),
            }),
            Node::Int(i) => {
                let expected = if *range.end() == i64::MAX {
                    format!("at least {}", range.start())
                } else {
                    format!("between {} and {}", range.start(), range.end())
                };
                self.p
                    .at(&node.span, format!("`{key}` must be {expected}, found {i}"));
                None
            }
            _ => {
                self.wrong_type(key, node, "an integer");
                None
            }
        }
    }

    pub(super) fn strings(&self, key: &str) -> Option<Vec<Spanned<String>>> {
        let node = self.get(key)?;
        let Node::Array(items) = &node.value else {
            self.wrong_type(key, node, "an array of strings");
            return None;
        };
        let mut out = Vec::new();
        for item in items {
            match &item.value {
                Node::Str(s) => out.push(Spanned {
                    value: s.clone(),
                    span: item.span.clone(),
                }),
                other => self.p.at(
                    &item.span,
                    format!("`{key}` must hold strings, found {}", other.kind()),
                ),
            }
        }
        Some(out)
    }

    pub(super) fn duration(&self, key: &str) -> Option<Spanned<Duration>> {
        let s = self.string(key)?;
        match parse_duration(&s.value) {
            Some(d) => Some(Spanned {
                value: d,
                span: s.span,
            }),
            None => {
                self.p.at(
                    &s.span,
                    format!(
                        "`{key}`: bad duration \"{}\" (expected a whole number and a unit: ms, s, m, h or d, e.g. \"250ms\", \"1m\")",
                        s.value
                    ),
                );
                None
            }
        }
    }

    /// A string that must be one of `choices`.
    pub(super) fn choice<T: Copy>(&self, key: &str, choices: &[(&str, T)]) -> Option<T> {
        let s = self.string(key)?;
        let found = choices.iter().find(|(name, _)| *name == s.value);
        if found.is_none() {
            let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
            self.p.at(
                &s.span,
                format!(
                    "`{key}`: unknown value \"{}\" (expected one of: {})",
                    s.value,
                    names.join(", ")
                ),
            );
        }
        found.map(|(_, v)| *v)
    }

    /// A duration that must be at least 1ms.
    pub(super) fn positive_duration(&self, key: &str, default: Duration) -> Duration {
        match self.duration(key) {
            Some(d) if d.value.is_zero() => {
                self.p.at(&d.span, format!("`{key}` must be at least 1ms"));
                default
            }
            Some(d) => d.value,
            None => default,
        }
    }

    /// A size in bytes: "512KB", "10MB", "1GB", "100B" or a bare number of bytes.
    fn size(&self, key: &str) -> Option<u64> {
        let s = self.string(key)?;
        let parsed = parse_size(&s.value);
        if parsed.is_none() {
            self.p.at(
                &s.span,
                format!(
                    "`{key}`: bad size \"{}\" (expected a whole number of bytes with an optional unit: B, KB, MB or GB, e.g. \"512KB\", \"10MB\")",
                    s.value
                ),
            );
        }
        parsed
    }

    fn cidrs(&self, key: &str) -> Vec<IpNet> {
        let mut out = Vec::new();
        for s in self.strings(key).unwrap_or_default() {
            match parse_cidr(&s.value) {
                Some(net) => out.push(net),
                None => self.p.at(
                    &s.span,
                    format!("`{key}`: bad CIDR \"{}\" (expected e.g. \"10.0.0.0/8\" or \"2001:db8::/32\")", s.value),
                ),
            }
        }
        out
    }
}

/// "250ms", "1s", "1m", "1h", "1d".
pub fn parse_duration(s: &str) -> Option<Duration> {
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = s.split_at(digits);
    let n: u64 = number.parse().ok()?;
    let ms_per_unit = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return None,
    };
    Some(Duration::from_millis(n.checked_mul(ms_per_unit)?))
}

/// "512KB", "10MB", "1GB", "100B", "0" (KB = 1024 bytes, as nginx's `k`).
pub fn parse_size(s: &str) -> Option<u64> {
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = s.split_at(digits);
    let n: u64 = number.parse().ok()?;
    let bytes_per_unit: u64 = match unit {
        "" | "B" => 1,
        "KB" => 1 << 10,
        "MB" => 1 << 20,
        "GB" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(bytes_per_unit)
}

/// A CIDR, or a bare address meaning a single host.
fn parse_cidr(s: &str) -> Option<IpNet> {
    s.parse::<IpNet>()
        .ok()
        .or_else(|| s.parse::<std::net::IpAddr>().ok().map(IpNet::from))
}

/// The config and its warnings, or every problem; relative paths are read from `dir`.
#[allow(clippy::type_complexity)]
pub(super) fn config(
    root: &Spanned<Node>,
    dir: &Path,
) -> Result<(Config, Vec<(usize, String)>), (Vec<(usize, String)>, Vec<ConfigError>)> {
    let p = Problems::default();
    let config = build(&p, root, dir);
    let problems = p.0.into_inner();
    let elsewhere = p.2.into_inner();
    match config {
        Some(config) if problems.is_empty() && elsewhere.is_empty() => {
            Ok((config, p.1.into_inner()))
        }
        _ => Err((problems, elsewhere)),
    }
}

fn build(p: &Problems, root: &Spanned<Node>, dir: &Path) -> Option<Config> {
    let top = Table::new(p, "the config", root)?;
    let server = top.required("server").and_then(|n| server(p, n));
    let admin = match top.get("admin") {
        Some(n) => admin(p, n, dir),
        None => Some(Admin {
            listen: SocketAddr::from(([127, 0, 0, 1], 9091)),
            token: None,
            top_keys: Admin::DEFAULT_TOP_KEYS,
        }),
    };
    let limiter = match top.get("limiter") {
        Some(n) => limiter(p, n),
        None => Some(Limiter::default()),
    };
    let upstreams = named_tables(p, &top, "upstreams", upstream);
    let mut policies = named_tables(p, &top, "policies", policy);
    let auth = match top.get("auth") {
        Some(n) => super::auth::auth(p, n, dir),
        None => Some(Auth::default()),
    };
    let mut seen = super::auth::Seen::default();
    let mut consumers = match top.get("consumers") {
        Some(n) => super::auth::consumers(p, n, &mut seen),
        None => Vec::new(),
    };
    if let Some(files) = top_key(&top, "auth", "consumer_files") {
        consumers.extend(super::auth::consumer_files(p, files, dir, &mut seen));
    }
    if let Some(max) = auth.as_ref().and_then(|a| a.max_failures) {
        if policies.iter().any(|x| x.name == AUTH_FAILURES) {
            p.at(
                &top_key_span(&top, "auth", "max_failures"),
                format!("`max_failures` counts with a policy named \"{AUTH_FAILURES}\"; rename the policy of that name"),
            );
        }
        policies.push(super::auth::failures_policy(max));
    }
    let mut routes = match top.required("routes") {
        Some(node) => {
            // A route with `auth` needs somewhere for credentials to come from.
            let credentials = auth
                .as_ref()
                .is_none_or(|a| !a.api_key.is_empty() || !a.jwt.is_empty());
            routes(p, node, &upstreams, &policies, credentials)
        }
        None => Vec::new(),
    };
    let tls = match top.get("tls") {
        Some(n) => tls(p, n, dir),
        None => Some(Tls::default()),
    };
    let rls = top
        .get("rls")
        .and_then(|n| super::rls::rls(p, n, dir, &mut policies, &mut routes));
    let certificates_node = top.get("certificates");
    let certificates = match certificates_node {
        Some(n) => certificates(p, n, dir),
        None => Vec::new(),
    };
    let server = server?;
    // Entries that failed their checks were reported already.
    let no_entries = match certificates_node.map(|n| &n.value) {
        Some(Node::Array(items)) => items.is_empty(),
        Some(_) => false,
        None => true,
    };
    if !server.tls_listen.is_empty() && no_entries {
        p.at(
            &top_key_span(&top, "server", "tls_listen"),
            "`tls_listen` needs at least one [[certificates]] entry",
        );
    }
    top.finish();
    Some(Config {
        server,
        admin: admin?,
        limiter: limiter?,
        upstreams,
        policies,
        routes,
        tls: tls?,
        certificates,
        auth: auth?,
        consumers,
        warnings: Vec::new(),
        rls,
    })
}

/// The node of `key` inside the top-level table `table`, if both are there.
fn top_key<'a>(top: &Table<'a>, table: &str, key: &str) -> Option<&'a Spanned<Node>> {
    let (_, node) = top.entries.iter().find(|(k, _)| k.value == table)?;
    let Node::Table(entries) = &node.value else {
        return None;
    };
    entries.iter().find(|(k, _)| k.value == key).map(|(_, v)| v)
}

/// The span of `key` inside the top-level table `table` (or of the table when absent).
fn top_key_span(top: &Table, table: &str, key: &str) -> Range<usize> {
    let Some(node) = top.entries.iter().find(|(k, _)| k.value == table) else {
        return top.span.clone();
    };
    match &node.1.value {
        Node::Table(entries) => entries
            .iter()
            .find(|(k, _)| k.value == key)
            .map_or(node.1.span.clone(), |(k, _)| k.span.clone()),
        _ => node.1.span.clone(),
    }
}

impl Default for Tls {
    fn default() -> Self {
        Tls {
            min_version: TlsVersion::V1_2,
            client_auth: ClientAuth::Off,
            client_ca: Vec::new(),
        }
    }
}

fn tls(p: &Problems, node: &Spanned<Node>, dir: &Path) -> Option<Tls> {
    let t = Table::new(p, "[tls]", node)?;
    let min_version = t
        .choice(
            "min_version",
            &[("1.2", TlsVersion::V1_2), ("1.3", TlsVersion::V1_3)],
        )
        .unwrap_or(TlsVersion::V1_2);
    let client_auth = t
        .choice(
            "client_auth",
            &[
                ("off", ClientAuth::Off),
                ("optional", ClientAuth::Optional),
                ("require", ClientAuth::Require),
            ],
        )
        .unwrap_or(ClientAuth::Off);
    let ca = t.string("client_ca");
    let client_ca = match &ca {
        Some(path) => certs::read_ca(&dir.join(&path.value)).unwrap_or_else(|e| {
            p.at(&path.span, format!("`client_ca`: {e}"));
            Vec::new()
        }),
        None => Vec::new(),
    };
    if ca.is_none() && client_auth != ClientAuth::Off {
        p.at(
            &t.key_span("client_auth"),
            "`client_auth` other than \"off\" needs `client_ca`",
        );
    }
    t.finish();
    Some(Tls {
        min_version,
        client_auth,
        client_ca,
    })
}

fn certificates(p: &Problems, node: &Spanned<Node>, dir: &Path) -> Vec<Certificate> {
    let Node::Array(items) = &node.value else {
        p.at(
            &node.span,
            format!(
                "`certificates` must be an array of tables ([[certificates]]), found {}",
                node.value.kind()
            ),
        );
        return Vec::new();
    };
    let mut seen: HashMap<String, ()> = HashMap::new();
    let mut out = Vec::new();
    for item in items {
        let Some(t) = Table::new(p, "[[certificates]]", item) else {
            continue;
        };
        let hosts = t.required("hosts").and_then(|_| t.strings("hosts"));
        if hosts.as_ref().is_some_and(Vec::is_empty) {
            p.at(&t.key_span("hosts"), "`hosts` needs at least one name");
        }
        let hosts = hosts.unwrap_or_default();
        let matches: Vec<HostMatch> = hosts
            .iter()
            .filter_map(|h| {
                let host = h.value.to_ascii_lowercase();
                if seen.insert(host.clone(), ()).is_some() {
                    p.at(
                        &h.span,
                        format!("`hosts`: \"{}\" is already served by an earlier certificate", h.value),
                    );
                }
                match host.strip_prefix("*.") {
                    Some(rest) if !rest.is_empty() && !rest.contains('*') => {
                        Some(HostMatch::Suffix(format!(".{rest}")))
                    }
                    None if !host.is_empty() && !host.contains('*') => Some(HostMatch::Exact(host)),
                    _ => {
                        p.at(
                            &h.span,
                            format!("`hosts`: bad name \"{}\" (expected \"api.example.com\" or \"*.example.com\")", h.value),
                        );
                        None
                    }
                }
            })
            .collect();
        let cert = t.required("cert").and_then(|_| t.string("cert"));
        let key = t.required("key").and_then(|_| t.string("key"));
        t.finish();
        let (Some(cert), Some(key)) = (cert, key) else {
            continue;
        };
        let loaded = certs::read_pair(&dir.join(&cert.value), &dir.join(&key.value));
        let loaded = match loaded {
            Ok(loaded) => loaded,
            Err(problems) => {
                for problem in problems {
                    match problem {
                        certs::Problem::Cert(m) => p.at(&cert.span, format!("`cert`: {m}")),
                        certs::Problem::Key(m) => p.at(&key.span, format!("`key`: {m}")),
                    }
                }
                continue;
            }
        };
        if let Some(soon) = loaded.expires_soon {
            p.warn(&cert.span, format!("`cert`: {soon}"));
        }
        let Some(name) = hosts.first() else { continue };
        out.push(Certificate {
            hosts: matches,
            name: name.value.clone(),
            key: loaded.key,
            not_after: loaded.not_after,
        });
    }
    out
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

fn socket_addr(p: &Problems, s: &Spanned<String>, key: &str) -> Option<SocketAddr> {
    let parsed = s.value.parse::<SocketAddr>().ok();
    if parsed.is_none() {
        p.at(
            &s.span,
            format!(
                "`{key}`: bad address \"{}\" (expected IP:PORT, e.g. \"127.0.0.1:8080\")",
                s.value
            ),
        );
    }
    parsed
}

fn server(p: &Problems, node: &Spanned<Node>) -> Option<Server> {
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
        .and_then(|s| super::edge::header_name(p, &s, "request_id"));
    let h2c = t.bool("h2c").unwrap_or(false);
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
    })
}

fn admin(p: &Problems, node: &Spanned<Node>, dir: &Path) -> Option<Admin> {
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

fn limiter(p: &Problems, node: &Spanned<Node>) -> Option<Limiter> {
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

fn on_error(t: &Table) -> Option<OnError> {
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

/// `[upstreams.NAME]` / `[policies.NAME]`: each child table built by `one`.
fn named_tables<T>(
    p: &Problems,
    top: &Table,
    key: &str,
    one: fn(&Problems, &Spanned<String>, &Spanned<Node>) -> Option<T>,
) -> Vec<T> {
    let Some(node) = top.get(key) else {
        return Vec::new();
    };
    let Node::Table(entries) = &node.value else {
        top.wrong_type(key, node, "a table");
        return Vec::new();
    };
    entries
        .iter()
        .filter_map(|(name, child)| one(p, name, child))
        .collect()
}

fn upstream(p: &Problems, name: &Spanned<String>, node: &Spanned<Node>) -> Option<Upstream> {
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
        protocol,
    })
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

/// A key part named in `field` (`key`, or `when` of an override).
pub(super) fn key_part(p: &Problems, s: &Spanned<String>, field: &str) -> Option<KeyPart> {
    let v = s.value.as_str();
    let named = |prefix: &str| {
        v.strip_prefix(prefix)
            .filter(|name| !name.is_empty())
            .map(str::to_owned)
    };
    let part = match v {
        "client_ip" => Some(KeyPart::ClientIp),
        "path" => Some(KeyPart::Path),
        "method" => Some(KeyPart::Method),
        "host" => Some(KeyPart::Host),
        "route" => Some(KeyPart::Route),
        "client_cert" => Some(KeyPart::ClientCert),
        "consumer" => Some(KeyPart::Consumer),
        "plan" => Some(KeyPart::Plan),
        _ => {
            if let Some(bits) = v.strip_prefix("client_ip/") {
                match bits.parse::<u8>() {
                    Ok(n) if (1..=128).contains(&n) => Some(KeyPart::ClientNet(n)),
                    _ => {
                        p.at(&s.span, format!("`{field}`: bad prefix length in \"{v}\" (expected client_ip/1 to client_ip/128)"));
                        return None;
                    }
                }
            } else if let Some(name) = named("header:") {
                Some(KeyPart::Header(name.to_ascii_lowercase()))
            } else if let Some(name) = named("query:") {
                Some(KeyPart::Query(name))
            } else if let Some(name) = named("claim:") {
                Some(KeyPart::Claim(name))
            } else {
                named("cookie:").map(KeyPart::Cookie)
            }
        }
    };
    if part.is_none() {
        p.at(
            &s.span,
            format!("`{field}`: unknown key part \"{v}\" (expected client_ip, client_ip/N, header:NAME, query:NAME, cookie:NAME, path, method, host, route, client_cert, consumer, plan or claim:NAME)"),
        );
    }
    part
}

fn policy(p: &Problems, name: &Spanned<String>, node: &Spanned<Node>) -> Option<Policy> {
    check_name(p, name, "policy");
    let t = Table::new(p, &format!("[policies.{}]", name.value), node)?;
    let algorithms: Vec<(&str, Algorithm)> =
        Algorithm::ALL.iter().map(|a| (a.name(), *a)).collect();
    let algorithm = t
        .required("algorithm")
        .and_then(|_| t.choice("algorithm", &algorithms));
    let limit = t
        .required("limit")
        .and_then(|_| t.int("limit", 1..=i64::MAX));
    let period = match algorithm {
        Some(Algorithm::Concurrency) => t
            .duration("period")
            .map_or(Duration::from_secs(1), |d| d.value),
        _ => t
            .required("period")
            .and_then(|_| t.duration("period"))
            .map_or(Duration::from_secs(1), |d| {
                if d.value < Duration::from_millis(1) {
                    p.at(&d.span, "`period` must be at least 1ms");
                }
                d.value
            }),
    };
    let burst = t.int("burst", 1..=i64::MAX);
    let key: Vec<KeyPart> = t
        .required("key")
        .and_then(|_| t.strings("key"))
        .unwrap_or_default()
        .iter()
        .filter_map(|s| key_part(p, s, "key"))
        .collect();
    // `cost = { … }` is a response's cost (metering); an integer, the fixed cost.
    let cost = match t.get("cost") {
        Some(Spanned {
            value: Node::Table(_),
            ..
        }) => 1,
        _ => t.int("cost", 0..=i64::MAX).map_or(1, |n| n.value as u64),
    };
    let (metering, cost, reserve_request) = super::metering::metering(p, &t, algorithm, cost);
    // What a metered policy holds at admission is its `reserve` (with `"request"`, at most
    // `max_reserve` when a body gives no bound).
    let (cost_key, held) = match metering {
        Some(_) if reserve_request.is_some() => match t.get("max_reserve") {
            Some(_) => ("max_reserve", format!("`max_reserve` {cost}")),
            None => ("reserve", format!("`max_reserve` {cost} (its default)")),
        },
        Some(Metering::Header(_) | Metering::Usage(_)) if t.get("reserve").is_some() => {
            ("reserve", format!("`reserve` {cost}"))
        }
        _ => ("cost", format!("`cost` {cost}")),
    };
    let mode = t
        .choice(
            "mode",
            &[("enforce", Mode::Enforce), ("shadow", Mode::Shadow)],
        )
        .unwrap_or(Mode::Enforce);
    let on_exceed = t
        .choice("on_exceed", &[("reject", false), ("delay", true)])
        .unwrap_or(false);
    let max_delay = t.duration("max_delay").map_or(Duration::ZERO, |d| d.value);
    let status = t.int("status", 400..=599).map_or(429, |n| n.value as u16);
    let on_missing = t
        .choice(
            "on_missing",
            &[
                ("skip", OnMissing::Skip),
                ("deny", OnMissing::Deny),
                ("shared", OnMissing::Shared),
                ("client_ip", OnMissing::ClientIp),
            ],
        )
        .unwrap_or(OnMissing::Skip);
    let exempt = t.cidrs("exempt");
    let on_error = on_error(&t);
    let lease = t
        .duration("lease")
        .map_or(Duration::from_secs(60), |d| d.value);
    if lease < Duration::from_millis(1) {
        p.at(&t.key_span("lease"), "`lease` must be at least 1ms");
    }
    if on_exceed
        && !matches!(
            algorithm,
            Some(Algorithm::TokenBucket | Algorithm::Gcra) | None
        )
    {
        p.at(
            &t.key_span("on_exceed"),
            "on_exceed = \"delay\" works with token_bucket and gcra only (leaky_bucket always delays)",
        );
    }
    let limit = limit.map(|n| n.value as u64);
    let burst_written = burst.as_ref().map(|n| n.value as u64);
    let burst = burst.map(|n| n.value as u64).or(limit);
    // A request costing more than the policy can ever hold would be refused forever.
    let ceiling = match algorithm {
        Some(Algorithm::FixedWindow | Algorithm::SlidingWindow | Algorithm::SlidingLog) => {
            limit.map(|l| ("limit", l))
        }
        Some(Algorithm::TokenBucket | Algorithm::Gcra) if !on_exceed => burst.map(|b| ("burst", b)),
        _ => None,
    };
    if let Some((what, most)) = ceiling.filter(|(_, most)| cost > *most) {
        p.at(
            &t.key_span(cost_key),
            format!("{held} can never be admitted: it exceeds `{what}` ({most})"),
        );
    }
    // Exact integer arithmetic in Redis's Lua needs every product of a count and the period
    // in milliseconds to stay below 2^53.
    let period_ms = period.as_millis();
    for (key, n) in [("limit", limit), ("burst", burst), ("cost", Some(cost))] {
        if n.is_some_and(|n| {
            algorithm != Some(Algorithm::Concurrency) && n as u128 * period_ms >= EXACT_LIMIT
        }) {
            p.at(
                &t.key_span(key),
                format!("`{key}` times `period` in ms must stay below 2^53"),
            );
        }
    }
    let ban = t.duration("ban").map_or(Duration::ZERO, |d| d.value);
    let overrides = match (algorithm, limit) {
        (Some(algorithm), Some(limit)) => {
            let own = Own {
                name: &name.value,
                algorithm,
                limit,
                burst_written,
                period,
                cost,
                delay: on_exceed,
            };
            overrides(p, &t, &own)
        }
        // The policy's own errors are reported; its overrides cannot be completed.
        _ => Vec::new(),
    };
    t.finish();
    Some(Policy {
        name: name.value.clone(),
        algorithm: algorithm?,
        limit: NonZeroU64::new(limit?)?,
        period,
        burst: NonZeroU64::new(burst?)?,
        key,
        cost,
        mode,
        delay: on_exceed.then_some(max_delay),
        status,
        on_missing,
        exempt,
        on_error,
        lease,
        overrides,
        ban,
        metering,
        reserve_request,
    })
}

/// What an override of a policy inherits, and is checked against.
struct Own<'a> {
    name: &'a str,
    algorithm: Algorithm,
    limit: u64,
    /// `burst` as written in the policy, if it was.
    burst_written: Option<u64>,
    period: Duration,
    cost: u64,
    delay: bool,
}

/// `[[policies.NAME.overrides]]`: every entry completed to plain numbers and checked by the
/// rules of the policy's own numbers.
fn overrides(p: &Problems, t: &Table, own: &Own) -> Vec<Override> {
    let Some(node) = t.get("overrides") else {
        return Vec::new();
    };
    let Node::Array(items) = &node.value else {
        p.at(
            &node.span,
            format!(
                "`overrides` must be an array of tables ([[policies.{}.overrides]]), found {}",
                own.name,
                node.value.kind()
            ),
        );
        return Vec::new();
    };
    let mut out = Vec::new();
    for item in items {
        let Some(o) = Table::new(p, &format!("[[policies.{}.overrides]]", own.name), item) else {
            continue;
        };
        let when = o.required("when").and_then(|node| conditions(p, node));
        let limit = o.int("limit", 1..=i64::MAX).map(|n| n.value as u64);
        let burst = o.int("burst", 1..=i64::MAX).map(|n| n.value as u64);
        let period = o.duration("period");
        if let Some(d) = &period {
            if own.algorithm == Algorithm::Concurrency {
                p.at(
                    &o.key_span("period"),
                    "a concurrency policy has no `period` to override",
                );
            } else if d.value < Duration::from_millis(1) {
                p.at(&d.span, "`period` must be at least 1ms");
            }
        }
        let numbers_given = o
            .entries
            .iter()
            .any(|(k, _)| matches!(k.value.as_str(), "limit" | "period" | "burst"));
        if !numbers_given {
            p.at(
                &o.span,
                "an override needs at least one of `limit`, `period` and `burst`",
            );
        }
        let limit = limit.unwrap_or(own.limit);
        let burst = burst.or(own.burst_written).unwrap_or(limit);
        let period = period.map_or(own.period, |d| d.value);
        // The policy's rules, on the numbers this override applies.
        let ceiling = match own.algorithm {
            Algorithm::FixedWindow | Algorithm::SlidingWindow | Algorithm::SlidingLog => {
                Some(("limit", limit))
            }
            Algorithm::TokenBucket | Algorithm::Gcra if !own.delay => Some(("burst", burst)),
            _ => None,
        };
        if let Some((what, most)) = ceiling.filter(|(_, most)| own.cost > *most) {
            p.at(
                &o.key_span(what),
                format!(
                    "`cost` {} can never be admitted: it exceeds this override's `{what}` ({most})",
                    own.cost
                ),
            );
        }
        let period_ms = period.as_millis();
        if own.algorithm != Algorithm::Concurrency {
            for (key, n) in [("limit", limit), ("burst", burst), ("cost", own.cost)] {
                if n as u128 * period_ms >= EXACT_LIMIT {
                    let at = if o.get(key).is_some() { key } else { "period" };
                    p.at(
                        &o.key_span(at),
                        format!("`{key}` times `period` in ms must stay below 2^53"),
                    );
                }
            }
        }
        o.finish();
        if let (Some(when), Some(limit), Some(burst)) =
            (when, NonZeroU64::new(limit), NonZeroU64::new(burst))
        {
            out.push(Override {
                when,
                numbers: Numbers {
                    limit,
                    period,
                    burst,
                },
            });
        }
    }
    out
}

/// `when = { PART = "value" | ["value", ...], ... }`.
fn conditions(p: &Problems, node: &Spanned<Node>) -> Option<Vec<Condition>> {
    let Node::Table(entries) = &node.value else {
        p.at(
            &node.span,
            format!(
                "`when` must be a table of key parts, found {}",
                node.value.kind()
            ),
        );
        return None;
    };
    if entries.is_empty() {
        p.at(&node.span, "`when` needs at least one key part");
        return None;
    }
    let mut out = Vec::new();
    let mut ok = true;
    for (name, value) in entries {
        let part = key_part(p, name, "when");
        let values: Vec<Spanned<String>> = match &value.value {
            Node::Str(s) => vec![Spanned {
                value: s.clone(),
                span: value.span.clone(),
            }],
            Node::Array(items) => items
                .iter()
                .filter_map(|item| match &item.value {
                    Node::Str(s) => Some(Spanned {
                        value: s.clone(),
                        span: item.span.clone(),
                    }),
                    other => {
                        ok = false;
                        p.at(
                            &item.span,
                            format!("`when`: values must be strings, found {}", other.kind()),
                        );
                        None
                    }
                })
                .collect(),
            other => {
                ok = false;
                p.at(
                    &value.span,
                    format!(
                        "`when`: \"{}\" must be a string or an array of strings, found {}",
                        name.value,
                        other.kind()
                    ),
                );
                continue;
            }
        };
        if values.is_empty() && matches!(value.value, Node::Array(_)) {
            ok = false;
            p.at(
                &value.span,
                format!("`when`: \"{}\" needs at least one value", name.value),
            );
        }
        let Some(part) = part else {
            ok = false;
            continue;
        };
        let values = match part {
            KeyPart::ClientIp | KeyPart::ClientNet(_) => Values::Nets(
                values
                    .iter()
                    .filter_map(|s| {
                        let net = parse_cidr(&s.value);
                        if net.is_none() {
                            ok = false;
                            p.at(
                                &s.span,
                                format!("`when`: bad CIDR \"{}\" (expected e.g. \"10.0.0.0/8\" or \"2001:db8::/32\")", s.value),
                            );
                        }
                        net.map(|n| n.trunc())
                    })
                    .collect(),
            ),
            KeyPart::Host | KeyPart::Method => Values::Caseless(
                values
                    .iter()
                    .map(|s| s.value.to_ascii_lowercase())
                    .collect(),
            ),
            _ => Values::Exact(values.into_iter().map(|s| s.value).collect()),
        };
        out.push(Condition { part, values });
    }
    ok.then_some(out)
}

fn routes(
    p: &Problems,
    node: &Spanned<Node>,
    upstreams: &[Upstream],
    policies: &[Policy],
    credentials: bool,
) -> Vec<Route> {
    let Node::Array(items) = &node.value else {
        p.at(
            &node.span,
            format!(
                "`routes` must be an array of tables ([[routes]]), found {}",
                node.value.kind()
            ),
        );
        return Vec::new();
    };
    let mut seen: HashMap<String, ()> = HashMap::new();
    let mut out = Vec::new();
    for item in items {
        let Some(t) = Table::new(p, "[[routes]]", item) else {
            continue;
        };
        if let Some(route) = route(p, &t, upstreams, policies, credentials) {
            if seen.insert(route.name.clone(), ()).is_some() || route.name == "unmatched" {
                p.at(
                    &t.key_span("name"),
                    format!("duplicate route name \"{}\"", route.name),
                );
            }
            out.push(route);
        }
        t.finish();
    }
    out
}

fn route(
    p: &Problems,
    t: &Table,
    upstreams: &[Upstream],
    policies: &[Policy],
    credentials: bool,
) -> Option<Route> {
    let name = t.required("name").and_then(|_| t.string("name"));
    if let Some(n) = &name {
        check_name(p, n, "route");
    }
    let hosts = t
        .strings("hosts")
        .unwrap_or_default()
        .into_iter()
        .map(|h| {
            let host = h.value.to_ascii_lowercase();
            match host.strip_prefix('*') {
                Some(suffix) if suffix.starts_with('.') && suffix.len() > 1 => {
                    HostMatch::Suffix(suffix.to_owned())
                }
                Some(_) => {
                    p.at(
                        &h.span,
                        format!(
                            "`hosts`: bad wildcard \"{}\" (expected \"*.example.org\")",
                            h.value
                        ),
                    );
                    HostMatch::Exact(host)
                }
                None => HostMatch::Exact(host),
            }
        })
        .collect();
    let matchers: Vec<(&str, Spanned<String>)> = ["path", "path_prefix", "path_regex"]
        .iter()
        .filter_map(|k| t.string(k).map(|s| (*k, s)))
        .collect();
    if matchers.len() > 1 {
        p.at(
            &t.key_span(matchers[1].0),
            "a route takes only one of `path`, `path_prefix` and `path_regex`",
        );
    }
    let path = match matchers.first() {
        None => PathMatch::Any,
        Some(("path", s)) => PathMatch::Exact(s.value.clone()),
        Some(("path_prefix", s)) => PathMatch::Prefix(s.value.clone()),
        Some((_, s)) => match Regex::new(&s.value) {
            Ok(re) => PathMatch::Regex(re),
            Err(e) => {
                let first = e
                    .to_string()
                    .lines()
                    .last()
                    .unwrap_or_default()
                    .trim()
                    .to_owned();
                p.at(&s.span, format!("`path_regex`: bad regex: {first}"));
                PathMatch::Any
            }
        },
    };
    if let PathMatch::Exact(s) | PathMatch::Prefix(s) = &path {
        if !s.starts_with('/') {
            let key = matchers.first().map_or("path", |m| m.0);
            p.at(&matchers[0].1.span, format!("`{key}` must start with '/'"));
        }
    }
    let methods = t
        .strings("methods")
        .unwrap_or_default()
        .into_iter()
        .filter_map(|m| {
            let ok = !m.value.is_empty() && m.value.bytes().all(|b| b.is_ascii_uppercase());
            if !ok {
                p.at(
                    &m.span,
                    format!(
                        "`methods`: bad method \"{}\" (expected upper case, e.g. \"GET\")",
                        m.value
                    ),
                );
            }
            ok.then_some(m.value)
        })
        .collect();
    let upstream = t.string("upstream");
    let respond = t.get("respond");
    let redirect = t.get("redirect");
    let targets = usize::from(upstream.is_some())
        + usize::from(respond.is_some())
        + usize::from(redirect.is_some());
    let target = match (upstream, respond, redirect) {
        _ if targets > 1 => {
            let second = ["respond", "redirect"]
                .into_iter()
                .rev()
                .find(|k| t.get(k).is_some())
                .unwrap_or("respond");
            p.at(
                &t.key_span(second),
                "a route takes exactly one of `upstream`, `respond` and `redirect`",
            );
            None
        }
        (Some(u), _, _) => match upstreams.iter().position(|x| x.name == u.value) {
            Some(i) => Some(Target::Upstream(i)),
            None => {
                p.at(&u.span, format!("unknown upstream \"{}\"", u.value));
                None
            }
        },
        (_, Some(node), _) => respond_target(p, node),
        (_, _, Some(node)) => super::edge::redirect_target(p, node),
        (None, None, None) => {
            p.at(
                &t.span,
                "a route needs exactly one of `upstream`, `respond` and `redirect`",
            );
            None
        }
    };
    let policy_refs: Vec<usize> = t
        .strings("policies")
        .unwrap_or_default()
        .iter()
        .filter_map(|s| {
            let found = policies.iter().position(|x| x.name == s.value);
            if found.is_none() {
                p.at(&s.span, format!("unknown policy \"{}\"", s.value));
            }
            found
        })
        .collect();
    let max_request_body = t.size("max_request_body");
    let auth = t
        .choice(
            "auth",
            &[
                ("off", AuthMode::Off),
                ("optional", AuthMode::Optional),
                ("required", AuthMode::Required),
            ],
        )
        .unwrap_or(AuthMode::Off);
    if let (false, AuthMode::Optional | AuthMode::Required, Some(at)) =
        (credentials, auth, t.get("auth"))
    {
        p.at(
            &at.span,
            format!(
                "route \"{}\" has `auth` but [auth] accepts no credentials (no `api_key` sources and no [[auth.jwt]])",
                name.as_ref().map_or("", |n| n.value.as_str())
            ),
        );
    }
    let scheme = t.choice(
        "scheme",
        &[("http", Scheme::Http), ("https", Scheme::Https)],
    );
    let strip_prefix = t.bool("strip_prefix").unwrap_or(false);
    if strip_prefix && !matches!(path, PathMatch::Prefix(_)) {
        p.at(
            &t.key_span("strip_prefix"),
            "`strip_prefix` needs a `path_prefix`",
        );
    }
    let request_headers = t
        .get("request_headers")
        .map(|n| super::edge::header_rules(p, n, "request_headers"))
        .unwrap_or_default();
    let response_headers = t
        .get("response_headers")
        .map(|n| super::edge::header_rules(p, n, "response_headers"))
        .unwrap_or_default();
    let metrics_as = t.string("metrics_as").map(|s| {
        check_name(p, &s, "metrics_as");
        s.value
    });
    Some(Route {
        metrics_as,
        scheme,
        strip_prefix,
        request_headers,
        response_headers,
        name: name?.value,
        hosts,
        path,
        methods,
        target: target?,
        policies: policy_refs,
        max_request_body,
        auth,
    })
}

/// Names appear in metric labels and Redis keys: keep them plain.
pub(super) fn check_name(p: &Problems, name: &Spanned<String>, what: &str) {
    let ok = !name.value.is_empty()
        && name
            .value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
    if !ok {
        p.at(
            &name.span,
            format!(
                "bad {what} name \"{}\" (use letters, digits, '_', '-', '.')",
                name.value
            ),
        );
    }
}

fn respond_target(p: &Problems, node: &Spanned<Node>) -> Option<Target> {
    let r = Table::new(p, "`respond`", node)?;
    let status = r.int("status", 100..=599).map_or(200, |n| n.value as u16);
    let body = r.string("body").map(|s| s.value).unwrap_or_default();
    let content_type = r
        .string("content_type")
        .map_or_else(|| "text/plain".to_owned(), |s| s.value);
    r.finish();
    Some(Target::Respond {
        status,
        body,
        content_type,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("1s"), Some(Duration::from_secs(1)));
        assert_eq!(parse_duration("1m"), Some(Duration::from_secs(60)));
        assert_eq!(parse_duration("1h"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1d"), Some(Duration::from_secs(86400)));
        assert_eq!(parse_duration("0s"), Some(Duration::ZERO));
        for bad in [
            "",
            "1",
            "s",
            "1.5s",
            "-1s",
            "1 s",
            "1sec",
            "99999999999999999999d",
        ] {
            assert_eq!(parse_duration(bad), None, "{bad}");
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("0"), Some(0));
        assert_eq!(parse_size("100"), Some(100));
        assert_eq!(parse_size("100B"), Some(100));
        assert_eq!(parse_size("512KB"), Some(512 * 1024));
        assert_eq!(parse_size("10MB"), Some(10 * 1024 * 1024));
        assert_eq!(parse_size("1GB"), Some(1 << 30));
        for bad in [
            "",
            "KB",
            "1.5MB",
            "-1",
            "1 MB",
            "1mb",
            "1TB",
            "99999999999999999999GB",
        ] {
            assert_eq!(parse_size(bad), None, "{bad}");
        }
    }
}

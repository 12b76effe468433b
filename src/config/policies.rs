//! `[policies.NAME]` and their `[[policies.NAME.overrides]]` (DESIGN §3, §9.1): the
//! types, the reader, and the checks that keep every policy admissible and exact in Redis.

use std::num::NonZeroU64;
use std::time::Duration;

use ipnet::IpNet;

use super::calendar::{self, Calendar};
use super::limiter::{on_error, OnError};
use super::metering::{metering, Metering};
use super::read::{check_name, parse_cidr, Problems, Table};
use super::reject::{self, Reject};
use super::tree::{Node, Spanned};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    FixedWindow,
    SlidingWindow,
    SlidingLog,
    TokenBucket,
    Gcra,
    LeakyBucket,
    Concurrency,
}

impl Algorithm {
    pub const ALL: [Algorithm; 7] = [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::SlidingLog,
        Algorithm::TokenBucket,
        Algorithm::Gcra,
        Algorithm::LeakyBucket,
        Algorithm::Concurrency,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::SlidingLog => "sliding_log",
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::Gcra => "gcra",
            Algorithm::LeakyBucket => "leaky_bucket",
            Algorithm::Concurrency => "concurrency",
        }
    }
}

/// One part of a policy key (DESIGN §2.1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPart {
    ClientIp,
    ClientNet(u8),
    Header(String),
    Query(String),
    Cookie(String),
    Path,
    Method,
    Host,
    Route,
    /// Lower-case hex SHA-256 of the client's leaf certificate (DER), with mutual TLS only.
    ClientCert,
    /// The verified consumer's name (DESIGN §11); absent for anonymous requests.
    Consumer,
    /// The verified consumer's plan; `anonymous` without a consumer.
    Plan,
    /// A string or integer claim of the verified token.
    Claim(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Enforce,
    Shadow,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnMissing {
    Skip,
    Deny,
    Shared,
    /// The absent parts are replaced by the client IP (anonymous clients per address).
    ClientIp,
}

#[derive(Debug, Clone)]
pub struct Policy {
    pub name: String,
    pub algorithm: Algorithm,
    pub limit: NonZeroU64,
    pub period: Duration,
    pub burst: NonZeroU64,
    pub key: Vec<KeyPart>,
    pub cost: u64,
    pub mode: Mode,
    /// `Some(max_delay)` when `on_exceed = "delay"`.
    pub delay: Option<Duration>,
    pub status: u16,
    pub on_missing: OnMissing,
    pub exempt: Vec<IpNet>,
    pub on_error: Option<OnError>,
    pub lease: Duration,
    /// `[[policies.NAME.overrides]]`, in order: the first that matches a request wins.
    pub overrides: Vec<Override>,
    /// Once this policy rejects a key, the key is rejected for this long; zero = never.
    pub ban: Duration,
    /// `count` or `cost = { … }`: the charge made at admission (`cost`, which then holds
    /// the `reserve`) is settled when the response is known (DESIGN §12).
    pub metering: Option<Metering>,
    /// `reserve = "request"`: the request's own upper bound is held, this much
    /// (`max_reserve`, also `cost`) when its body gives none.
    pub reserve_request: Option<u64>,
    /// `prefetch = { max, hold }` (DESIGN §19): units an instance may take ahead for a hot
    /// key (a Redis backend only; the memory backend ignores it).
    pub prefetch: Option<Prefetch>,
    /// fixed_window with `period = "1d" | "1w" | "1mo"` (DESIGN §20): calendar windows in
    /// `timezone`; `period` then holds the longest such window (`CalendarUnit::nominal`).
    pub calendar: Option<Calendar>,
    /// `reject = { body_file, content_type }` (DESIGN §20): this policy's 429 body.
    pub reject: Option<Reject>,
}

/// `prefetch = { max, hold }`: at most `max` units taken ahead per key and instance, each
/// used within `hold` of being taken (DESIGN §19).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefetch {
    pub max: u64,
    pub hold: Duration,
}

/// The numbers a policy counts with: its own, an override's, or (later) a runtime
/// override's. Backends never see where they came from (DESIGN §9.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Numbers {
    pub limit: NonZeroU64,
    pub period: Duration,
    pub burst: NonZeroU64,
}

/// One `[[policies.NAME.overrides]]` entry: when every condition holds, the policy counts
/// with `numbers` (already completed from the policy: an override that sets `limit` but
/// not `burst` gets the policy's written `burst`, else its own `limit`, as a policy does).
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    pub when: Vec<Condition>,
    pub numbers: Numbers,
}

/// One `when` entry: a key part and the values it may take.
#[derive(Debug, Clone, PartialEq)]
pub struct Condition {
    pub part: KeyPart,
    pub values: Values,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Values {
    /// Exact, case-sensitive values (headers, query parameters, cookies, path, route, ...).
    Exact(Vec<String>),
    /// `host` and `method`: compared ignoring ASCII case; stored lower-case.
    Caseless(Vec<String>),
    /// `client_ip` and `client_ip/N`: the address (or its /N network) lies in one of these.
    Nets(Vec<IpNet>),
}

impl Policy {
    /// The policy's own numbers (no override).
    pub fn numbers(&self) -> Numbers {
        Numbers {
            limit: self.limit,
            period: self.period,
            burst: self.burst,
        }
    }

    /// Whether two versions of a policy count the same way (so cached denials stay true).
    pub fn same_rule(&self, other: &Policy) -> bool {
        self.algorithm == other.algorithm
            && self.limit == other.limit
            && self.period == other.period
            && self.burst == other.burst
            && self.key == other.key
            && self.cost == other.cost
            && self.overrides == other.overrides
            && self.ban == other.ban
            && self.metering == other.metering
    }
}

/// Largest value exact integer arithmetic may reach in Redis's Lua (doubles): 2^53.
const EXACT_LIMIT: u128 = 1 << 53;

/// Whether `n` units per `period` keep a rate's arithmetic in Redis's Lua exact: `n` times
/// the period in ms below 2^53. The config checks its own numbers; this is for those set at
/// run time (the admin API's overrides, an RLS request's own limit).
pub fn exact_in_redis(n: u64, period: Duration) -> bool {
    u128::from(n) * period.as_millis() < EXACT_LIMIT
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

pub(super) fn policy(p: &Problems, name: &Spanned<String>, node: &Spanned<Node>) -> Option<Policy> {
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
    let calendar = calendar::calendar(p, &t, algorithm.map(|a| a.name()));
    let period = match algorithm {
        // A calendar period (or one written on the wrong algorithm, reported above).
        _ if calendar.is_some() || calendar::refused(&t, algorithm.map(|a| a.name())) => {
            calendar.map_or(Duration::from_secs(1), |c| c.unit.nominal())
        }
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
    let (metering, cost, reserve_request) = metering(p, &t, cost);
    if let (Some(_), Some(Algorithm::Concurrency | Algorithm::LeakyBucket)) = (&metering, algorithm)
    {
        let key = if t.get("count").is_some() {
            "count"
        } else {
            "cost"
        };
        p.at(
            &t.key_span(key),
            "charging from the response works with fixed_window, sliding_window, sliding_log, token_bucket and gcra (concurrency counts requests in flight; leaky_bucket has already shaped the request)",
        );
    }
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
    for (key, n) in [("limit", limit), ("burst", burst), ("cost", Some(cost))] {
        if n.is_some_and(|n| {
            // A calendar window only counts (no rate arithmetic in its period).
            algorithm != Some(Algorithm::Concurrency)
                && calendar.is_none()
                && !exact_in_redis(n, period)
        }) {
            p.at(
                &t.key_span(key),
                format!("`{key}` times `period` in ms must stay below 2^53"),
            );
        }
    }
    let ban = t.duration("ban").map_or(Duration::ZERO, |d| d.value);
    let reject = reject::reject(p, &t, &name.value);
    let prefetch = prefetch(p, &t, algorithm, on_exceed, metering.is_some());
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
                calendar: calendar.is_some(),
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
        prefetch,
        calendar,
        reject,
    })
}

/// `prefetch = { max = N, hold = "D" }`: on the algorithms whose units can be taken ahead
/// and given back (fixed_window, sliding_window, token_bucket and gcra, rejecting).
fn prefetch(
    p: &Problems,
    t: &Table,
    algorithm: Option<Algorithm>,
    delay: bool,
    metered: bool,
) -> Option<Prefetch> {
    let node = t.get("prefetch")?;
    let o = Table::new(p, "`prefetch`", node)?;
    let max = o.required("max").and_then(|_| o.int("max", 1..=i64::MAX));
    let hold = o.required("hold").and_then(|_| o.duration("hold"));
    if let Some(d) = hold.as_ref().filter(|d| d.value.is_zero()) {
        p.at(&d.span, "`hold` must be at least 1ms");
    }
    o.finish();
    let at = t.key_span("prefetch");
    match algorithm {
        Some(Algorithm::SlidingLog | Algorithm::LeakyBucket | Algorithm::Concurrency) => {
            p.at(
                &at,
                "`prefetch` works with fixed_window, sliding_window, token_bucket and gcra (a log, a queue and leases cannot be taken ahead)",
            );
            return None;
        }
        _ if delay => {
            p.at(
                &at,
                "`prefetch` does not combine with on_exceed = \"delay\" (units taken ahead are admitted at once)",
            );
            return None;
        }
        _ if metered => {
            p.at(
                &at,
                "`prefetch` does not combine with charging from the response (`count`, `cost = { … }`): a response's charge is settled on the key, not on units taken ahead",
            );
            return None;
        }
        _ => {}
    }
    let (max, hold) = (max?, hold?);
    (!hold.value.is_zero()).then_some(Prefetch {
        max: max.value as u64,
        hold: hold.value,
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
    /// The policy counts calendar windows: an override keeps them (no `period`).
    calendar: bool,
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
            } else if own.calendar {
                p.at(
                    &o.key_span("period"),
                    "a calendar period's overrides keep its windows: set `limit` only",
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
        if own.algorithm != Algorithm::Concurrency && !own.calendar {
            for (key, n) in [("limit", limit), ("burst", burst), ("cost", own.cost)] {
                if !exact_in_redis(n, period) {
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

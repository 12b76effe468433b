//! Charging from the response (DESIGN §12): a policy's `count`, `cost` (a table),
//! `reserve` and `max_reserve`, read into how its charge is settled.

use super::read::{header_name, Problems, Table};
use super::tree::{Node, Spanned};

/// How a policy's charge is settled from the response (DESIGN §12).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Metering {
    /// `count = { status = [...] }`: the charge stands when the status is listed, else
    /// it is refunded.
    Status(Vec<StatusRange>),
    /// `cost = { header = NAME }`: the response's integer header is the cost.
    Header(http::HeaderName),
    /// `cost = { usage = FORMAT }`: the tokens the response's body reports.
    Usage(UsageFormat),
}

/// Statuses `low..=high`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusRange {
    pub low: u16,
    pub high: u16,
}

impl Metering {
    /// `count`: whether a response with `status` keeps its charge.
    pub fn counts(&self, status: u16) -> bool {
        match self {
            Metering::Status(ranges) => ranges.iter().any(|r| (r.low..=r.high).contains(&status)),
            _ => true,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageFormat {
    OpenAi,
    /// With the weights of its prompt-cache tokens (DESIGN §21).
    Anthropic(CacheWeights),
    Gemini,
}

/// `weights = { cache_read = 0.1, cache_write = 1.25 }`: what one token read from and one
/// written to Anthropic's prompt cache count, in millionths (1.0 each by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheWeights {
    pub read: u64,
    pub write: u64,
}

impl CacheWeights {
    pub const ONE: CacheWeights = CacheWeights {
        read: 1_000_000,
        write: 1_000_000,
    };

    /// `read` tokens read from the cache and `write` written to it, weighed, rounded up.
    pub fn weigh(&self, read: u64, write: u64) -> u64 {
        let millionths =
            u128::from(read) * u128::from(self.read) + u128::from(write) * u128::from(self.write);
        u64::try_from(millionths.div_ceil(1_000_000)).unwrap_or(u64::MAX)
    }
}

/// `reserve`: units held at admission for a response's cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reserve {
    Units(u64),
    /// `"request"`: the request's own upper bound, at most `most` (`max_reserve`).
    Request {
        most: u64,
    },
}

/// The request's upper bound when `reserve = "request"` finds none in the body.
const DEFAULT_MAX_RESERVE: u64 = 4096;

/// The policy's metering, if it charges from the response, the units it holds at
/// admission (`reserve`, or for `count` the policy's `cost`), and with `reserve =
/// "request"` its `max_reserve`. `cost` is the policy's integer `cost` as already read (1
/// when absent). Whether the policy's algorithm can be metered is checked by the policy.
pub(super) fn metering(p: &Problems, t: &Table, cost: u64) -> (Option<Metering>, u64, Option<u64>) {
    let count = t.get("count").and_then(|node| count(p, node));
    let from_response = match t.get("cost") {
        Some(
            node @ Spanned {
                value: Node::Table(_),
                ..
            },
        ) => cost_source(p, node),
        _ => None,
    };
    let reserve = reserve(p, t);
    let metering = match (count, from_response) {
        (Some(_), Some(_)) => {
            p.at(
                &t.key_span("count"),
                "`count` and `cost = { … }` cannot be used together: a policy charges either its statuses or its response's cost",
            );
            None
        }
        (Some(statuses), None) => Some(Metering::Status(statuses)),
        (None, Some(source)) => Some(source),
        (None, None) => None,
    };
    let request = match (&metering, reserve) {
        (Some(Metering::Header(_) | Metering::Usage(_)), Some(Reserve::Request { most })) => {
            Some(most)
        }
        _ => None,
    };
    let held = match (&metering, reserve) {
        (Some(Metering::Header(_) | Metering::Usage(_)), Some(Reserve::Units(n))) => n,
        (_, Some(Reserve::Request { most })) if request.is_some() => most,
        (Some(Metering::Header(_) | Metering::Usage(_)), None) => 1,
        (_, Some(_)) => {
            p.at(
                &t.key_span("reserve"),
                "`reserve` needs `cost = { header = … }` or `cost = { usage = … }`",
            );
            cost
        }
        _ => cost,
    };
    (metering, held, request)
}

/// The `reserve` of a metered policy, with `max_reserve` for `"request"`.
fn reserve(p: &Problems, t: &Table) -> Option<Reserve> {
    let max_reserve = t.int("max_reserve", 1..=i64::MAX).map(|n| n.value as u64);
    let reserve = match t.get("reserve")? {
        Spanned {
            value: Node::Int(n),
            span,
        } => {
            if *n < 1 {
                p.at(span, format!("`reserve` must be at least 1, found {n}"));
            }
            Reserve::Units((*n).max(1) as u64)
        }
        Spanned {
            value: Node::Str(s),
            ..
        } if s == "request" => Reserve::Request {
            most: max_reserve.unwrap_or(DEFAULT_MAX_RESERVE),
        },
        other => {
            p.at(
                &other.span,
                "`reserve` must be an integer or \"request\" (the request's own upper bound, from its JSON body)",
            );
            return None;
        }
    };
    if max_reserve.is_some() && !matches!(reserve, Reserve::Request { .. }) {
        p.at(
            &t.key_span("max_reserve"),
            "`max_reserve` bounds `reserve = \"request\"` only",
        );
    }
    Some(reserve)
}

/// `count = { status = [401, 403, "500-599"] }`.
fn count(p: &Problems, node: &Spanned<Node>) -> Option<Vec<StatusRange>> {
    let t = Table::new(p, "`count`", node)?;
    let list = t.required("status");
    let ranges = match list {
        Some(Spanned {
            value: Node::Array(items),
            span,
        }) => {
            if items.is_empty() {
                p.at(span, "`status` lists no status: nothing would ever count");
            }
            items
                .iter()
                .filter_map(|item| status_range(p, item))
                .collect()
        }
        Some(other) => {
            p.at(
                &other.span,
                format!(
                    "`status` must be an array of statuses (401) and ranges (\"500-599\"), found {}",
                    other.value.kind()
                ),
            );
            Vec::new()
        }
        None => Vec::new(),
    };
    t.finish();
    Some(ranges)
}

fn status_range(p: &Problems, item: &Spanned<Node>) -> Option<StatusRange> {
    let valid = |n: i64| (100..=599).contains(&n);
    let range = match &item.value {
        Node::Int(n) if valid(*n) => Some((*n as u16, *n as u16)),
        Node::Str(s) => match s.split_once('-') {
            Some((a, b)) => match (a.trim().parse::<i64>(), b.trim().parse::<i64>()) {
                (Ok(a), Ok(b)) if valid(a) && valid(b) && a <= b => Some((a as u16, b as u16)),
                _ => None,
            },
            None => None,
        },
        _ => None,
    };
    if range.is_none() {
        p.at(
            &item.span,
            "a status must be 100 to 599, or a range such as \"500-599\"",
        );
    }
    range.map(|(low, high)| StatusRange { low, high })
}

/// `weights = { cache_read = 0.1, cache_write = 1.25 }`: each a number from 0 to 1000.
fn cache_weights(p: &Problems, node: &Spanned<Node>) -> CacheWeights {
    let mut weights = CacheWeights::ONE;
    let Some(t) = Table::new(p, "`weights`", node) else {
        return weights;
    };
    for (key, weight) in [
        ("cache_read", &mut weights.read),
        ("cache_write", &mut weights.write),
    ] {
        let Some(n) = t.number(key) else { continue };
        if !(0.0..=1000.0).contains(&n.value) {
            p.at(
                &n.span,
                format!("`{key}` must be a number from 0 to 1000, found {}", n.value),
            );
            continue;
        }
        *weight = (n.value * 1e6).round() as u64;
    }
    t.finish();
    weights
}

/// `cost = { header = "x-usage-units" }` or `cost = { usage = "openai" }`.
fn cost_source(p: &Problems, node: &Spanned<Node>) -> Option<Metering> {
    let t = Table::new(p, "`cost`", node)?;
    let header = t
        .string("header")
        .and_then(|name| header_name(p, &name, "header"));
    let usage = t.choice(
        "usage",
        &[
            ("openai", UsageFormat::OpenAi),
            ("anthropic", UsageFormat::Anthropic(CacheWeights::ONE)),
            ("gemini", UsageFormat::Gemini),
        ],
    );
    let usage = match (usage, t.get("weights")) {
        (Some(UsageFormat::Anthropic(_)), Some(node)) => {
            Some(UsageFormat::Anthropic(cache_weights(p, node)))
        }
        (_, Some(node)) => {
            p.at(
                &node.span,
                "`weights` weighs Anthropic's prompt-cache tokens: it takes `usage = \"anthropic\"`",
            );
            usage
        }
        (usage, None) => usage,
    };
    let source = match (header, usage) {
        _ if t.get("header").is_some() && t.get("usage").is_some() => {
            p.at(&node.span, "`cost` takes one of `header` and `usage`");
            None
        }
        (Some(name), _) => Some(Metering::Header(name)),
        (_, Some(format)) => Some(Metering::Usage(format)),
        (None, None) => {
            if t.get("header").is_none() && t.get("usage").is_none() {
                p.at(
                    &node.span,
                    "`cost` must be an integer, `{ header = \"NAME\" }` or `{ usage = \"openai\" | \"anthropic\" | \"gemini\" }`",
                );
            }
            None
        }
    };
    t.finish();
    source
}

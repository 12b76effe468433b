//! `retries = { attempts, on, budget }` of an upstream (DESIGN §20): which failures are tried
//! again on another server, how often, and how many requests may be retrying at once.

use super::read::{Problems, Table};
use super::tree::{Node, Spanned};

/// What a retry is for; the `reason` label of `sluice_upstream_retries_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryOn {
    /// The connection (TCP or TLS) to the server failed or timed out.
    Connect,
    /// The server closed or reset the connection, or timed out, before a response header.
    Reset,
    /// The server answered with this status, and none of it reached the client yet.
    Status502,
    Status503,
    Status504,
}

impl RetryOn {
    pub const ALL: [RetryOn; 5] = [
        RetryOn::Connect,
        RetryOn::Reset,
        RetryOn::Status502,
        RetryOn::Status503,
        RetryOn::Status504,
    ];

    /// As written in `on`, and as the metric's `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            RetryOn::Connect => "connect",
            RetryOn::Reset => "reset",
            RetryOn::Status502 => "502",
            RetryOn::Status503 => "503",
            RetryOn::Status504 => "504",
        }
    }

    pub fn of_status(status: u16) -> Option<RetryOn> {
        match status {
            502 => Some(RetryOn::Status502),
            503 => Some(RetryOn::Status503),
            504 => Some(RetryOn::Status504),
            _ => None,
        }
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// An upstream's retry policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retries {
    /// Retries after the first try, as Envoy's `num_retries`: 2 = up to 3 tries in all.
    pub attempts: u32,
    /// Requests to this upstream that may be retrying at once: this percent of those in
    /// flight, and never fewer than `MIN_CONCURRENT_RETRIES` (Envoy's retry budget).
    pub budget_percent: u32,
    on: u8,
}

impl Retries {
    /// Envoy's `min_retry_concurrency` default: a quiet upstream can still retry at all.
    pub const MIN_CONCURRENT_RETRIES: u64 = 3;
    const MAX_ATTEMPTS: i64 = 10;

    pub fn on(&self, reason: RetryOn) -> bool {
        self.on & reason.bit() != 0
    }

    /// The reasons in `on`.
    pub fn reasons(&self) -> impl Iterator<Item = RetryOn> + '_ {
        RetryOn::ALL.into_iter().filter(|r| self.on(*r))
    }
}

/// `retries` of `[upstreams.NAME]`; defaults: one retry, on connect and reset (nginx's
/// `proxy_next_upstream error timeout`), a budget of 20% (Envoy's).
pub(super) fn retries(p: &Problems, upstream: &str, node: &Spanned<Node>) -> Option<Retries> {
    if !matches!(node.value, Node::Table(_)) {
        p.at(
            &node.span,
            format!(
                "`retries` must be a table, e.g. {{ attempts = 2, on = [\"connect\", \"reset\"] }}, found {}",
                node.value.kind()
            ),
        );
        return None;
    }
    let t = Table::new(p, &format!("`retries` of [upstreams.{upstream}]"), node)?;
    let attempts = t
        .int("attempts", 1..=Retries::MAX_ATTEMPTS)
        .map_or(1, |n| n.value as u32);
    let on = match t.strings("on") {
        Some(names) => {
            if names.is_empty() {
                p.at(
                    &t.key_span("on"),
                    "`on` needs at least one of: connect, reset, 502, 503, 504",
                );
            }
            names.iter().fold(0u8, |mask, name| {
                match RetryOn::ALL.iter().find(|r| r.label() == name.value) {
                    Some(r) => mask | r.bit(),
                    None => {
                        p.at(
                            &name.span,
                            format!(
                                "`on`: unknown value \"{}\" (expected one of: connect, reset, 502, 503, 504)",
                                name.value
                            ),
                        );
                        mask
                    }
                }
            })
        }
        None => RetryOn::Connect.bit() | RetryOn::Reset.bit(),
    };
    let budget_percent = match t.string("budget") {
        Some(s) => match s
            .value
            .strip_suffix('%')
            .and_then(|n| n.parse::<u32>().ok())
            .filter(|n| *n <= 100 && !s.value.starts_with('+'))
        {
            Some(n) => n,
            None => {
                p.at(
                    &s.span,
                    format!(
                        "`budget`: bad share \"{}\" (expected a whole percentage from 0% to 100%, e.g. \"20%\")",
                        s.value
                    ),
                );
                20
            }
        },
        None => 20,
    };
    t.finish();
    Some(Retries {
        attempts,
        budget_percent,
        on,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_round_trip_their_labels() {
        let r = Retries {
            attempts: 2,
            budget_percent: 20,
            on: RetryOn::Connect.bit() | RetryOn::Status503.bit(),
        };
        let labels: Vec<&str> = r.reasons().map(RetryOn::label).collect();
        assert_eq!(labels, ["connect", "503"]);
        assert!(!r.on(RetryOn::Reset));
        assert_eq!(RetryOn::of_status(504), Some(RetryOn::Status504));
        assert_eq!(RetryOn::of_status(500), None);
    }
}

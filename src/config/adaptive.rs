//! `[upstreams.NAME.adaptive]` (DESIGN §22): the bounds and pace of an upstream's learnt
//! concurrency limit, how long a request may wait for a slot, and each plan's share of it.

use std::time::Duration;

use super::read::{Problems, Table};
use super::tree::{Node, Spanned};

/// An upstream's adaptive concurrency; `Default` is the table with no keys.
#[derive(Debug, Clone, PartialEq)]
pub struct Adaptive {
    /// The limit never falls below this (probe traffic keeps flowing).
    pub min_limit: u32,
    pub max_limit: u32,
    /// The limit a new upstream returns to after its first probe.
    pub initial_limit: u32,
    /// Latency samples per limit update.
    pub window: Duration,
    /// Sampled latency may reach `tolerance` x the best before the limit falls.
    pub tolerance: f64,
    /// The best latency is measured again this often (jittered by up to 10%).
    pub probe_every: Duration,
    /// A request may wait this long for a slot before it is shed (zero: no wait).
    pub queue: Duration,
    /// `shares`: the share of the limit each plan may use, in (0, 1]; plans not listed: 1.0.
    pub shares: Vec<(String, f64)>,
}

impl Default for Adaptive {
    fn default() -> Self {
        Adaptive {
            min_limit: 4,
            max_limit: 2000,
            initial_limit: 20,
            window: Duration::from_millis(250),
            tolerance: 1.5,
            probe_every: Duration::from_secs(30),
            queue: Duration::from_millis(50),
            shares: Vec::new(),
        }
    }
}

impl Adaptive {
    /// The share of the limit `plan` may use.
    pub fn share(&self, plan: &str) -> f64 {
        self.shares
            .iter()
            .find(|(name, _)| name == plan)
            .map_or(1.0, |(_, s)| *s)
    }
}

/// The shortest `window`: shorter ones rarely hold the 10 samples an update needs.
const MIN_WINDOW: Duration = Duration::from_millis(10);
const MAX_LIMIT: i64 = 1 << 20;

/// `adaptive` of `[upstreams.NAME]`.
pub(super) fn adaptive(p: &Problems, upstream: &str, node: &Spanned<Node>) -> Option<Adaptive> {
    let t = Table::new(p, &format!("[upstreams.{upstream}.adaptive]"), node)?;
    let d = Adaptive::default();
    let int = |key, default: u32| {
        t.int(key, 1..=MAX_LIMIT)
            .map(|n| Spanned {
                value: n.value as u32,
                span: n.span,
            })
            .ok_or(default)
    };
    let min = int("min_limit", d.min_limit);
    let max = int("max_limit", d.max_limit);
    let initial = int("initial_limit", d.initial_limit);
    let value = |r: &Result<Spanned<u32>, u32>| r.as_ref().map_or_else(|d| *d, |s| s.value);
    let (min_limit, max_limit) = (value(&min), value(&max));
    if min_limit > max_limit {
        let span = min.as_ref().or(max.as_ref()).map(|s| s.span.clone());
        p.at(
            &span.unwrap_or(t.span.clone()),
            format!("`min_limit` {min_limit} is above `max_limit` {max_limit}"),
        );
    }
    let initial_limit = match &initial {
        Ok(i) if min_limit <= max_limit && !(min_limit..=max_limit).contains(&i.value) => {
            p.at(
                &i.span,
                format!(
                    "`initial_limit` {} is outside [min_limit, max_limit] = [{min_limit}, {max_limit}]",
                    i.value
                ),
            );
            i.value
        }
        Ok(i) => i.value,
        // Not written: the default, kept within the bounds that are.
        Err(d) => (*d).clamp(min_limit.min(max_limit), max_limit),
    };
    let window = t.duration("window");
    if let Some(w) = window.as_ref().filter(|w| w.value < MIN_WINDOW) {
        p.at(
            &w.span,
            "`window` must be at least 10ms (an update needs 10 samples)",
        );
    }
    let tolerance = t.number("tolerance");
    if let Some(tol) = tolerance
        .as_ref()
        .filter(|tol| !(tol.value >= 1.0 && tol.value.is_finite()))
    {
        p.at(
            &tol.span,
            format!(
                "`tolerance` must be at least 1 (a multiple of the best latency), found {}",
                tol.value
            ),
        );
    }
    let window = window.map_or(d.window, |w| w.value);
    let probe_every = t.duration("probe_every");
    if let Some(pe) = probe_every.as_ref().filter(|pe| pe.value <= window) {
        p.at(&pe.span, "`probe_every` must be longer than `window`");
    }
    let queue = t.duration("queue").map_or(d.queue, |q| q.value);
    let shares = t.get("shares").map(|n| shares(p, n)).unwrap_or_default();
    t.finish();
    Some(Adaptive {
        min_limit,
        max_limit,
        initial_limit,
        window,
        tolerance: tolerance.map_or(d.tolerance, |t| t.value),
        probe_every: probe_every.map_or(d.probe_every, |pe| pe.value),
        queue,
        shares,
    })
}

/// `shares = { gold = 1.0, free = 0.6 }`: each in (0, 1].
fn shares(p: &Problems, node: &Spanned<Node>) -> Vec<(String, f64)> {
    let Node::Table(entries) = &node.value else {
        p.at(
            &node.span,
            format!(
                "`shares` must be a table of plans, e.g. {{ gold = 1.0, free = 0.6 }}, found {}",
                node.value.kind()
            ),
        );
        return Vec::new();
    };
    let mut out = Vec::new();
    for (plan, value) in entries {
        let share = match value.value {
            Node::Float(f) => f,
            Node::Int(i) => i as f64,
            ref other => {
                p.at(
                    &value.span,
                    format!(
                        "share of plan \"{}\" must be a number, found {}",
                        plan.value,
                        other.kind()
                    ),
                );
                continue;
            }
        };
        if !(share > 0.0 && share <= 1.0) {
            p.at(
                &value.span,
                format!(
                    "share of plan \"{}\" must be in (0, 1], found {share}",
                    plan.value
                ),
            );
            continue;
        }
        out.push((plan.value.clone(), share));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstream_adaptive(table: &str) -> Option<Adaptive> {
        let text = format!(
            "[server]\nlisten = [\"127.0.0.1:0\"]\n[upstreams.u]\nservers = [\"127.0.0.1:1\"]\n{table}\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n"
        );
        let config = crate::config::parse("t.toml", &text).expect("valid config");
        config.upstreams[0].adaptive.clone()
    }

    #[test]
    fn an_empty_table_is_the_defaults_and_none_is_off() {
        assert_eq!(upstream_adaptive(""), None);
        let d = upstream_adaptive("[upstreams.u.adaptive]").expect("on");
        assert_eq!(d, Adaptive::default());
        assert_eq!((d.min_limit, d.max_limit, d.initial_limit), (4, 2000, 20));
        assert_eq!(d.share("anyone"), 1.0);
    }

    #[test]
    fn shares_take_floats_and_integers_and_an_unwritten_initial_is_kept_in_bounds() {
        let a = upstream_adaptive(
            "[upstreams.u.adaptive]\nmin_limit = 30\nmax_limit = 40\ntolerance = 2\nwindow = \"100ms\"\nqueue = \"0s\"\nshares = { gold = 1, free = 0.6 }",
        )
        .expect("on");
        assert_eq!(a.initial_limit, 30);
        assert_eq!(a.tolerance, 2.0);
        assert_eq!(a.window, Duration::from_millis(100));
        assert!(a.queue.is_zero());
        assert_eq!(
            (a.share("gold"), a.share("free"), a.share("pro")),
            (1.0, 0.6, 1.0)
        );
    }
}

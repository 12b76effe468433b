//! Retry budgets of the upstreams with `retries` (DESIGN §20), as Envoy's: a request may be
//! retried only while fewer than `budget` percent of the requests in flight to its upstream
//! are retrying, with a floor of 3 so that a quiet upstream can retry at all. Counted in
//! `sluice_upstream_retries_total{upstream, reason}`.
//!
//! A request holds its retry slot from its first retry until it ends, so "retrying" means
//! what Envoy's active retries mean: requests now on a second (or later) try.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use prometheus::IntCounter;

use crate::config::{Retries, RetryOn, Upstream};
use crate::metrics::Metrics;

/// One upstream's retry policy and what is in flight to it now.
pub struct Budget {
    policy: Retries,
    /// Requests to this upstream that have not ended.
    in_flight: AtomicU64,
    /// Of those, the ones that were retried.
    retrying: AtomicU64,
    /// `sluice_upstream_retries_total{upstream, reason}` per `RetryOn`, for the reasons in `on`.
    counted: [Option<IntCounter>; 5],
}

impl Budget {
    /// `upstream`'s budget, `None` where it has no `retries`; primes the series of each
    /// reason in `on`.
    pub fn new(upstream: &Upstream, metrics: &Metrics) -> Option<Budget> {
        let policy = upstream.retries.clone()?;
        let counted = RetryOn::ALL.map(|reason| {
            policy.on(reason).then(|| {
                metrics
                    .upstream_retries
                    .with_label_values(&[upstream.name.as_str(), reason.label()])
            })
        });
        Some(Budget {
            policy,
            in_flight: AtomicU64::new(0),
            retrying: AtomicU64::new(0),
            counted,
        })
    }

    /// A request to this upstream starts: in flight until the returned `Tries` is dropped.
    pub fn enter(self: &Arc<Budget>) -> Tries {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        Tries {
            budget: self.clone(),
            retries: 0,
            holding: false,
        }
    }

    /// Takes a retry slot if fewer than the budget's share of the requests in flight are
    /// retrying (never fewer than `Retries::MIN_CONCURRENT_RETRIES` allowed).
    fn take_slot(&self) -> bool {
        let in_flight = self.in_flight.load(Ordering::Relaxed);
        let allowed = (in_flight * u64::from(self.policy.budget_percent) / 100)
            .max(Retries::MIN_CONCURRENT_RETRIES);
        self.retrying
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |now| {
                (now < allowed).then_some(now + 1)
            })
            .is_ok()
    }
}

/// One request's tries of its upstream: counted in flight while it lives.
pub struct Tries {
    budget: Arc<Budget>,
    retries: u32,
    /// Whether this request holds one of the budget's retry slots.
    holding: bool,
}

impl Tries {
    pub fn policy(&self) -> &Retries {
        &self.budget.policy
    }

    /// Whether this request may be tried again for `reason`: `reason` is in `on`, `attempts`
    /// are left and the budget has room. A yes is counted.
    pub fn retry(&mut self, reason: RetryOn) -> bool {
        let budget = &*self.budget;
        if !budget.policy.on(reason) || self.retries >= budget.policy.attempts {
            return false;
        }
        if !self.holding {
            if !budget.take_slot() {
                return false;
            }
            self.holding = true;
        }
        self.retries += 1;
        if let Some(counter) = &budget.counted[reason as usize] {
            counter.inc();
        }
        true
    }

    /// Retries granted so far.
    pub fn retries(&self) -> u32 {
        self.retries
    }
}

impl Drop for Tries {
    fn drop(&mut self) {
        self.budget.in_flight.fetch_sub(1, Ordering::Relaxed);
        if self.holding {
            self.budget.retrying.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(toml_retries: &str) -> Arc<Budget> {
        let text = format!(
            "[server]\nlisten = [\"127.0.0.1:0\"]\n[upstreams.u]\nservers = [\"127.0.0.1:1\"]\nretries = {toml_retries}\n[[routes]]\nname = \"r\"\nupstream = \"u\"\n"
        );
        let config = crate::config::parse("t.toml", &text).expect("valid config");
        let metrics = Metrics::new();
        Arc::new(Budget::new(&config.upstreams[0], &metrics).expect("retries set"))
    }

    #[test]
    fn attempts_and_reasons_bound_each_request() {
        let b = budget(r#"{ attempts = 2, on = ["reset", "503"] }"#);
        let mut t = b.enter();
        assert!(!t.retry(RetryOn::Connect), "not in `on`");
        assert!(t.retry(RetryOn::Reset));
        assert!(t.retry(RetryOn::Status503));
        assert!(!t.retry(RetryOn::Reset), "two retries, three tries");
        assert_eq!(t.retries(), 2);
    }

    #[test]
    fn the_budget_is_a_share_of_requests_in_flight_with_a_floor_of_three() {
        let b = budget(r#"{ attempts = 1, on = ["reset"], budget = "20%" }"#);
        // 40 in flight: 20% is 8 retrying at once.
        let mut tries: Vec<Tries> = (0..40).map(|_| b.enter()).collect();
        let granted = tries
            .iter_mut()
            .map(|t| t.retry(RetryOn::Reset))
            .filter(|granted| *granted)
            .count();
        assert_eq!(granted, 8);
        // One that held a slot ends: its slot is free again.
        tries.remove(0);
        let mut late = b.enter();
        assert!(late.retry(RetryOn::Reset));
        drop(late);
        drop(tries);
        // Quiet: 5 in flight, 20% of which is 1, but 3 may retry.
        let mut quiet: Vec<Tries> = (0..5).map(|_| b.enter()).collect();
        let granted = quiet
            .iter_mut()
            .map(|t| t.retry(RetryOn::Reset))
            .filter(|granted| *granted)
            .count();
        assert_eq!(granted, 3);
    }
}

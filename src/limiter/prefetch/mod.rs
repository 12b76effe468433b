//! Prefetch (DESIGN §19): units of a hot key taken ahead from Redis in one atomic call
//! (`lua/prefetch.lua`) and admitted here without a round trip; `held` keeps the units.
//!
//! Every unit admitted from here was charged in Redis before it was used (escrow), so the
//! fleet never admits more than the limit grants. What an instance holds per key:
//!
//! - units, each admitted once (taken under the key's lock), until they expire: `hold`
//!   after the take, or at the end of the window for fixed_window and sliding_window (so
//!   a window's units are admitted in that window);
//! - what it asks for next: its own recent rate for the key, the units asked for in the
//!   last `hold` (or in this one so far, if more), at most `max`. A key that asked for
//!   fewer than three requests' units, or fewer than an eighth of `max`, in both is cold
//!   and goes the normal path unchanged (its rate is followed without an allocation);
//! - one refill in flight per key: the request that finds no units takes them for itself
//!   and those behind it, which wait for it (at most the limiter's timeout) and then take
//!   from what it brought, or go the normal path.
//!
//! The units left over from a take, expired or not, are given back in the call that takes
//! the next ones (the script says how many the key took back; the rest are dropped, the
//! key's state having moved past them). An instance that dies holding units strands at
//! most `max` per key: under-admission, never over.
//!
//! A request with several policies (DESIGN §3, all or nothing): a prefetch policy's held
//! units are taken first; the request's other checks are decided by the backend as
//! without prefetch; when one of them denies (an enforced check, or `on_error = "deny"`
//! failing), the held units are put back, unused, else they are used. A take that grants
//! nothing (the key has less than the request's cost left, or a ban stands) charges
//! nothing and the request goes the normal path, which decides, bans and caches denials
//! as always.
//!
//! The deny cache: a denial cached for a key does not refuse a request while this
//! instance holds units of it (the denial can be decided while a take is out), and a take
//! that grants units forgets it (the key had units left).
//!
//! A reset, an override change or a ban (announced on the fleet's channel, `runtime`)
//! drops the units held for the key (an override: for every key), and so does any failed
//! backend call here: a Redis that restarted empty no longer counts them.

pub(super) mod held;

use std::sync::Arc;
use std::time::Duration;

use super::backend::{BackendError, Check};
use super::fleet::Fleet;
use super::pipeline::Answer;
use super::{config, runtime, Limiter};
use crate::config::{OnError, Policy};
use crate::metrics::Metrics;
use held::{Step, Taken, Ticket, Units};

impl Limiter {
    /// The store prefetch takes units from, when one of `checked` (indexes into `policies`)
    /// prefetches and the backend is shared by a fleet (Redis); None: the request goes the
    /// normal path.
    pub(super) fn prefetcher(
        &self,
        policies: &[Policy],
        checked: &[usize],
    ) -> Option<&Arc<dyn Fleet>> {
        let fleet = self.fleet.as_ref()?;
        checked
            .iter()
            .any(|&id| policies[id].prefetch.is_some())
            .then_some(fleet)
    }

    /// The backend's verdicts for `checks` (`call_store`), with the checks of prefetch
    /// policies admitted from held units where this instance holds some (or takes them
    /// now); held units are used only when the whole request passes.
    pub(super) async fn call_with_held(
        &self,
        fleet: &Arc<dyn Fleet>,
        route: usize,
        checks: &[Check],
        now: u64,
        policies: &[Policy],
        checked: &[usize],
    ) -> Vec<Answer> {
        let mut tickets: Vec<Option<Ticket>> = Vec::with_capacity(checks.len());
        for (check, &id) in checks.iter().zip(checked) {
            let policy = &policies[id];
            let ticket = match policy.prefetch {
                Some(cfg) if check.cost > 0 && policy.metering.is_none() => {
                    self.prefetched(fleet.as_ref(), route, policy, check, cfg.max, cfg.hold)
                        .await
                }
                _ => None,
            };
            tickets.push(ticket);
        }
        if tickets.iter().all(Option::is_none) {
            let verdicts = self.call_store(checks, now, policies, checked).await;
            self.after_store(fleet, checks, checked, policies, &verdicts);
            return verdicts;
        }
        let (rest, rest_ids): (Vec<Check>, Vec<usize>) = checks
            .iter()
            .zip(checked)
            .zip(&tickets)
            .filter(|(_, t)| t.is_none())
            .map(|((c, &id), _)| (c.clone(), id))
            .unzip();
        let from_store = if rest.is_empty() {
            Vec::new()
        } else {
            let verdicts = self.call_store(&rest, now, policies, &rest_ids).await;
            self.after_store(fleet, &rest, &rest_ids, policies, &verdicts);
            verdicts
        };
        let mut from_store = from_store.into_iter();
        let merged: Vec<Answer> = tickets
            .iter()
            .map(|t| match t {
                Some(t) => (Ok(t.verdict), self.backend.clone()),
                None => from_store
                    .next()
                    .unwrap_or_else(|| (Err(OnError::Allow), self.backend.clone())),
            })
            .collect();
        // All or nothing, as `apply` decides it: an enforced check denied, or failing
        // with on_error = "deny", refuses the request.
        let refused = merged.iter().zip(checks).any(|((v, _), c)| {
            c.enforce && (matches!(v, Ok(v) if !v.allowed) || matches!(v, Err(OnError::Deny)))
        });
        for ticket in tickets.into_iter().flatten() {
            if refused {
                ticket.put_back();
            } else {
                ticket.used();
            }
        }
        merged
    }

    /// After a backend call: a failure drops every held unit (a Redis that restarted empty
    /// no longer counts them); a prefetch key found banned is dropped here, and on every
    /// instance (announced).
    fn after_store(
        &self,
        fleet: &Arc<dyn Fleet>,
        checks: &[Check],
        checked: &[usize],
        policies: &[Policy],
        verdicts: &[Answer],
    ) {
        let holder = &self.shared.prefetch;
        if verdicts.iter().any(|(v, _)| v.is_err()) {
            holder.drop_all();
            return;
        }
        for ((check, &id), (verdict, _)) in checks.iter().zip(checked).zip(verdicts) {
            let banned = matches!(verdict, Ok(v) if !v.allowed) && check.ban_ms > 0;
            if banned && policies[id].prefetch.is_some() {
                holder.drop_key(&check.key);
                let message = format!("{}{}", runtime::DROP, check.key);
                let (fleet, channel) = (
                    fleet.clone(),
                    runtime::channel_name(&self.settings.key_prefix),
                );
                tokio::spawn(async move {
                    let _ = fleet.announce(&channel, &message).await;
                });
            }
        }
    }

    /// `check`'s units from the holder, taken now or after the refill in flight, or by a
    /// refill of its own; None: decide it the normal way.
    async fn prefetched(
        &self,
        fleet: &dyn Fleet,
        route: usize,
        policy: &Policy,
        check: &Check,
        max: u64,
        hold: Duration,
    ) -> Option<Ticket> {
        let hold = (hold.as_millis() as u64).max(1);
        let now = self.clock.now_ms();
        let entry = self
            .shared
            .prefetch
            .hot_entry(&check.key, check.cost, hold, max, now)?;
        for waited in [false, true] {
            let now = if waited { self.clock.now_ms() } else { now };
            match entry.step(check, hold, max, now) {
                Step::Took(ticket) => return Some(ticket),
                Step::Cold => return None,
                Step::Wait(_) if waited => return None,
                Step::Wait(refilled) => {
                    let _ = tokio::time::timeout(self.settings.timeout, refilled).await;
                }
                Step::Refill {
                    want,
                    back,
                    back_at,
                    generation,
                } => {
                    let taken = self.take(fleet, check, want, back, back_at, now).await;
                    let units = self.prefetch_units(route, policy);
                    return entry.refilled(check, taken, back, generation, hold, now, &units);
                }
            }
        }
        None
    }

    /// One take from the store (`lua/prefetch.lua`), bounded by the timeout and counted as
    /// a decision's call is; None when the circuit is open or the call failed, which drops
    /// every unit held (a take that timed out may have been charged all the same).
    async fn take(
        &self,
        fleet: &dyn Fleet,
        check: &Check,
        want: u64,
        back: u64,
        back_at: u64,
        now: u64,
    ) -> Option<Taken> {
        if self.breaker.is_open(now) {
            // Nothing to ask a backend whose circuit is open (the normal path counts it).
            self.shared.prefetch.drop_all();
            return None;
        }
        let call = fleet.take(check, want, back, back_at, now);
        let result = match tokio::time::timeout(self.settings.timeout, call).await {
            Ok(r) => r,
            Err(_) => Err(BackendError::Timeout),
        };
        match result {
            Ok(taken) => {
                self.backend_answered();
                // The key had units left: a denial cached for it before is stale.
                if taken.granted > 0 {
                    if let Some(cache) = &self.deny_cache {
                        cache.forget(&check.key);
                    }
                }
                Some(taken)
            }
            Err(e) => {
                log::debug!("prefetch on {}: {e}", check.key);
                self.backend_failed(&e, now);
                self.shared.prefetch.drop_all();
                None
            }
        }
    }

    /// The counters a key's units are counted under: its route's and policy's.
    fn prefetch_units(&self, route: usize, policy: &Policy) -> Arc<Units> {
        let route = self.route_label(route, policy);
        let kind = |k: &str| {
            self.metrics.prefetch_units.with_label_values(&[
                route.as_str(),
                policy.name.as_str(),
                k,
            ])
        };
        Arc::new(Units {
            taken: kind("taken"),
            used: kind("used"),
            returned: kind("returned"),
            dropped: kind("dropped"),
        })
    }
}

/// Every `kind` label value of `sluice_prefetch_units_total`.
pub const KINDS: [&str; 4] = ["taken", "used", "returned", "dropped"];

/// Primes `sluice_prefetch_units_total` for every route's prefetch policies, where prefetch
/// takes effect (a Redis backend).
pub(super) fn prime(metrics: &Metrics, cfg: &config::Config) {
    if matches!(cfg.limiter.backend, config::Backend::Memory) {
        return;
    }
    for route in &cfg.routes {
        for &id in &route.policies {
            let policy = &cfg.policies[id];
            if policy.prefetch.is_some() && policy.metering.is_none() {
                for kind in KINDS {
                    metrics.prefetch_units.with_label_values(&[
                        route.label(),
                        policy.name.as_str(),
                        kind,
                    ]);
                }
            }
        }
    }
}

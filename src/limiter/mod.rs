//! The limiter layer: everything that does not depend on where state lives.
//!
//! It turns a route's policies into `Check`s (keys, exemptions, missing parts), asks the
//! deny cache and then the backend for one all-or-nothing decision, applies shadow mode,
//! timeouts, the circuit breaker and `on_error`, and counts every decision.

mod admin;
pub mod algorithm;
pub mod backend;
pub mod calendar;
pub mod connections;
mod deny_cache;
mod identity;
pub mod keyed;
pub mod memory;
pub mod overrides;
mod prefetch;
pub mod redis;
pub mod runtime;
pub mod series;
pub mod top;

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use algorithm::{Rule, Verdict};
use backend::{Adjustment, Backend, BackendError, Check};
use deny_cache::DenyCache;

/// Hashes client-chosen keys in process (memory shards, the top sketch): fast, and seeded
/// at random per process so nobody can aim collisions at one shard or sketch slot.
static KEY_HASHER: LazyLock<foldhash::fast::FixedState> =
    LazyLock::new(|| foldhash::fast::FixedState::with_seed(rand::random()));
use memory::MemoryBackend;

pub use admin::{NamedKey, Quota};

use crate::clock::Clock;
use crate::config::{self, Algorithm, Mode, Numbers, OnError, OnMissing, Policy};
use crate::key::{self, RequestFacts};
use crate::metrics::Metrics;

/// Consecutive failures that open the circuit breaker, and how long it stays open.
const BREAKER_THRESHOLD: u32 = 3;
const BREAKER_OPEN: Duration = Duration::from_millis(500);

/// Every `decision` label value of `sluice_decisions_total` (`Decision::label`).
pub const DECISIONS: [&str; 9] = [
    "allowed",
    "rejected",
    "delayed",
    "shadow_rejected",
    "skipped",
    "exempt",
    "error_allowed",
    "error_denied",
    "banned",
];

/// How one policy came out for one request (the `decision` metric label). In the order of
/// `DECISIONS`, so `decision as usize` indexes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Allowed,
    Rejected,
    Delayed,
    ShadowRejected,
    Skipped,
    Exempt,
    ErrorAllowed,
    ErrorDenied,
    /// Rejected by a standing `ban`, without asking the algorithm.
    Banned,
}

impl Decision {
    pub fn label(self) -> &'static str {
        match self {
            Decision::Allowed => "allowed",
            Decision::Rejected => "rejected",
            Decision::Delayed => "delayed",
            Decision::ShadowRejected => "shadow_rejected",
            Decision::Skipped => "skipped",
            Decision::Exempt => "exempt",
            Decision::ErrorAllowed => "error_allowed",
            Decision::ErrorDenied => "error_denied",
            Decision::Banned => "banned",
        }
    }
}

/// One policy's part in a request's outcome.
#[derive(Debug, Clone)]
pub struct PolicyOutcome {
    pub policy: usize,
    pub decision: Decision,
    /// Present when the policy was decided (shown in response headers unless shadow).
    pub verdict: Option<Verdict>,
    /// The numbers the policy was decided with (an override's or its own), with `verdict`.
    pub rule: Option<Rule>,
}

/// How a response settled a metered policy's charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// The response cost this many units.
    Cost(u64),
    /// `count`: the status counts; the charge stands.
    Kept,
    /// `count`: the status does not count; the charge is taken back.
    Refunded,
    /// No usable cost: the reservation stands when `kept` (a 2xx), else is taken back.
    Missing { kept: bool },
}

/// Why a request may not pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Denial {
    /// Over a limit (or a key part missing with `on_missing = "deny"`).
    Limited {
        status: u16,
        retry_after_ms: u64,
        violated: Vec<String>,
    },
    /// The backend failed and a policy says `on_error = "deny"`.
    BackendDown,
}

/// A concurrency slot this request holds until it ends.
///
/// The slot is held for the request's whole life, however long (a WebSocket, a long
/// download): while the lease is held, a task renews it every third of `lease`, so the
/// backend's expiry only ever reclaims the slots of an instance that died without
/// releasing them. Dropping the lease stops the renewals and releases the slot.
pub struct Lease {
    key: String,
    id: u64,
    backend: Arc<dyn Backend>,
    renewal: Option<tokio::task::AbortHandle>,
}

impl Lease {
    fn hold(
        key: String,
        id: u64,
        lease_ms: u64,
        backend: Arc<dyn Backend>,
        clock: Arc<dyn Clock>,
    ) -> Lease {
        let renewal = tokio::runtime::Handle::try_current().ok().map(|handle| {
            let (key, backend) = (key.clone(), backend.clone());
            handle
                .spawn(renew_while_held(key, id, lease_ms, backend, clock))
                .abort_handle()
        });
        Lease {
            key,
            id,
            backend,
            renewal,
        }
    }
}

/// Renews lease `id` every third of `lease_ms` until aborted. A failed renewal is tried
/// again at the next tick (two more chances before the lease would expire); a lease found
/// already gone (expired while the backend was unreachable, or the store was emptied) is not
/// taken back, as its slot may be another request's by now.
async fn renew_while_held(
    key: String,
    id: u64,
    lease_ms: u64,
    backend: Arc<dyn Backend>,
    clock: Arc<dyn Clock>,
) {
    let every = Duration::from_millis((lease_ms / 3).max(1));
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let renewed =
            tokio::time::timeout(every, backend.renew(&key, id, lease_ms, clock.now_ms())).await;
        match renewed {
            Ok(Ok(true)) => {}
            Ok(Ok(false)) => {
                log::warn!(
                    "concurrency lease on {key} expired before it was renewed; \
                     the request goes on without its slot"
                );
                return;
            }
            Ok(Err(e)) => log::debug!("renewing concurrency lease on {key} failed: {e}"),
            Err(_) => log::debug!("renewing concurrency lease on {key} timed out"),
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(renewal) = self.renewal.take() {
            renewal.abort();
        }
        if self.backend.release_in_place(&self.key, self.id) {
            return;
        }
        let (key, id, backend) = (std::mem::take(&mut self.key), self.id, self.backend.clone());
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                let _ = backend.release(&key, id).await;
            });
        }
    }
}

pub struct Outcome {
    pub policies: Vec<PolicyOutcome>,
    pub denial: Option<Denial>,
    /// Allowed: how long to hold the request before forwarding it.
    pub wait_ms: u64,
    pub leases: Vec<Lease>,
    /// Allowed: the charges of metered policies, for the response to settle.
    pub charges: Vec<Charge>,
}

/// A metered policy's charge made at admission, which its response settles (DESIGN §12).
pub struct Charge {
    /// An index into the config's policies.
    pub policy: usize,
    check: Check,
    charged_at: u64,
    /// The backend that made it (the memory fallback's charge is settled there).
    backend: Arc<dyn Backend>,
}

impl Charge {
    /// The units held.
    pub fn held(&self) -> u64 {
        self.check.cost
    }
}

/// Long-lived parts that survive reloads when their settings do not change.
pub struct Limiter {
    settings: config::Limiter,
    backend: Arc<dyn Backend>,
    /// The backend when it is Redis: prefetch takes units from it (DESIGN §19).
    redis: Option<Arc<redis::RedisBackend>>,
    /// The memory backend: the store itself, or the `on_error = "local"` fallback.
    local: Arc<MemoryBackend>,
    deny_cache: Option<DenyCache>,
    breaker: Breaker,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
    /// This backend's series, resolved once: every decision touches them.
    backend_up: prometheus::IntGauge,
    decision_time: prometheus::Histogram,
    leases: AtomicU64,
    /// Runtime overrides; kept across reloads.
    shared: Arc<runtime::Shared>,
    /// Follows the fleet's runtime changes while this backend is in use (shared backends).
    follower: Option<Arc<Follower>>,
    /// Heavy-hitter sketches (`[admin] top_keys` slots each; none when 0), one per policy
    /// in the config's order, so a decision finds its sketch by index, not by name.
    top: Vec<(String, Arc<parking_lot::Mutex<top::SpaceSaving>>)>,
    /// The decision counters of each route (by index) and each of its policies (in the
    /// route's order), resolved once per config: no label lookup per request.
    counters: Vec<Vec<PolicyCounters>>,
}

/// `sluice_decisions_total` (one per `Decision`) and `sluice_near_limit_total` of one
/// route and policy.
struct PolicyCounters {
    /// Resolved up front for the decisions the policy can produce (DESIGN §16), the rest
    /// on first use (a series that exists only once it moves).
    decisions: Vec<std::sync::OnceLock<prometheus::IntCounter>>,
    /// The `route` and `policy` labels, for a decision resolved late.
    labels: [String; 2],
    near_limit: prometheus::IntCounter,
}

/// Aborts the follower task when the last limiter using its backend is gone.
pub struct Follower(tokio::task::AbortHandle);

impl Drop for Follower {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[derive(Default)]
struct Breaker {
    failures: AtomicU32,
    /// Milliseconds (on the limiter clock) until which calls are not attempted.
    open_until: AtomicU64,
}

impl Limiter {
    /// Builds the limiter for `cfg`, reusing `previous`'s backend and state when the
    /// `[limiter]` settings did not change, and its deny cache when no policy changed.
    pub async fn new(
        cfg: &config::Config,
        previous: Option<&Limiter>,
        previous_policies: &[Policy],
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
    ) -> Result<Limiter, BackendError> {
        let settings = cfg.limiter.clone();
        let same = previous.filter(|p| p.settings == settings);
        let local = match same {
            Some(p) => p.local.clone(),
            None => Arc::new(
                MemoryBackend::new(settings.max_keys)
                    .counting_evictions(metrics.memory_evictions.clone()),
            ),
        };
        let redis = match (&settings.backend, same) {
            (config::Backend::Memory, _) => None,
            (_, Some(p)) => p.redis.clone(),
            (_, None) => Some(Arc::new(redis::RedisBackend::connect(&settings).await?)),
        };
        let backend: Arc<dyn Backend> = match &redis {
            Some(r) => r.clone(),
            None => local.clone(),
        };
        let policies_same = cfg.policies.len() == previous_policies.len()
            && cfg
                .policies
                .iter()
                .zip(previous_policies)
                .all(|(a, b)| a.name == b.name && a.same_rule(b));
        let deny_cache = match (&settings.backend, same) {
            (config::Backend::Memory, _) => None,
            _ if settings.deny_cache == 0 => None,
            (_, Some(p)) if policies_same => p.deny_cache.clone(),
            _ => Some(DenyCache::new(settings.deny_cache)),
        };
        let shared = previous.map(|p| p.shared.clone()).unwrap_or_default();
        shared.set_deny_cache(deny_cache.clone());
        if same.is_none() {
            // Units held were taken from another backend.
            shared.prefetch.drop_all();
        }
        prefetch::prime(&metrics, cfg);
        let follower = match same {
            Some(p) => p.follower.clone(),
            None => {
                let listener = Arc::new(runtime::FleetListener {
                    shared: Arc::downgrade(&shared),
                    backend: backend.clone(),
                    hash: runtime::hash_name(&settings.key_prefix),
                    consumers: crate::auth::consumers::hash_name(&settings.key_prefix),
                    io_timeout: settings.timeout.max(Duration::from_millis(250)),
                });
                let channel = runtime::channel_name(&settings.key_prefix);
                backend
                    .follow(&channel, listener)
                    .map(|task| Arc::new(Follower(task)))
            }
        };
        let slots = cfg.admin.top_keys;
        let top = if slots == 0 {
            Vec::new()
        } else {
            cfg.policies
                .iter()
                .map(|policy| {
                    let kept = previous
                        .and_then(|p| p.sketch(&policy.name))
                        .filter(|s| s.lock().capacity() == slots)
                        .cloned();
                    let sketch = kept.unwrap_or_else(|| {
                        Arc::new(parking_lot::Mutex::new(top::SpaceSaving::new(slots)))
                    });
                    (policy.name.clone(), sketch)
                })
                .collect()
        };
        let counters = cfg
            .routes
            .iter()
            .map(|route| {
                route
                    .policies
                    .iter()
                    .map(|&id| {
                        let policy = &cfg.policies[id];
                        let labels = [route.label(), policy.name.as_str()];
                        let possible = series::possible_decisions(
                            policy,
                            &settings.backend,
                            settings.on_error,
                        );
                        PolicyCounters {
                            decisions: DECISIONS
                                .iter()
                                .map(|d| {
                                    let cell = std::sync::OnceLock::new();
                                    if possible.contains(d) {
                                        let _ = cell.set(
                                            metrics
                                                .decisions
                                                .with_label_values(&[labels[0], labels[1], d]),
                                        );
                                    }
                                    cell
                                })
                                .collect(),
                            labels: labels.map(str::to_owned),
                            near_limit: metrics.near_limit.with_label_values(&labels),
                        }
                    })
                    .collect()
            })
            .collect();
        let backend_up = metrics.backend_up.with_label_values(&[backend.name()]);
        backend_up.set(1);
        let decision_time = metrics
            .limiter_duration
            .with_label_values(&[backend.name()]);
        Ok(Limiter {
            settings,
            backend,
            redis,
            local,
            deny_cache,
            breaker: Breaker::default(),
            clock,
            metrics,
            backend_up,
            decision_time,
            leases: AtomicU64::new(rand::random::<u64>() | 1),
            shared,
            follower,
            top,
            counters,
        })
    }

    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// `<key_prefix>{<hash>}:<policy>:<algorithm>` (DESIGN §3), built without `fmt`: it is
    /// on every decision's path.
    fn storage_key(&self, policy: &Policy, value: &[u8]) -> String {
        let (prefix, name, algorithm) = (
            &self.settings.key_prefix,
            &policy.name,
            policy.algorithm.name(),
        );
        let mut key = String::with_capacity(prefix.len() + name.len() + algorithm.len() + 36);
        key.push_str(prefix);
        key.push('{');
        key::push_hash(&mut key, value);
        key.push_str("}:");
        key.push_str(name);
        key.push(':');
        key.push_str(algorithm);
        key
    }

    /// Decides one request against `policy_ids` (indexes into `policies`, the policies of
    /// the config this limiter was built for) of route `route` (an index into its routes).
    pub async fn decide(
        &self,
        route: usize,
        policies: &[Policy],
        policy_ids: &[usize],
        req: &RequestFacts<'_>,
    ) -> Outcome {
        let mut outcome = Outcome {
            policies: Vec::with_capacity(policy_ids.len()),
            denial: None,
            wait_ms: 0,
            leases: Vec::new(),
            charges: Vec::new(),
        };
        if policy_ids.is_empty() {
            return outcome;
        }
        let now = self.clock.now_ms();
        let mut checks: Vec<Check> = Vec::with_capacity(policy_ids.len());
        let mut checked: Vec<usize> = Vec::with_capacity(policy_ids.len());
        let mut violated: Vec<usize> = Vec::new();
        // The key values of the policies decided, for the heavy-hitter sketches.
        let mut seen: Vec<(usize, Vec<u8>)> = Vec::new();
        for &id in policy_ids {
            let policy = &policies[id];
            if policy.exempt.iter().any(|net| net.contains(&req.client_ip)) {
                outcome.policies.push(PolicyOutcome {
                    policy: id,
                    decision: Decision::Exempt,
                    verdict: None,
                    rule: None,
                });
                continue;
            }
            let value = match (key::key_value(&policy.key, req), policy.on_missing) {
                (Some(v), _) => v,
                (None, OnMissing::Skip) => {
                    outcome.policies.push(PolicyOutcome {
                        policy: id,
                        decision: Decision::Skipped,
                        verdict: None,
                        rule: None,
                    });
                    continue;
                }
                (None, OnMissing::Deny) => {
                    let shadow = policy.mode == Mode::Shadow;
                    let decision = if shadow {
                        Decision::ShadowRejected
                    } else {
                        Decision::Rejected
                    };
                    outcome.policies.push(PolicyOutcome {
                        policy: id,
                        decision,
                        verdict: None,
                        rule: None,
                    });
                    if !shadow {
                        violated.push(id);
                    }
                    continue;
                }
                // Every request without the part shares one bucket.
                (None, OnMissing::Shared) => b"\xffmissing".to_vec(),
                (None, OnMissing::ClientIp) => key::key_value_or_ip(&policy.key, req),
            };
            let key = self.storage_key(policy, &value);
            if !self.top.is_empty() {
                seen.push((id, value));
            }
            let enforce = policy.mode == Mode::Enforce;
            let rule = rule_of(policy, self.numbers_for(policy, &key, req));
            let cost = policy
                .reserve_request
                .map_or(policy.cost, |most| req.request_bound.unwrap_or(most));
            if enforce && policy.algorithm != Algorithm::Concurrency {
                if let Some(denied) = self.cached_denial(policy, id, &key, now, rule, cost) {
                    outcome.policies.push(denied);
                    violated.push(id);
                    continue;
                }
            }
            checks.push(Check {
                key,
                rule,
                cost,
                enforce,
                // Shadow policies ban nobody.
                ban_ms: if enforce {
                    policy.ban.as_millis() as u64
                } else {
                    0
                },
                // An observe-only (cost 0) concurrency policy holds no slot.
                lease: if policy.algorithm == Algorithm::Concurrency && policy.cost > 0 {
                    self.next_lease()
                } else {
                    0
                },
            });
            checked.push(id);
        }
        if !violated.is_empty() {
            // Already denied: ask nothing more, charge nothing.
            self.finish_denied(policies, &mut outcome, &violated);
            self.count(route, policies, policy_ids, &outcome);
            self.feed_top(&outcome, seen);
            return outcome;
        }
        if !checks.is_empty() {
            let verdicts = self
                .call_backend(route, &checks, now, policies, &checked)
                .await;
            self.apply(&mut outcome, policies, &checks, &checked, verdicts, now);
        }
        self.count(route, policies, policy_ids, &outcome);
        self.feed_top(&outcome, seen);
        outcome
    }

    /// What the deny cache answers for `key` (policy `id`'s, under `rule`, asked for `cost`)
    /// when it holds a denial that covers it: the request is refused without asking the
    /// backend (counted).
    fn cached_denial(
        &self,
        policy: &Policy,
        id: usize,
        key: &str,
        now: u64,
        rule: Rule,
        cost: u64,
    ) -> Option<PolicyOutcome> {
        let hit = self.deny_cache.as_ref()?.get(key, now, &rule, cost)?;
        self.metrics
            .deny_cache_hits
            .with_label_values(&[&policy.name])
            .inc();
        // Nothing is left until the key may pass again.
        let verdict = Verdict {
            allowed: false,
            retry_after_ms: hit.retry_after_ms,
            reset_ms: hit.retry_after_ms,
            banned: hit.banned,
            ..Verdict::default()
        };
        Some(PolicyOutcome {
            policy: id,
            decision: if hit.banned {
                Decision::Banned
            } else {
                Decision::Rejected
            },
            verdict: Some(verdict),
            rule: Some(rule),
        })
    }

    /// Settles the charges of one request's metered policies once its response is known:
    /// each with the units its response cost (`None`: no usable cost was found, so the
    /// charge stands when `kept`, else is refunded). A cost above 2^53 (a header's, a usage
    /// sum's) is charged as 2^53 (DESIGN §17). One backend call per backend, bounded by the
    /// limiter's timeout; a failure leaves the charge as it was (counted).
    pub async fn settle(&self, route: usize, policies: &[Policy], settled: Vec<(Charge, Settled)>) {
        let mut by_backend: Vec<(Arc<dyn Backend>, Vec<Adjustment>)> = Vec::new();
        let now = self.clock.now_ms();
        for (charge, how) in settled {
            let policy = &policies[charge.policy];
            let held = charge.check.cost;
            let labels = self.route_label(route, policy);
            let units = |kind: &str, n: u64| {
                if n > 0 {
                    self.metrics
                        .policy_units
                        .with_label_values(&[&labels, &policy.name, kind])
                        .inc_by(n);
                }
            };
            units("reserved", held);
            let cost = match how {
                Settled::Cost(cost) => algorithm::clamp_cost(cost),
                Settled::Kept => held,
                Settled::Refunded => 0,
                Settled::Missing { kept } => {
                    self.metrics
                        .response_cost_missing
                        .with_label_values(&[&labels, &policy.name])
                        .inc();
                    if kept {
                        held
                    } else {
                        0
                    }
                }
            };
            units("charged", cost);
            units("refunded", held.saturating_sub(cost));
            // Both at most 2^53 (a reservation is a checked cost): no overflow.
            let amount = cost as i64 - algorithm::clamp_cost(held) as i64;
            if amount == 0 {
                continue;
            }
            let adjustment = Adjustment {
                check: charge.check,
                charged_at: charge.charged_at,
                amount,
            };
            match by_backend
                .iter_mut()
                .find(|(b, _)| Arc::ptr_eq(b, &charge.backend))
            {
                Some((_, list)) => list.push(adjustment),
                None => by_backend.push((charge.backend, vec![adjustment])),
            }
        }
        for (backend, adjustments) in by_backend {
            let call = backend.adjust(&adjustments, now);
            let result = match tokio::time::timeout(self.settings.timeout, call).await {
                Ok(r) => r,
                Err(_) => Err(BackendError::Timeout),
            };
            if let Err(e) = result {
                self.metrics
                    .backend_errors
                    .with_label_values(&[backend.name(), e.kind()])
                    .inc();
                log::warn!(
                    "limiter: settling {} charges on {} failed: {e}",
                    adjustments.len(),
                    backend.name()
                );
            }
        }
    }

    /// The `route` label the decisions of `policy` on route `route` are counted under.
    fn route_label(&self, route: usize, policy: &Policy) -> String {
        self.counters
            .get(route)
            .and_then(|c| c.iter().find(|c| c.labels[1] == policy.name))
            .map_or_else(String::new, |c| c.labels[0].clone())
    }

    /// Counts each decided key in its policy's sketch: its hash always, its values only
    /// when it takes a slot.
    fn feed_top(&self, outcome: &Outcome, seen: Vec<(usize, Vec<u8>)>) {
        for (id, value) in seen {
            let Some(p) = outcome.policies.iter().find(|p| p.policy == id) else {
                continue;
            };
            let rejected = match p.decision {
                Decision::Rejected
                | Decision::Banned
                | Decision::ShadowRejected
                | Decision::ErrorDenied => true,
                Decision::Allowed | Decision::Delayed | Decision::ErrorAllowed => false,
                Decision::Skipped | Decision::Exempt => continue,
            };
            let Some((_, sketch)) = self.top.get(id) else {
                continue;
            };
            let hash = KEY_HASHER.hash_one(&value);
            sketch.lock().record(
                hash,
                || String::from_utf8_lossy(&value).into_owned(),
                rejected,
            );
        }
    }

    /// The numbers `policy` counts the key `key` with for `req`: a runtime override for
    /// the exact key, else the first matching config override, else the policy's own.
    fn numbers_for(&self, policy: &Policy, key: &str, req: &RequestFacts) -> Numbers {
        self.runtime_override(policy, key)
            .unwrap_or_else(|| overrides::resolve(policy, req))
    }

    /// The hook for the admin API's runtime overrides (DESIGN §9.2): the numbers set for
    /// this exact storage key, which win over every config override. None until that
    /// store exists; it plugs in here, and nothing below this layer changes.
    fn runtime_override(&self, _policy: &Policy, key: &str) -> Option<Numbers> {
        self.shared.numbers(key)
    }

    fn next_lease(&self) -> u64 {
        // Odd numbers from a random start: never 0, unique per process.
        self.leases.fetch_add(2, Ordering::Relaxed)
    }

    /// The backend's verdicts, or per-check fallbacks when it fails (`call_backend`, in
    /// `prefetch`, asks it for what held units do not cover).
    async fn call_store(
        &self,
        checks: &[Check],
        now: u64,
        policies: &[Policy],
        checked: &[usize],
    ) -> Vec<(Result<Verdict, OnError>, Arc<dyn Backend>)> {
        let started = Instant::now();
        let result = if let Some(verdicts) = self.backend.decide_in_place(checks, now) {
            // In process: no boxed future, no timer (callgrind: about a tenth of a memory
            // decision's cost).
            Ok(verdicts)
        } else if self.breaker.open_until.load(Ordering::Relaxed) > now {
            Err(BackendError::CircuitOpen)
        } else {
            // Pingora's shared 10 ms timer wheel: no per-decision timer registration.
            let decided = self.backend.decide(checks, now);
            match pingora::prelude::fast_timeout::fast_timeout(self.settings.timeout, decided).await
            {
                Ok(r) => r,
                Err(_) => Err(BackendError::Timeout),
            }
        };
        let name = self.backend.name();
        self.decision_time.observe(started.elapsed().as_secs_f64());
        match result {
            Ok(verdicts) => {
                self.breaker.failures.store(0, Ordering::Relaxed);
                self.backend_up.set(1);
                verdicts
                    .into_iter()
                    .map(|v| (Ok(v), self.backend.clone()))
                    .collect()
            }
            Err(e) => {
                self.metrics
                    .backend_errors
                    .with_label_values(&[name, e.kind()])
                    .inc();
                if e != BackendError::CircuitOpen {
                    self.backend_up.set(0);
                    let failures = self.breaker.failures.fetch_add(1, Ordering::Relaxed) + 1;
                    if failures >= BREAKER_THRESHOLD {
                        let until = now + BREAKER_OPEN.as_millis() as u64;
                        self.breaker.open_until.store(until, Ordering::Relaxed);
                        log::warn!("limiter backend {name} failing ({e}); circuit open for {BREAKER_OPEN:?}");
                    }
                }
                self.fallback(checks, now, policies, checked)
            }
        }
    }

    /// `on_error` per policy: `local` checks are decided together by the memory backend.
    fn fallback(
        &self,
        checks: &[Check],
        now: u64,
        policies: &[Policy],
        checked: &[usize],
    ) -> Vec<(Result<Verdict, OnError>, Arc<dyn Backend>)> {
        let on_error: Vec<OnError> = checked
            .iter()
            .map(|&id| policies[id].on_error.unwrap_or(self.settings.on_error))
            .collect();
        let local_checks: Vec<Check> = checks
            .iter()
            .zip(&on_error)
            .filter(|(_, e)| **e == OnError::Local)
            .map(|(c, _)| c.clone())
            .collect();
        let mut local_verdicts = self.local.decide_now(&local_checks, now).into_iter();
        let local: Arc<dyn Backend> = self.local.clone();
        on_error
            .iter()
            .map(|e| match e {
                OnError::Local => (Ok(local_verdicts.next().unwrap_or_default()), local.clone()),
                other => (Err(*other), local.clone()),
            })
            .collect()
    }

    fn apply(
        &self,
        outcome: &mut Outcome,
        policies: &[Policy],
        checks: &[Check],
        checked: &[usize],
        verdicts: Vec<(Result<Verdict, OnError>, Arc<dyn Backend>)>,
        now: u64,
    ) {
        let mut violated = Vec::new();
        let mut backend_down = false;
        for ((check, &id), (verdict, _)) in checks.iter().zip(checked).zip(&verdicts) {
            let decision = match verdict {
                Ok(v) if v.allowed && v.wait_ms > 0 => Decision::Delayed,
                Ok(v) if v.allowed => Decision::Allowed,
                Ok(_) if !check.enforce => Decision::ShadowRejected,
                Ok(v) if v.banned => {
                    violated.push(id);
                    Decision::Banned
                }
                Ok(_) => {
                    violated.push(id);
                    Decision::Rejected
                }
                Err(OnError::Deny) if check.enforce => {
                    backend_down = true;
                    Decision::ErrorDenied
                }
                Err(OnError::Deny) => Decision::ErrorDenied,
                Err(_) => Decision::ErrorAllowed,
            };
            outcome.policies.push(PolicyOutcome {
                policy: id,
                decision,
                verdict: verdict.as_ref().ok().copied(),
                rule: Some(check.rule),
            });
        }
        if backend_down {
            outcome.denial = Some(Denial::BackendDown);
            return;
        }
        if !violated.is_empty() {
            if let Some(cache) = &self.deny_cache {
                for ((check, _), (verdict, _)) in checks.iter().zip(checked).zip(&verdicts) {
                    if let Ok(v) = verdict {
                        if check.enforce
                            && !v.allowed
                            && check.rule.algorithm != Algorithm::Concurrency
                        {
                            // A denial of a banning check is a ban (set now, or standing).
                            if check.ban_ms > 0 {
                                cache.insert_ban(&check.key, now + v.retry_after_ms);
                            } else {
                                cache.insert(
                                    &check.key,
                                    now + v.retry_after_ms,
                                    &check.rule,
                                    check.cost,
                                );
                            }
                        }
                    }
                }
            }
            self.finish_denied(policies, outcome, &violated);
            return;
        }
        for ((check, &id), (verdict, backend)) in checks.iter().zip(checked).zip(verdicts) {
            let Ok(v) = verdict else { continue };
            outcome.wait_ms = outcome.wait_ms.max(v.wait_ms);
            if policies[id].metering.is_some() && v.allowed && check.cost > 0 {
                outcome.charges.push(Charge {
                    policy: id,
                    check: check.clone(),
                    charged_at: now,
                    backend: backend.clone(),
                });
            }
            if check.lease != 0 && v.allowed {
                outcome.leases.push(Lease::hold(
                    check.key.clone(),
                    check.lease,
                    check.rule.lease_ms,
                    backend,
                    self.clock.clone(),
                ));
            }
        }
    }

    fn finish_denied(&self, policies: &[Policy], outcome: &mut Outcome, violated: &[usize]) {
        let status = policies[violated[0]].status;
        let retry_after_ms = outcome
            .policies
            .iter()
            .filter(|p| violated.contains(&p.policy))
            .filter_map(|p| p.verdict.map(|v| v.retry_after_ms))
            .max()
            .unwrap_or(0);
        let names = violated
            .iter()
            .map(|&id| policies[id].name.clone())
            .collect();
        outcome.denial = Some(Denial::Limited {
            status,
            retry_after_ms,
            violated: names,
        });
    }

    fn count(&self, route: usize, policies: &[Policy], policy_ids: &[usize], outcome: &Outcome) {
        let Some(counters) = self.counters.get(route) else {
            return;
        };
        for p in &outcome.policies {
            let Some(c) = policy_ids
                .iter()
                .position(|&id| id == p.policy)
                .and_then(|at| counters.get(at))
            else {
                continue;
            };
            c.decisions[p.decision as usize]
                .get_or_init(|| {
                    let [route, policy] = &c.labels;
                    self.metrics
                        .decisions
                        .with_label_values(&[route, policy, p.decision.label()])
                })
                .inc();
            if let (Decision::Allowed | Decision::Delayed, Some(v)) = (p.decision, p.verdict) {
                if near_limit(&policies[p.policy], &v) {
                    c.near_limit.inc();
                }
            }
        }
    }
}

/// Whether an allowed decision left less than 20% of the policy's quota (Envoy ratelimit's
/// "near limit"). The quota is what `remaining` counts down from: the bucket's capacity
/// (`burst`) for the bucket algorithms, `limit` for the windows, the log and concurrency.
fn near_limit(policy: &Policy, verdict: &Verdict) -> bool {
    let quota = match policy.algorithm {
        Algorithm::TokenBucket | Algorithm::Gcra | Algorithm::LeakyBucket => policy.burst.get(),
        _ => policy.limit.get(),
    };
    u128::from(verdict.remaining) * 5 < u128::from(quota)
}

/// What `policy`'s algorithm needs, counting with `numbers` (the policy's own, or an
/// override's: `overrides::resolve`).
pub fn rule_of(policy: &Policy, numbers: Numbers) -> Rule {
    Rule {
        algorithm: policy.algorithm,
        limit: numbers.limit.get(),
        period_ms: (numbers.period.as_millis() as u64).max(1),
        burst: numbers.burst.get(),
        max_delay_ms: policy.delay.map(|d| d.as_millis() as u64),
        lease_ms: (policy.lease.as_millis() as u64).max(1),
        // Calendar windows (DESIGN §20), unless an override counts another period.
        calendar: policy.calendar.filter(|_| numbers.period == policy.period),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policies() -> Vec<Policy> {
        let text = r#"
[server]
listen = ["127.0.0.1:8080"]

[policies.bucket]
algorithm = "gcra"
limit = 10
period = "1s"
burst = 20
key = []

[policies.window]
algorithm = "fixed_window"
limit = 10
period = "1s"
key = []

[[routes]]
name = "r"
path = "/"
respond = { status = 200 }
policies = ["bucket", "window"]
"#;
        match config::parse("test.toml", text) {
            Ok(c) => c.policies,
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn decisions_index_their_metric_labels() {
        for d in [
            Decision::Allowed,
            Decision::Rejected,
            Decision::Delayed,
            Decision::ShadowRejected,
            Decision::Skipped,
            Decision::Exempt,
            Decision::ErrorAllowed,
            Decision::ErrorDenied,
            Decision::Banned,
        ] {
            assert_eq!(DECISIONS[d as usize], d.label());
        }
    }

    /// The sketches are found by position on the hot path; a reload that moves a policy
    /// keeps its sketch all the same (they are carried over by name).
    #[tokio::test]
    async fn a_policys_top_keys_survive_a_reload_that_moves_it() {
        let config = |policies: &str, route: &str| {
            let text = format!(
                "[server]\nlisten = [\"127.0.0.1:8080\"]\n[admin]\nlisten = \"127.0.0.1:9091\"\n\
                 top_keys = 10\n{policies}\n[[routes]]\nname = \"r\"\npath = \"/\"\n\
                 respond = {{ status = 200 }}\npolicies = [{route}]\n"
            );
            config::parse("test.toml", &text).unwrap_or_else(|e| panic!("{e}"))
        };
        let per_ip = "[policies.per_ip]\nalgorithm = \"gcra\"\nlimit = 10\nperiod = \"1s\"\nkey = [\"client_ip\"]\n";
        let global = "[policies.global]\nalgorithm = \"fixed_window\"\nlimit = 10\nperiod = \"1s\"\nkey = []\n";
        let metrics = Arc::new(Metrics::new());
        let clock: Arc<dyn Clock> = Arc::new(crate::clock::SystemClock);
        let first = config(per_ip, "\"per_ip\"");
        let limiter = Limiter::new(&first, None, &[], clock.clone(), metrics.clone())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let headers = http::HeaderMap::new();
        let facts = RequestFacts {
            client_ip: "192.0.2.7".parse().unwrap_or_else(|e| panic!("{e}")),
            method: "GET",
            host: "example.com",
            path: "/",
            query: None,
            headers: &headers,
            route: "r",
            client_cert: None,
            identity: &crate::auth::Identity::anonymous(),
            request_bound: None,
        };
        for _ in 0..3 {
            limiter.decide(0, &first.policies, &[0], &facts).await;
        }
        // `global` now comes first, so `per_ip` moves from position 0 to 1.
        let second = config(&format!("{global}{per_ip}"), "\"global\", \"per_ip\"");
        assert_eq!(second.policies[1].name, "per_ip");
        let reloaded = Limiter::new(&second, Some(&limiter), &first.policies, clock, metrics)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        reloaded.decide(0, &second.policies, &[0, 1], &facts).await;
        let top = reloaded.top(&second.policies[1], 5).unwrap_or_default();
        assert_eq!(top.len(), 1, "{top:?}");
        assert_eq!((top[0].key.as_str(), top[0].requests), ("192.0.2.7", 4));
        let global_top = reloaded.top(&second.policies[0], 5).unwrap_or_default();
        assert_eq!(global_top.len(), 1, "{global_top:?}");
        assert_eq!(global_top[0].requests, 1);
    }

    #[test]
    fn near_limit_is_less_than_a_fifth_of_the_quota_left() {
        let p = policies();
        let left = |remaining| Verdict {
            allowed: true,
            remaining,
            ..Verdict::default()
        };
        // gcra counts down from its burst (20), fixed_window from its limit (10).
        assert!(near_limit(&p[0], &left(3)));
        assert!(!near_limit(&p[0], &left(4)));
        assert!(near_limit(&p[1], &left(1)));
        assert!(!near_limit(&p[1], &left(2)));
    }
}

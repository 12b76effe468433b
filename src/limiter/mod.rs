//! The limiter layer: everything that does not depend on where state lives.
//!
//! This file holds its types (`Limiter`, `Outcome`, `Decision`, `Charge`, `Lease`) and
//! `Limiter::new`. `pipeline` decides a request in named stages (plan its checks, run them
//! against the backend with the breaker, timeout and `on_error`, apply the verdicts with
//! shadow mode and the deny cache, record them) and settles its charges; `keyed` plans the
//! checks Envoy's RLS names; `admin` holds the admin API's operations.

mod admin;
pub mod algorithm;
pub mod backend;
pub mod calendar;
pub mod connections;
mod deny_cache;
mod fleet;
mod identity;
pub mod keyed;
mod lease;
pub mod memory;
pub mod overrides;
mod pipeline;
mod prefetch;
pub mod redis;
pub mod runtime;
pub mod series;
pub mod top;

use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::Arc;
use std::sync::LazyLock;
use std::time::Duration;

use algorithm::{Rule, Verdict};
use backend::{Backend, BackendError, Check};
use deny_cache::DenyCache;
use fleet::Fleet;

/// Hashes client-chosen keys in process (memory shards, the top sketch): fast, and seeded
/// at random per process so nobody can aim collisions at one shard or sketch slot.
static KEY_HASHER: LazyLock<foldhash::fast::FixedState> =
    LazyLock::new(|| foldhash::fast::FixedState::with_seed(rand::random()));
use memory::MemoryBackend;

pub use admin::{NamedKey, Quota};
pub use lease::Lease;

use crate::clock::Clock;
use crate::config::{self, Algorithm, Numbers, Policy};
use crate::key;
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
    /// The backend again when it is shared by a fleet (Redis): runtime overrides and
    /// consumers are kept in it, announced through it, and prefetch takes units from it.
    fleet: Option<Arc<dyn Fleet>>,
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
    /// `[server] ipv6_prefix`: the network a `max_failures` ban covers.
    ipv6_prefix: u8,
    /// Follows the fleet's runtime changes while this backend is in use (shared backends).
    follower: Option<Arc<Follower>>,
    /// Heavy-hitter sketches (`[admin] top_keys` slots each; none when 0), one per policy
    /// in the config's order, so a decision finds its sketch by index, not by name.
    top: Vec<(String, Sketch)>,
    /// The decision counters of each route (by index) and each of its policies (in the
    /// route's order), resolved once per config: no label lookup per request.
    counters: Vec<Vec<PolicyCounters>>,
}

/// One policy's heavy-hitter sketch (`[admin] top_keys`).
type Sketch = Arc<parking_lot::Mutex<top::SpaceSaving>>;

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
        let (backend, fleet): (Arc<dyn Backend>, Option<Arc<dyn Fleet>>) =
            match (&settings.backend, same) {
                (config::Backend::Memory, _) => (local.clone(), None),
                (_, Some(p)) => (p.backend.clone(), p.fleet.clone()),
                (_, None) => {
                    let redis = Arc::new(redis::RedisBackend::connect(&settings).await?);
                    (redis.clone(), Some(redis))
                }
            };
        let deny_cache = deny_cache_for(cfg, same, previous_policies);
        let shared = previous.map(|p| p.shared.clone()).unwrap_or_default();
        shared.set_deny_cache(deny_cache.clone());
        if same.is_none() {
            // Units held were taken from another backend.
            shared.prefetch.drop_all();
        }
        prefetch::prime(&metrics, cfg);
        let follower = match same {
            Some(p) => p.follower.clone(),
            None => fleet
                .as_ref()
                .map(|fleet| follow_fleet(&settings, &shared, fleet)),
        };
        let top = sketches(cfg, previous);
        let counters = cfg
            .routes
            .iter()
            .map(|route| PolicyCounters::of_route(cfg, route, &metrics))
            .collect();
        let backend_up = metrics.backend_up.with_label_values(&[backend.name()]);
        backend_up.set(1);
        let decision_time = metrics
            .limiter_duration
            .with_label_values(&[backend.name()]);
        Ok(Limiter {
            settings,
            backend,
            fleet,
            local,
            deny_cache,
            breaker: Breaker::default(),
            clock,
            metrics,
            backend_up,
            decision_time,
            leases: AtomicU64::new(rand::random::<u64>() | 1),
            shared,
            ipv6_prefix: cfg.server.ipv6_prefix,
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

/// The deny cache for `cfg` (none with the memory backend, or `deny_cache = 0`): `same`'s
/// (the previous limiter, when its settings did not change) when no policy changed either.
fn deny_cache_for(
    cfg: &config::Config,
    same: Option<&Limiter>,
    previous_policies: &[Policy],
) -> Option<DenyCache> {
    let settings = &cfg.limiter;
    let policies_same = cfg.policies.len() == previous_policies.len()
        && cfg
            .policies
            .iter()
            .zip(previous_policies)
            .all(|(a, b)| a.name == b.name && a.same_rule(b));
    match (&settings.backend, same) {
        (config::Backend::Memory, _) => None,
        _ if settings.deny_cache == 0 => None,
        (_, Some(p)) if policies_same => p.deny_cache.clone(),
        _ => Some(DenyCache::new(settings.deny_cache)),
    }
}

/// Follows the fleet's runtime changes (overrides, resets, bans, consumers) into `shared`
/// while the backend is in use.
fn follow_fleet(
    settings: &config::Limiter,
    shared: &Arc<runtime::Shared>,
    fleet: &Arc<dyn Fleet>,
) -> Arc<Follower> {
    let listener = Arc::new(runtime::FleetListener {
        shared: Arc::downgrade(shared),
        fleet: fleet.clone(),
        hash: runtime::hash_name(&settings.key_prefix),
        consumers: crate::auth::consumers::hash_name(&settings.key_prefix),
        io_timeout: settings.timeout.max(Duration::from_millis(250)),
    });
    let channel = runtime::channel_name(&settings.key_prefix);
    Arc::new(Follower(fleet.follow(&channel, listener)))
}

/// One heavy-hitter sketch per policy of `cfg`, in its order (none when `top_keys` is 0),
/// each kept from `previous` by the policy's name when its size did not change.
fn sketches(cfg: &config::Config, previous: Option<&Limiter>) -> Vec<(String, Sketch)> {
    let slots = cfg.admin.top_keys;
    if slots == 0 {
        return Vec::new();
    }
    cfg.policies
        .iter()
        .map(|policy| {
            let kept = previous
                .and_then(|p| p.sketch(&policy.name))
                .filter(|s| s.lock().capacity() == slots)
                .cloned();
            let sketch = kept
                .unwrap_or_else(|| Arc::new(parking_lot::Mutex::new(top::SpaceSaving::new(slots))));
            (policy.name.clone(), sketch)
        })
        .collect()
}

impl PolicyCounters {
    /// The counters of each of `route`'s policies, in the route's order.
    fn of_route(cfg: &config::Config, route: &config::Route, metrics: &Metrics) -> Vec<Self> {
        route
            .policies
            .iter()
            .map(|&id| {
                let policy = &cfg.policies[id];
                let labels = [route.label(), policy.name.as_str()];
                let possible =
                    series::possible_decisions(policy, &cfg.limiter.backend, cfg.limiter.on_error);
                let decisions = DECISIONS
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
                    .collect();
                PolicyCounters {
                    decisions,
                    labels: labels.map(str::to_owned),
                    near_limit: metrics.near_limit.with_label_values(&labels),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::RequestFacts;

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
        assert_eq!((top[0].key[0].as_str(), top[0].requests), ("192.0.2.7", 4));
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

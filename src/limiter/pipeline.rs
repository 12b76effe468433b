//! The one decision pipeline: a route's policies (`decide`) and the checks a caller names
//! (`keyed`, RLS) both go plan → run (breaker, timeout, `on_error`) → apply → record; `settle`
//! closes a metered charge once its response is known.

use std::hash::BuildHasher;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::algorithm::{self, Rule, Verdict};
use super::backend::{Adjustment, Backend, BackendError, Check};
use super::{
    near_limit, overrides, rule_of, Breaker, Charge, Decision, Denial, Lease, Limiter, Outcome,
    PolicyOutcome, Settled, BREAKER_OPEN, BREAKER_THRESHOLD, KEY_HASHER,
};
use crate::config::{Algorithm, Mode, Numbers, OnError, OnMissing, Policy};
use crate::key::{self, RequestFacts};

/// One check's answer from the backend (or its `on_error`), and the backend that gave it.
pub(super) type Answer = (Result<Verdict, OnError>, Arc<dyn Backend>);

/// What one request asks (stage 1): the checks for the backend and the policy of each (an
/// index into the config's policies); the policies refused without asking (the deny cache,
/// `on_missing = "deny"`); the key values decided, for the heavy-hitter sketches.
pub(super) struct Plan {
    pub(super) checks: Vec<Check>,
    pub(super) checked: Vec<usize>,
    pub(super) violated: Vec<usize>,
    pub(super) seen: Vec<(usize, Vec<u8>)>,
}

impl Plan {
    #[inline]
    pub(super) fn with_capacity(checks: usize) -> Plan {
        Plan {
            checks: Vec::with_capacity(checks),
            checked: Vec::with_capacity(checks),
            violated: Vec::new(),
            seen: Vec::new(),
        }
    }
}

/// One policy's question before the deny cache is asked (`Limiter::add_check`).
pub(super) struct Ask {
    /// An index into the config's policies.
    pub(super) id: usize,
    pub(super) key: String,
    pub(super) rule: Rule,
    pub(super) cost: u64,
    /// concurrency: the check holds a slot (a lease id is given to it).
    pub(super) slot: bool,
}

impl Outcome {
    #[inline]
    pub(super) fn with_capacity(policies: usize) -> Outcome {
        Outcome {
            policies: Vec::with_capacity(policies),
            denial: None,
            wait_ms: 0,
            leases: Vec::new(),
            charges: Vec::new(),
        }
    }
}

impl Breaker {
    /// Whether calls to the backend are refused now.
    pub(super) fn is_open(&self, now: u64) -> bool {
        self.open_until.load(Ordering::Relaxed) > now
    }

    /// Counts one more failure in a row; true when it opens the circuit (until `now` and
    /// `BREAKER_OPEN`).
    fn failed(&self, now: u64) -> bool {
        let failures = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if failures < BREAKER_THRESHOLD {
            return false;
        }
        let until = now + BREAKER_OPEN.as_millis() as u64;
        self.open_until.store(until, Ordering::Relaxed);
        true
    }
}

impl Limiter {
    /// Decides one request against `policy_ids` (indexes into `policies`, the policies of
    /// the config this limiter was built for) of route `route` (an index into its routes).
    pub async fn decide(
        &self,
        route: usize,
        policies: &[Policy],
        policy_ids: &[usize],
        req: &RequestFacts<'_>,
    ) -> Outcome {
        let mut outcome = Outcome::with_capacity(policy_ids.len());
        if policy_ids.is_empty() {
            return outcome;
        }
        let now = self.clock.now_ms();
        let plan = self.plan(policies, policy_ids, req, now, &mut outcome.policies);
        self.run(route, policies, &plan, now, &mut outcome).await;
        self.record(route, policies, policy_ids, &outcome.policies, plan.seen);
        outcome
    }

    /// Stage 1 for a route's policies: each one's check, or (in `decided`) its outcome when
    /// it needs none: exempt, key part missing, or refused by the deny cache.
    fn plan(
        &self,
        policies: &[Policy],
        policy_ids: &[usize],
        req: &RequestFacts<'_>,
        now: u64,
        decided: &mut Vec<PolicyOutcome>,
    ) -> Plan {
        let mut plan = Plan::with_capacity(policy_ids.len());
        for &id in policy_ids {
            let policy = &policies[id];
            let Some(value) = key_value(policy, id, req, decided, &mut plan.violated) else {
                continue;
            };
            let key = self.storage_key(policy, &value);
            if !self.top.is_empty() {
                plan.seen.push((id, value));
            }
            let rule = rule_of(policy, self.numbers_for(policy, &key, req));
            let cost = policy
                .reserve_request
                .map_or(policy.cost, |most| req.request_bound.unwrap_or(most));
            // An observe-only (cost 0) concurrency policy holds no slot.
            let slot = policy.algorithm == Algorithm::Concurrency && policy.cost > 0;
            let ask = Ask {
                id,
                key,
                rule,
                cost,
                slot,
            };
            if let Some(denied) = self.add_check(&mut plan, policy, ask, now) {
                decided.push(denied);
            }
        }
        plan
    }

    /// Adds `ask` to `plan` as a check of `policy`, unless the deny cache holds a denial that
    /// covers it (an enforced policy other than concurrency): then the policy is violated and
    /// its outcome is returned.
    #[inline]
    pub(super) fn add_check(
        &self,
        plan: &mut Plan,
        policy: &Policy,
        ask: Ask,
        now: u64,
    ) -> Option<PolicyOutcome> {
        let enforce = policy.mode == Mode::Enforce;
        if enforce && policy.algorithm != Algorithm::Concurrency {
            let (id, key, rule, cost) = (ask.id, &ask.key, ask.rule, ask.cost);
            if let Some(denied) = self.cached_denial(policy, id, key, now, rule, cost) {
                plan.violated.push(id);
                return Some(denied);
            }
        }
        plan.checks.push(Check {
            key: ask.key,
            rule: ask.rule,
            cost: ask.cost,
            enforce,
            // Shadow policies ban nobody.
            ban_ms: if enforce {
                policy.ban.as_millis() as u64
            } else {
                0
            },
            lease: if ask.slot { self.next_lease() } else { 0 },
        });
        plan.checked.push(ask.id);
        None
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
        // Units this instance holds for the key were charged already; a denial is cached
        // beside them when a request stops waiting for a take and asks the backend, which
        // the take has just emptied. They are admitted first (DESIGN §19: exact windows).
        if policy.prefetch.is_some() && self.fleet.is_some() && self.shared.prefetch.holds(key) {
            return None;
        }
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

    /// Stages 2 and 3: a plan with a policy already refused asks nothing more and charges
    /// nothing; otherwise its checks go to the backend (with held units, where prefetch
    /// holds some) and the answers are applied to `outcome`.
    pub(super) async fn run(
        &self,
        route: usize,
        policies: &[Policy],
        plan: &Plan,
        now: u64,
        outcome: &mut Outcome,
    ) {
        if !plan.violated.is_empty() {
            self.finish_denied(policies, outcome, &plan.violated);
            return;
        }
        if plan.checks.is_empty() {
            return;
        }
        let (checks, checked) = (&plan.checks, &plan.checked);
        let answers = match self.prefetcher(policies, checked) {
            Some(store) => {
                self.call_with_held(store, route, checks, now, policies, checked)
                    .await
            }
            None => self.call_store(checks, now, policies, checked).await,
        };
        self.apply(outcome, policies, plan, answers, now);
    }

    /// The backend's verdicts, bounded by the timeout and the circuit breaker, or per-check
    /// fallbacks (`on_error`) when it fails.
    pub(super) async fn call_store(
        &self,
        checks: &[Check],
        now: u64,
        policies: &[Policy],
        checked: &[usize],
    ) -> Vec<Answer> {
        let started = Instant::now();
        let result = if let Some(verdicts) = self.backend.decide_in_place(checks, now) {
            // In process: no boxed future, no timer (callgrind: about a tenth of a memory
            // decision's cost).
            Ok(verdicts)
        } else if self.breaker.is_open(now) {
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
        self.decision_time.observe(started.elapsed().as_secs_f64());
        match result {
            Ok(verdicts) => {
                self.backend_answered();
                verdicts
                    .into_iter()
                    .map(|v| (Ok(v), self.backend.clone()))
                    .collect()
            }
            Err(e) => {
                self.backend_failed(&e, now);
                self.fallback(checks, now, policies, checked)
            }
        }
    }

    /// A backend call answered: the backend is up and the breaker's count starts over.
    pub(super) fn backend_answered(&self) {
        self.breaker.failures.store(0, Ordering::Relaxed);
        self.backend_up.set(1);
    }

    /// Counts a failed backend call; one that was tried (not refused by an open circuit)
    /// marks the backend down and may open the circuit.
    pub(super) fn backend_failed(&self, e: &BackendError, now: u64) {
        let name = self.backend.name();
        self.metrics
            .backend_errors
            .with_label_values(&[name, e.kind()])
            .inc();
        if *e != BackendError::CircuitOpen {
            self.backend_up.set(0);
            if self.breaker.failed(now) {
                log::warn!(
                    "limiter backend {name} failing ({e}); circuit open for {BREAKER_OPEN:?}"
                );
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
    ) -> Vec<Answer> {
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

    /// Stage 3: each check's decision; then the request's denial (the backend down with
    /// `on_error = "deny"`, or over a limit: the deny cache learns the denials), or what an
    /// admitted request holds (its wait, metered charges, concurrency leases).
    fn apply(
        &self,
        outcome: &mut Outcome,
        policies: &[Policy],
        plan: &Plan,
        answers: Vec<Answer>,
        now: u64,
    ) {
        let mut violated = Vec::new();
        let mut backend_down = false;
        for ((check, &id), (verdict, _)) in plan.checks.iter().zip(&plan.checked).zip(&answers) {
            let decision = decision_of(check, verdict);
            match decision {
                Decision::Banned | Decision::Rejected => violated.push(id),
                Decision::ErrorDenied if check.enforce => backend_down = true,
                _ => {}
            }
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
            self.remember_denials(&plan.checks, &answers, now);
            self.finish_denied(policies, outcome, &violated);
            return;
        }
        self.admit(outcome, policies, plan, answers, now);
    }

    /// Puts the enforced denials (concurrency aside) in the deny cache; a denial of a
    /// banning check is a ban (set now, or standing).
    fn remember_denials(&self, checks: &[Check], answers: &[Answer], now: u64) {
        let Some(cache) = &self.deny_cache else {
            return;
        };
        for (check, (verdict, _)) in checks.iter().zip(answers) {
            let Ok(v) = verdict else { continue };
            if !check.enforce || v.allowed || check.rule.algorithm == Algorithm::Concurrency {
                continue;
            }
            if check.ban_ms > 0 {
                cache.insert_ban(&check.key, now + v.retry_after_ms);
            } else {
                cache.insert(&check.key, now + v.retry_after_ms, &check.rule, check.cost);
            }
        }
    }

    /// An admitted request: the longest wait asked, the charges of its metered policies
    /// (for the response to settle) and the slots of its concurrency policies.
    fn admit(
        &self,
        outcome: &mut Outcome,
        policies: &[Policy],
        plan: &Plan,
        answers: Vec<Answer>,
        now: u64,
    ) {
        for ((check, &id), (verdict, backend)) in plan.checks.iter().zip(&plan.checked).zip(answers)
        {
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

    /// A request refused for `violated` (indexes into `policies`, in order): the first's
    /// status, the longest wait among their verdicts in `outcome`.
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

    /// Stage 4: counts each decision under route `route` (whose policies are `policy_ids`)
    /// and feeds the heavy-hitter sketches with the keys decided.
    #[inline]
    pub(super) fn record(
        &self,
        route: usize,
        policies: &[Policy],
        policy_ids: &[usize],
        decided: &[PolicyOutcome],
        seen: Vec<(usize, Vec<u8>)>,
    ) {
        self.count(route, policies, policy_ids, decided);
        self.feed_top(decided, seen);
    }

    fn count(
        &self,
        route: usize,
        policies: &[Policy],
        policy_ids: &[usize],
        decided: &[PolicyOutcome],
    ) {
        let Some(counters) = self.counters.get(route) else {
            return;
        };
        for p in decided {
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

    /// Counts each decided key in its policy's sketch: its hash always, its values only
    /// when it takes a slot.
    fn feed_top(&self, decided: &[PolicyOutcome], seen: Vec<(usize, Vec<u8>)>) {
        for (id, value) in seen {
            let Some(p) = decided.iter().find(|p| p.policy == id) else {
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
            sketch.lock().record(hash, || key::parts(&value), rejected);
        }
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
            let amount = self.settled_amount(route, &policies[charge.policy], charge.held(), how);
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

    /// The units `how` settles a charge of `held` units of `policy` at, counted; returns
    /// the adjustment to make (0: none).
    fn settled_amount(&self, route: usize, policy: &Policy, held: u64, how: Settled) -> i64 {
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
        cost as i64 - algorithm::clamp_cost(held) as i64
    }

    /// The `route` label the decisions of `policy` on route `route` are counted under.
    pub(super) fn route_label(&self, route: usize, policy: &Policy) -> String {
        self.counters
            .get(route)
            .and_then(|c| c.iter().find(|c| c.labels[1] == policy.name))
            .map_or_else(String::new, |c| c.labels[0].clone())
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
}

/// The key value `policy` (`id`) counts `req` under; None when the policy needs no check,
/// its outcome then in `decided`: exempt, or its key part missing (skipped, or refused:
/// then violated unless shadow).
#[inline]
fn key_value(
    policy: &Policy,
    id: usize,
    req: &RequestFacts<'_>,
    decided: &mut Vec<PolicyOutcome>,
    violated: &mut Vec<usize>,
) -> Option<Vec<u8>> {
    let unchecked = |decision| PolicyOutcome {
        policy: id,
        decision,
        verdict: None,
        rule: None,
    };
    if policy.exempt.iter().any(|net| net.contains(&req.client_ip)) {
        decided.push(unchecked(Decision::Exempt));
        return None;
    }
    match (key::key_value(&policy.key, req), policy.on_missing) {
        (Some(v), _) => Some(v),
        (None, OnMissing::Skip) => {
            decided.push(unchecked(Decision::Skipped));
            None
        }
        (None, OnMissing::Deny) if policy.mode == Mode::Shadow => {
            decided.push(unchecked(Decision::ShadowRejected));
            None
        }
        (None, OnMissing::Deny) => {
            decided.push(unchecked(Decision::Rejected));
            violated.push(id);
            None
        }
        // Every request without the part shares one bucket.
        (None, OnMissing::Shared) => Some(b"\xffmissing".to_vec()),
        (None, OnMissing::ClientIp) => Some(key::key_value_or_ip(&policy.key, req)),
    }
}

/// How one verdict (or its `on_error`) decides `check`'s policy.
#[inline]
fn decision_of(check: &Check, verdict: &Result<Verdict, OnError>) -> Decision {
    match verdict {
        Ok(v) if v.allowed && v.wait_ms > 0 => Decision::Delayed,
        Ok(v) if v.allowed => Decision::Allowed,
        Ok(_) if !check.enforce => Decision::ShadowRejected,
        Ok(v) if v.banned => Decision::Banned,
        Ok(_) => Decision::Rejected,
        Err(OnError::Deny) => Decision::ErrorDenied,
        Err(_) => Decision::ErrorAllowed,
    }
}

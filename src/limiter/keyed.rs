//! Deciding checks whose key values, costs and numbers the caller already knows (Envoy's
//! descriptors, DESIGN §13): planned here, then run, applied and counted by `pipeline` as a
//! route's policies are (deny cache, all-or-nothing, shadow mode, `on_error`, bans).

use super::pipeline::{Ask, Plan};
use super::{algorithm, rule_of, Decision, Limiter, Outcome, PolicyOutcome};
use crate::config::{Numbers, Policy};

/// One check of one policy: `value` is the key's values joined by NUL, as `named_key`
/// joins them, so the admin API names the same key.
#[derive(Debug, Clone)]
pub struct Keyed {
    /// An index into the config's policies.
    pub policy: usize,
    pub value: Vec<u8>,
    /// Units to charge; 0 asks without charging.
    pub cost: u64,
    /// Numbers the caller sets for this check (a request's own limit), over every override.
    pub numbers: Option<Numbers>,
}

impl Limiter {
    /// Decides `items` together for route `route`, whose policies are `route_policies`:
    /// if one is denied none is charged. The outcome's `policies` are aligned with `items`.
    pub async fn decide_keyed(
        &self,
        route: usize,
        policies: &[Policy],
        route_policies: &[usize],
        items: &[Keyed],
    ) -> Outcome {
        let now = self.clock.now_ms();
        let mut results: Vec<Option<PolicyOutcome>> = vec![None; items.len()];
        // Where each check's item is.
        let mut at: Vec<usize> = Vec::with_capacity(items.len());
        let plan = self.plan_keyed(policies, items, now, &mut results, &mut at);
        let mut outcome = Outcome::with_capacity(0);
        self.run(route, policies, &plan, now, &mut outcome).await;
        for (p, i) in std::mem::take(&mut outcome.policies).into_iter().zip(&at) {
            results[*i] = Some(p);
        }
        // Items neither decided nor refused by the deny cache (a request refused before
        // they were asked) read as skipped, and are not counted.
        outcome.policies = results
            .into_iter()
            .zip(items)
            .map(|(r, item)| {
                r.unwrap_or(PolicyOutcome {
                    policy: item.policy,
                    decision: Decision::Skipped,
                    verdict: None,
                    rule: None,
                })
            })
            .collect();
        let counted: Vec<PolicyOutcome> = outcome
            .policies
            .iter()
            .filter(|p| p.decision != Decision::Skipped)
            .cloned()
            .collect();
        self.record(route, policies, route_policies, &counted, plan.seen);
        outcome
    }

    /// Stage 1 for named checks: each item's check (`at`: the item of each), or (in
    /// `results`, by item) its outcome when the deny cache refuses it.
    fn plan_keyed(
        &self,
        policies: &[Policy],
        items: &[Keyed],
        now: u64,
        results: &mut [Option<PolicyOutcome>],
        at: &mut Vec<usize>,
    ) -> Plan {
        let mut plan = Plan::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let policy = &policies[item.policy];
            let key = self.storage_key(policy, &item.value);
            if !self.top.is_empty() {
                plan.seen.push((item.policy, item.value.clone()));
            }
            let numbers = item
                .numbers
                .or_else(|| self.shared.numbers(&key))
                .unwrap_or_else(|| policy.numbers());
            let ask = Ask {
                id: item.policy,
                key,
                rule: rule_of(policy, numbers),
                // The caller refuses costs above 2^53 (RLS: INVALID_ARGUMENT); none reaches
                // a backend, whose arithmetic is exact only up to there.
                cost: algorithm::clamp_cost(item.cost),
                slot: false,
            };
            match self.add_check(&mut plan, policy, ask, now) {
                Some(denied) => results[i] = Some(denied),
                None => at.push(i),
            }
        }
        plan
    }
}

//! Deciding checks whose key values, costs and numbers the caller already knows (Envoy's
//! descriptors, DESIGN §13): the same deny cache, backend call, all-or-nothing, shadow mode,
//! `on_error`, bans and counting as a route's policies.

use super::*;

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
        let mut checks: Vec<Check> = Vec::with_capacity(items.len());
        let mut checked: Vec<usize> = Vec::with_capacity(items.len());
        let mut at: Vec<usize> = Vec::with_capacity(items.len());
        let mut violated: Vec<usize> = Vec::new();
        let mut seen: Vec<(usize, Vec<u8>)> = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let policy = &policies[item.policy];
            let key = self.storage_key(policy, &item.value);
            if !self.top.is_empty() {
                seen.push((item.policy, item.value.clone()));
            }
            let numbers = item
                .numbers
                .or_else(|| self.shared.numbers(&key))
                .unwrap_or_else(|| policy.numbers());
            let rule = rule_of(policy, numbers);
            let enforce = policy.mode == Mode::Enforce;
            // The caller refuses costs above 2^53 (RLS: INVALID_ARGUMENT); none reaches a
            // backend, whose arithmetic is exact only up to there.
            let cost = algorithm::clamp_cost(item.cost);
            if enforce {
                if let Some(denied) = self.cached_denial(policy, item.policy, &key, now, rule, cost)
                {
                    results[i] = Some(denied);
                    violated.push(item.policy);
                    continue;
                }
            }
            checks.push(Check {
                key,
                rule,
                cost,
                enforce,
                ban_ms: if enforce {
                    policy.ban.as_millis() as u64
                } else {
                    0
                },
                lease: 0,
            });
            checked.push(item.policy);
            at.push(i);
        }
        let mut outcome = Outcome {
            policies: Vec::new(),
            denial: None,
            wait_ms: 0,
            leases: Vec::new(),
            charges: Vec::new(),
        };
        if violated.is_empty() && !checks.is_empty() {
            let verdicts = self
                .call_backend(route, &checks, now, policies, &checked)
                .await;
            self.apply(&mut outcome, policies, &checks, &checked, verdicts, now);
            for (p, i) in std::mem::take(&mut outcome.policies).into_iter().zip(&at) {
                results[*i] = Some(p);
            }
        } else if !violated.is_empty() {
            // Already denied by the deny cache: ask nothing more, charge nothing.
            self.finish_denied(policies, &mut outcome, &violated);
        }
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
        let counted = Outcome {
            policies: counted,
            denial: None,
            wait_ms: 0,
            leases: Vec::new(),
            charges: Vec::new(),
        };
        self.count(route, policies, route_policies, &counted);
        self.feed_top(&counted, seen);
        outcome
    }
}

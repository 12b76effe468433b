//! One ShouldRateLimit call against the current gateway: descriptors matched to their
//! domain's rules, decided together by the limiter, and the limiter's verdicts as Envoy's
//! answer.

use std::collections::HashSet;
use std::num::NonZeroU64;
use std::time::Duration;

use super::proto::{Code, Request, Response, Status, Unit};
use super::rules;
use crate::config::{exact_in_redis, Algorithm, Numbers};
use crate::gateway::Gateway;
use crate::key;
use crate::limiter::algorithm::{Rule, Verdict, MAX_COST};
use crate::limiter::keyed::Keyed;
use crate::limiter::Decision;

/// The answer, or why the request is invalid (gRPC INVALID_ARGUMENT).
pub async fn should_rate_limit(gateway: &Gateway, req: &Request) -> Result<Response, String> {
    if req.domain.is_empty() {
        return Err("rate limit domain must not be empty".into());
    }
    if req.descriptors.is_empty() {
        return Err("rate limit descriptor list must not be empty".into());
    }
    // Costs cannot wrap (DESIGN §17): a cost above 2^53 is refused, whatever the domain.
    if req
        .descriptors
        .iter()
        .any(|d| d.hits_addend.is_some_and(|h| h > MAX_COST))
    {
        return Err(format!("hits_addend must be at most 2^53 ({MAX_COST})"));
    }
    let mut statuses: Vec<Status> = req.descriptors.iter().map(|_| ok()).collect();
    let config = &gateway.config;
    let found = config.rls.as_ref().and_then(|rls| {
        let at = rls.domains.iter().position(|d| d.name == req.domain)?;
        Some((&rls.domains[at], rls.first_route + at))
    });
    let Some((domain, route)) = found else {
        // An unknown domain limits nothing, as envoyproxy/ratelimit answers.
        return Ok(Response {
            overall_code: Code::Ok,
            statuses,
        });
    };
    let limits: Vec<Option<&rules::Limit>> = req
        .descriptors
        .iter()
        .map(|d| {
            let entries: Vec<(&str, &str)> = d
                .entries
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            rules::find(domain, &entries)
        })
        .collect();
    // A rule named in another matched rule's `replaces` is not applied.
    let replaced: HashSet<&str> = limits
        .iter()
        .flatten()
        .flat_map(|l| l.replaces.iter().map(String::as_str))
        .collect();
    let hits = if req.hits_addend == 0 {
        1
    } else {
        u64::from(req.hits_addend)
    };
    let mut items: Vec<Keyed> = Vec::new();
    let mut blocked = false;
    let mut item_of: Vec<Option<usize>> = vec![None; limits.len()];
    for (i, (descriptor, limit)) in req.descriptors.iter().zip(&limits).enumerate() {
        let Some(limit) = limit.filter(|l| !replaced.contains(l.name.as_str())) else {
            continue;
        };
        let Some(policy) = limit.policy else {
            match limit.shape {
                rules::Shape::Limited { unit, .. } if !limit.shadow => {
                    // `requests_per_unit: 0`: refused; all or nothing, so nothing is charged.
                    let unit = Unit::of_seconds(unit.as_secs());
                    statuses[i].code = Code::OverLimit;
                    statuses[i].current_limit = Some((limit.name.clone(), 0, unit));
                    blocked = true;
                }
                rules::Shape::Limited { .. } => {}
                rules::Shape::Unlimited => statuses[i].limit_remaining = u32::MAX,
            }
            continue;
        };
        let value = key::join(descriptor.entries.iter().map(|(_, v)| v.as_bytes()));
        let numbers = descriptor.limit.and_then(|(rpu, unit)| {
            let limit = NonZeroU64::new(u64::from(rpu))?;
            Some(Numbers {
                limit,
                period: Duration::from_secs(unit.seconds()?),
                burst: limit,
            })
        });
        // A request's own limit meets the YAML's rule (config::ratelimit): the rates'
        // arithmetic in Redis is exact only below 2^53.
        if let Some(n) = &numbers {
            let rate = matches!(
                config.policies[policy].algorithm,
                Algorithm::SlidingWindow | Algorithm::TokenBucket | Algorithm::Gcra
            );
            if rate && !exact_in_redis(n.limit.get(), n.period) {
                return Err(format!(
                    "descriptor limit {} per {} s times the unit in ms must stay below 2^53 with {}",
                    n.limit,
                    n.period.as_secs(),
                    config.policies[policy].algorithm.name()
                ));
            }
        }
        item_of[i] = Some(items.len());
        items.push(Keyed {
            policy,
            value,
            cost: descriptor.hits_addend.unwrap_or(hits),
            numbers,
        });
    }
    if blocked || items.is_empty() {
        return Ok(Response {
            overall_code: if blocked { Code::OverLimit } else { Code::Ok },
            statuses,
        });
    }
    let outcome = gateway
        .limiter
        .decide_keyed(
            route,
            &config.policies,
            &config.routes[route].policies,
            &items,
        )
        .await;
    for (status, at) in statuses.iter_mut().zip(item_of) {
        let Some(p) = at.and_then(|at| outcome.policies.get(at)) else {
            continue;
        };
        let policy = &config.policies[p.policy];
        status.code = match p.decision {
            Decision::Rejected | Decision::Banned | Decision::ErrorDenied => Code::OverLimit,
            _ => Code::Ok,
        };
        let rule = p
            .rule
            .unwrap_or_else(|| crate::limiter::rule_of(policy, policy.numbers()));
        let seconds = rule.period_ms / 1000;
        let unit = if rule.period_ms % 1000 == 0 {
            Unit::of_seconds(seconds)
        } else {
            Unit::Unknown
        };
        status.current_limit = Some((policy.name.clone(), clamp(rule.limit), unit));
        if let Some(v) = p.verdict {
            status.limit_remaining = clamp(v.remaining);
            status.duration_until_reset_ms = Some(until_one_free(&rule, &v));
        }
    }
    Ok(Response {
        overall_code: if outcome.denial.is_some() {
            Code::OverLimit
        } else {
            Code::Ok
        },
        statuses,
    })
}

fn ok() -> Status {
    Status {
        code: Code::Ok,
        current_limit: None,
        limit_remaining: 0,
        duration_until_reset_ms: None,
    }
}

fn clamp(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Milliseconds until one unit is free again: the wait when denied; for windows, the
/// window's end; for the continuous algorithms, the next unit's refill.
fn until_one_free(rule: &Rule, v: &Verdict) -> u64 {
    if !v.allowed {
        return v.retry_after_ms;
    }
    match rule.algorithm {
        Algorithm::TokenBucket | Algorithm::Gcra if v.reset_ms > 0 => {
            let per_unit = (rule.period_ms / rule.limit.max(1)).max(1);
            v.reset_ms - (v.reset_ms - 1) / per_unit * per_unit
        }
        _ => v.reset_ms,
    }
}

//! Cluster requests whose checks span several slots: every slot's group is peeked, then
//! all are charged only if every enforced check allows; the groups charged are refunded if
//! one then denies (another request got in between) or fails.

use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::Slot;

use super::backend_error;
use super::scripts::{self, Mode, Reply};
use crate::limiter::algorithm::Verdict;
use crate::limiter::backend::{Adjustment, BackendError, Check};

/// Key indexes grouped by cluster slot, in the order the slots first appear.
pub(super) fn by_slot<'k>(keys: impl IntoIterator<Item = &'k str>) -> Vec<Vec<usize>> {
    let mut groups: Vec<(Slot, Vec<usize>)> = Vec::new();
    for (i, key) in keys.into_iter().enumerate() {
        let slot = Slot::for_key(key);
        match groups.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, members)) => members.push(i),
            None => groups.push((slot, vec![i])),
        }
    }
    groups.into_iter().map(|(_, members)| members).collect()
}

/// Peek every group; charge them all only if every enforce check allows; refund the groups
/// charged if one then denies or fails.
pub(super) async fn decide_across_slots(
    conn: ClusterConnection,
    checks: Vec<Check>,
    groups: Vec<Vec<usize>>,
    now: Option<u64>,
) -> Result<Vec<Verdict>, BackendError> {
    let mut peeks = Vec::with_capacity(groups.len());
    for reply in call_groups(&conn, &checks, &groups, Mode::Peek, now).await {
        peeks.push(reply?);
    }
    let mut verdicts = in_check_order(&groups, &peeks, checks.len());
    let allowed = checks
        .iter()
        .zip(&verdicts)
        .all(|(c, v)| v.allowed || !c.enforce);
    if !allowed {
        ban_denied(&conn, &checks, &groups, &peeks, &mut verdicts).await;
        return Ok(verdicts);
    }
    let charges = call_groups(&conn, &checks, &groups, Mode::Decide, now).await;
    if charges
        .iter()
        .all(|r| matches!(r, Ok(reply) if reply.charged))
    {
        let replies: Vec<Reply> = charges.into_iter().flatten().collect();
        return Ok(in_check_order(&groups, &replies, checks.len()));
    }
    // Another request got in between (or a node failed): undo the charges that were made.
    let mut refunds = Vec::new();
    for (group, result) in groups.iter().zip(&charges) {
        let Ok(reply) = result else { continue };
        if !reply.charged {
            continue;
        }
        let charged: Vec<Adjustment> = group
            .iter()
            .zip(&reply.verdicts)
            .filter(|(&i, v)| v.allowed && checks[i].cost > 0)
            .map(|(&i, _)| Adjustment {
                check: checks[i].clone(),
                charged_at: reply.now,
                amount: -(checks[i].cost as i64),
            })
            .collect();
        let mut conn = conn.clone();
        refunds.push(tokio::spawn(async move {
            let result = scripts::adjust_invocation(&charged, now)
                .invoke::<Vec<i64>>(&mut conn)
                .await;
            if let Err(e) = result {
                log::warn!(
                    "redis limiter: refund of {} checks failed: {e}",
                    charged.len()
                );
            }
        }));
    }
    for refund in refunds {
        let _ = refund.await;
    }
    let mut replies = Vec::with_capacity(charges.len());
    for reply in charges {
        replies.push(reply?);
    }
    Ok(in_check_order(&groups, &replies, checks.len()))
}

/// Across slots a denial is found by a peek, which sets no ban: bans the keys of the
/// banning checks their algorithm denied, as a decide's script does (ban key = end time,
/// TTL = ban), at the time the group's peek ran.
async fn ban_denied(
    conn: &ClusterConnection,
    checks: &[Check],
    groups: &[Vec<usize>],
    peeks: &[Reply],
    verdicts: &mut [Verdict],
) {
    for (group, peek) in groups.iter().zip(peeks) {
        for &i in group {
            let (check, verdict) = (&checks[i], &mut verdicts[i]);
            let newly_denied = check.enforce && !verdict.allowed && !verdict.banned;
            if !newly_denied || check.ban_ms == 0 {
                continue;
            }
            let set = redis::cmd("SET")
                .arg(scripts::ban_key(&check.key))
                .arg(peek.now + check.ban_ms)
                .arg("PX")
                .arg(check.ban_ms)
                .query_async::<()>(&mut conn.clone())
                .await;
            if let Err(e) = set {
                log::warn!("redis limiter: could not set a ban: {e}");
            }
            // Answered as a ban is (DESIGN §17): the ban's wait, never the window's.
            verdict.retry_after_ms = check.ban_ms;
            verdict.reset_ms = check.ban_ms;
        }
    }
}

/// One concurrent script call per group; results in group order.
async fn call_groups(
    conn: &ClusterConnection,
    checks: &[Check],
    groups: &[Vec<usize>],
    mode: Mode,
    now: Option<u64>,
) -> Vec<Result<Reply, BackendError>> {
    let calls: Vec<_> = groups
        .iter()
        .map(|group| {
            let mut conn = conn.clone();
            let invocation = scripts::invocation(mode, group.iter().map(|&i| &checks[i]), now);
            let enforce: Vec<bool> = group.iter().map(|&i| checks[i].enforce).collect();
            tokio::spawn(async move {
                let values = invocation
                    .invoke::<scripts::Integers>(&mut conn)
                    .await
                    .map_err(|e| backend_error(&e))?
                    .0;
                scripts::decode(&values, mode, &enforce)
            })
        })
        .collect();
    let mut replies = Vec::with_capacity(calls.len());
    for handle in calls {
        replies.push(
            handle
                .await
                .unwrap_or_else(|e| Err(BackendError::Script(format!("script call failed: {e}")))),
        );
    }
    replies
}

/// Puts the verdicts of per-group replies back in the order of the checks.
fn in_check_order(groups: &[Vec<usize>], replies: &[Reply], count: usize) -> Vec<Verdict> {
    let mut verdicts = vec![Verdict::default(); count];
    for (group, reply) in groups.iter().zip(replies) {
        for (&i, verdict) in group.iter().zip(&reply.verdicts) {
            verdicts[i] = *verdict;
        }
    }
    verdicts
}

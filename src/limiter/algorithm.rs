//! The seven rate-limit algorithms as pure functions over integer milliseconds.
//!
//! Each takes the stored state (or none), the time and the cost, and returns a `Verdict`
//! plus the state to store if the request is charged. The Lua scripts in `lua/` implement
//! exactly the same arithmetic; `tests/conformance.rs` holds them to it.
//!
//! Rates are exact: token_bucket, gcra and leaky_bucket store the units in use scaled by
//! `period` (each unit is `period`, draining `limit` a millisecond), so no float ever rounds
//! a decision.
//!
//! State holds units, never the numbers it was counted with: an override or a reload that
//! changes a key's limit, burst or period changes what is allowed from then on, not what
//! was used (DESIGN §9.1). After 3 of 3, a limit of 5,000 leaves 4,997 on every algorithm.
//! The buckets keep the period their units were scaled by, and a new period rescales them
//! (rounded up to whole units).
//!
//! Costs cannot wrap (DESIGN §17): a cost is at most `MAX_COST` (2^53), and what state
//! holds saturates there, as the Lua scripts' doubles stay exact below it: a count of units
//! stops at 2^53 (more than any limit), a bucket's units in use × period (a tat's lead,
//! (tat − now) × limit) too, and so do the milliseconds a verdict reports. A cost
//! larger than what is left is refused, never admitted by an overflow.

use std::collections::VecDeque;

use super::calendar;
use crate::config::{Algorithm, Calendar};

/// The largest cost (DESIGN §17), and the most a count, a bucket's deficit or a tat's lead
/// holds: 2^53, below which Redis's Lua numbers (doubles) are exact integers.
pub const MAX_COST: u64 = 1 << 53;

/// A cost as it is charged: at most `MAX_COST`.
pub fn clamp_cost(cost: u64) -> u64 {
    cost.min(MAX_COST)
}

/// `count + cost`, saturating at `MAX_COST`: a count never wraps, and one that reaches it
/// (more than any limit) stays there.
pub fn add_units(count: u64, cost: u64) -> u64 {
    count.saturating_add(cost).min(MAX_COST)
}

/// Whether `cost` more units fit within `limit` when `count` are used (`count + cost <=
/// limit`, computed without an overflow).
pub fn fits(count: u64, cost: u64, limit: u64) -> bool {
    count <= limit && cost <= limit - count
}

/// Milliseconds (or units) computed wide, as a verdict or state reports them: at most
/// `MAX_COST`.
fn capped(n: u128) -> u64 {
    n.min(u128::from(MAX_COST)) as u64
}

/// The algorithm's segment of a storage key: its name, and for those whose state is a
/// string the version of its layout. v3 (issue #42) holds the numbers packed as
/// little-endian doubles (`struct.pack('<dd')`), read and written without text parsing or
/// formatting; v2 held the buckets' units in use as text, replacing tokens and times.
/// During a rolling upgrade old and new instances keep separate state, for at most a
/// period.
pub fn state_name(algorithm: Algorithm) -> &'static str {
    match algorithm {
        Algorithm::FixedWindow => "fixed_window.v3",
        Algorithm::SlidingWindow => "sliding_window.v3",
        Algorithm::TokenBucket => "token_bucket.v3",
        Algorithm::Gcra => "gcra.v3",
        Algorithm::LeakyBucket => "leaky_bucket.v3",
        _ => algorithm.name(),
    }
}

/// The numbers of one policy that its algorithm needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    pub algorithm: Algorithm,
    pub limit: u64,
    pub period_ms: u64,
    pub burst: u64,
    /// `Some(max_delay)`: a request over the limit is booked ahead and waits (token_bucket, gcra).
    pub max_delay_ms: Option<u64>,
    /// concurrency: a held slot is reclaimed after this.
    pub lease_ms: u64,
    /// fixed_window with a calendar period (DESIGN §20): its windows are calendar days,
    /// weeks or months (`period_ms` is then only what the policy reports).
    pub calendar: Option<Calendar>,
}

/// The outcome of one policy for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Verdict {
    pub allowed: bool,
    /// Units left after this request (before it, when denied).
    pub remaining: u64,
    /// Milliseconds until the quota is whole again.
    pub reset_ms: u64,
    /// Denied: milliseconds until this request would be allowed.
    pub retry_after_ms: u64,
    /// Allowed: milliseconds the request must wait before it is forwarded.
    pub wait_ms: u64,
    /// Denied by a standing ban (`Check::ban_ms`), not by the algorithm.
    pub banned: bool,
}

/// Stored state, one shape per algorithm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// fixed_window: the window's start and its count.
    Window { start: u64, count: u64 },
    /// sliding_window: the current window's start, the previous and current counts.
    Sliding { start: u64, prev: u64, curr: u64 },
    /// sliding_log: (time, cost) of each admitted request, oldest first, and their sum.
    Log {
        entries: VecDeque<(u64, u64)>,
        total: u64,
    },
    /// token_bucket, gcra and leaky_bucket: the units in use × `period` (more than the
    /// capacity when booked ahead) at time `last`; they drain at `limit` a millisecond.
    /// token_bucket's tokens are burst − used; gcra's tat is last + scaled/limit.
    Bucket { scaled: u64, last: u64, period: u64 },
    /// concurrency: (lease id, expiry) of each slot held.
    Leases(Vec<(u64, u64)>),
}

/// Decides one request of `cost` units at `now`. The returned state is what to store if
/// the request is charged; a denied request never changes state.
///
/// `cost == 0` only observes: it is always allowed, never waits, charges nothing (the
/// returned state decides the same as the given one) and reports the current `remaining`
/// and `reset_ms`. A cost above `MAX_COST` counts as `MAX_COST`.
pub fn decide(rule: &Rule, state: Option<&State>, now: u64, cost: u64) -> (Verdict, State) {
    let cost = clamp_cost(cost);
    match rule.algorithm {
        Algorithm::FixedWindow => fixed_window(rule, state, now, cost),
        Algorithm::SlidingWindow => sliding_window(rule, state, now, cost),
        Algorithm::SlidingLog => sliding_log(rule, state, now, cost),
        Algorithm::TokenBucket => token_bucket(rule, state, now, cost),
        Algorithm::Gcra => gcra(rule, state, now, cost, false),
        Algorithm::LeakyBucket => gcra(rule, state, now, cost, true),
        Algorithm::Concurrency => acquire(rule, state, now, 0, cost),
    }
}

/// Charges `cost` more units at `now` whatever the limit (a response that cost more than
/// was held, DESIGN §12): the key carries the debt, so its next requests wait for it.
/// Windows and logs count past the limit; token_bucket and gcra book ahead, as a delayed
/// request with no bound on its wait would. Not for leaky_bucket or concurrency (`check`
/// refuses response costs there): their state is returned unchanged.
pub fn charge(rule: &Rule, state: Option<&State>, now: u64, cost: u64) -> Option<State> {
    let unbounded = match rule.algorithm {
        Algorithm::TokenBucket | Algorithm::Gcra => Rule {
            max_delay_ms: Some(u64::MAX),
            ..*rule
        },
        Algorithm::FixedWindow | Algorithm::SlidingWindow | Algorithm::SlidingLog => Rule {
            limit: u64::MAX >> 1,
            ..*rule
        },
        Algorithm::LeakyBucket | Algorithm::Concurrency => return None,
    };
    let (verdict, state) = decide(&unbounded, state, now, cost);
    verdict.allowed.then_some(state)
}

/// Takes back `cost` units of a charge made at `charged_at` (the time its decision was
/// made at), as far as they still count: a window that has ended keeps nothing to take
/// back, a bucket never holds more than its capacity. None: nothing changes.
pub fn refund(rule: &Rule, state: &State, charged_at: u64, cost: u64) -> Option<State> {
    let cost = clamp_cost(cost);
    let p = rule.period_ms;
    match state {
        State::Window { start, count } if *start == window(rule, charged_at).0 => {
            Some(State::Window {
                start: *start,
                count: count.saturating_sub(cost),
            })
        }
        State::Sliding { start, prev, curr } => {
            let charged = charged_at - charged_at % p;
            if *start == charged {
                Some(State::Sliding {
                    start: *start,
                    prev: *prev,
                    curr: curr.saturating_sub(cost),
                })
            } else if *start == charged + p {
                // A later request opened the next window: the charge now sits in `prev`.
                Some(State::Sliding {
                    start: *start,
                    prev: prev.saturating_sub(cost),
                    curr: *curr,
                })
            } else {
                None
            }
        }
        State::Log { entries, total } => {
            // Requests admitted in one millisecond count as one entry, as in the sorted set.
            if !entries.iter().any(|(t, _)| *t == charged_at) {
                return None;
            }
            let mut left = cost;
            let mut entries = entries.clone();
            for (_, units) in entries.iter_mut().filter(|(t, _)| *t == charged_at) {
                let taken = left.min(*units);
                *units -= taken;
                left -= taken;
            }
            entries.retain(|(_, units)| *units > 0);
            Some(State::Log {
                entries,
                total: total - (cost - left),
            })
        }
        State::Bucket {
            scaled,
            last,
            period,
        } => Some(State::Bucket {
            scaled: rescale(*scaled, *period, p).saturating_sub(cost.saturating_mul(p)),
            last: *last,
            period: p,
        }),
        _ => None,
    }
}

/// The time (ms) from which `state` means the same as no state at all.
pub fn expires_at(rule: &Rule, state: &State) -> u64 {
    let p = rule.period_ms;
    match state {
        State::Window { start, .. } => match rule.calendar {
            None => start + p,
            Some(c) => calendar::window(c, *start).1,
        },
        State::Sliding { start, curr, .. } => start + if *curr > 0 { 2 * p } else { p },
        State::Log { entries, .. } => entries.back().map_or(0, |(t, _)| t + p),
        State::Bucket {
            scaled,
            last,
            period,
        } => {
            let scaled = rescale(*scaled, *period, p);
            last + ceil_div(scaled as u128, rule.limit as u128) as u64
        }
        State::Leases(leases) => leases.iter().map(|(_, exp)| *exp).max().unwrap_or(0),
    }
}

fn ceil_div(a: u128, b: u128) -> u128 {
    a.div_ceil(b)
}

/// A bucket's units in use, scaled by `from`, in the scale of `to`: the same units, a
/// part of one rounded up to a whole (a new period leaves no fraction to carry).
fn rescale(scaled: u64, from: u64, to: u64) -> u64 {
    if from == to || from == 0 {
        return scaled;
    }
    capped(u128::from(scaled.div_ceil(from)) * u128::from(to))
}

/// A bucket's units in use × period at `now` (drained since it was written, at `limit` a
/// millisecond; a clock that went back drains nothing), at most `MAX_COST`, and the time
/// the state is then at.
fn in_use(rule: &Rule, state: Option<&State>, now: u64) -> (u128, u64) {
    match state {
        Some(State::Bucket {
            scaled,
            last,
            period,
        }) => {
            let scaled = u128::from(rescale(*scaled, *period, rule.period_ms));
            let drained = u128::from(now.saturating_sub(*last)) * u128::from(rule.limit);
            (
                scaled.saturating_sub(drained).min(u128::from(MAX_COST)),
                now.max(*last),
            )
        }
        _ => (0, now),
    }
}

/// The fixed window `at` falls in, [start, end) in ms: aligned to multiples of the period
/// since the epoch, or a calendar day, week or month.
pub fn window(rule: &Rule, at: u64) -> (u64, u64) {
    match rule.calendar {
        None => {
            let start = at - at % rule.period_ms;
            (start, start + rule.period_ms)
        }
        Some(c) => calendar::window(c, at),
    }
}

fn fixed_window(rule: &Rule, state: Option<&State>, now: u64, cost: u64) -> (Verdict, State) {
    let (start, end) = window(rule, now);
    let count = match state {
        // The stored window began inside this one: this window, or (after a longer period
        // came in) a part of it, whose units it keeps.
        Some(State::Window { start: s, count }) if (start..end).contains(s) => *count,
        _ => 0,
    };
    let reset_ms = end - now;
    let allowed = cost == 0 || fits(count, cost, rule.limit);
    let after = if allowed {
        add_units(count, cost)
    } else {
        count
    };
    let verdict = Verdict {
        allowed,
        remaining: rule.limit.saturating_sub(after),
        reset_ms: if after > 0 { reset_ms } else { 0 },
        retry_after_ms: if allowed { 0 } else { reset_ms },
        wait_ms: 0,
        banned: false,
    };
    (
        verdict,
        State::Window {
            start,
            count: after,
        },
    )
}

fn sliding_window(rule: &Rule, state: Option<&State>, now: u64, cost: u64) -> (Verdict, State) {
    let p = rule.period_ms as u128;
    let limit = rule.limit as u128;
    let start = now - now % rule.period_ms;
    let (prev, curr) = match state {
        Some(State::Sliding {
            start: s,
            prev,
            curr,
        }) if *s == start => (*prev, *curr),
        Some(State::Sliding { start: s, curr, .. }) if *s + rule.period_ms == start => (*curr, 0),
        // A window of another period (a new one came in) began inside this window or the
        // one before: all its units count in that one.
        Some(State::Sliding {
            start: s,
            prev,
            curr,
        }) if *s + rule.period_ms > start && *s < start + rule.period_ms => {
            let units = add_units(*prev, *curr);
            if *s > start {
                (0, units)
            } else {
                (units, 0)
            }
        }
        _ => (0, 0),
    };
    let elapsed = (now - start) as u128;
    let (prev_w, curr_w, cost_w) = (prev as u128, curr as u128, cost as u128);
    // prev × (period − elapsed) / period + curr + cost ≤ limit, multiplied through by period
    // (curr + cost ≤ limit first: what the scripts need to compare exactly near 2^53).
    let weighted_prev = prev_w * (p - elapsed);
    let allowed = cost == 0
        || (fits(curr, cost, rule.limit) && weighted_prev + (curr_w + cost_w) * p <= limit * p);
    let curr_after = if allowed { add_units(curr, cost) } else { curr };
    let room = (limit * p).saturating_sub(weighted_prev) / p;
    let remaining = room.saturating_sub(curr_after as u128) as u64;
    let to_window_end = start + rule.period_ms - now;
    let reset_ms = if curr_after > 0 {
        to_window_end + rule.period_ms
    } else if prev > 0 {
        to_window_end
    } else {
        0
    };
    let retry_after_ms = if allowed {
        0
    } else {
        sliding_retry(rule, now - start, prev, curr, cost)
    };
    let verdict = Verdict {
        allowed,
        remaining,
        reset_ms,
        retry_after_ms,
        wait_ms: 0,
        banned: false,
    };
    (
        verdict,
        State::Sliding {
            start,
            prev,
            curr: curr_after,
        },
    )
}

/// The wait until a denied sliding_window request would fit, if nothing else arrives.
fn sliding_retry(rule: &Rule, elapsed: u64, prev: u64, curr: u64, cost: u64) -> u64 {
    let (p, limit) = (rule.period_ms as i128, rule.limit as i128);
    let (elapsed, prev, curr, cost) = (elapsed as i128, prev as i128, curr as i128, cost as i128);
    // Later in this window, as the previous window's weight fades.
    let room = limit * p - (curr + cost) * p;
    if room >= 0 && prev > 0 {
        let wait = (prev * (p - elapsed) - room + prev - 1) / prev;
        if elapsed + wait < p {
            return wait.max(0) as u64;
        }
    }
    // In the next window, where this window's count fades in turn.
    let to_next = p - elapsed;
    let room = (limit - cost) * p;
    if room < 0 {
        return (to_next + p) as u64;
    }
    let offset = if curr == 0 {
        0
    } else {
        ((curr * p - room + curr - 1) / curr).max(0)
    };
    if offset < p {
        (to_next + offset) as u64
    } else {
        (to_next + p) as u64
    }
}

fn sliding_log(rule: &Rule, state: Option<&State>, now: u64, cost: u64) -> (Verdict, State) {
    let (mut entries, mut total) = match state {
        Some(State::Log { entries, total }) => (entries.clone(), *total),
        _ => (VecDeque::new(), 0),
    };
    // Keep entries in (now − period, now].
    while let Some(&(t, c)) = entries.front() {
        if t + rule.period_ms > now {
            break;
        }
        entries.pop_front();
        total -= c;
    }
    let allowed = cost == 0 || fits(total, cost, rule.limit);
    let retry_after_ms = if allowed {
        0
    } else if cost > rule.limit {
        rule.period_ms
    } else {
        // The oldest units must age out until `cost` fits.
        let mut must_free = total + cost - rule.limit;
        let mut at = now;
        for &(t, c) in &entries {
            at = t + rule.period_ms;
            if c >= must_free {
                break;
            }
            must_free -= c;
        }
        at - now
    };
    // The log's units saturate at MAX_COST (only a charge past the limit gets there).
    let units = cost.min(MAX_COST.saturating_sub(total));
    if allowed && units > 0 {
        entries.push_back((now, units));
        total += units;
    }
    let verdict = Verdict {
        allowed,
        remaining: rule.limit.saturating_sub(total),
        reset_ms: entries.back().map_or(0, |(t, _)| t + rule.period_ms - now),
        retry_after_ms,
        wait_ms: 0,
        banned: false,
    };
    (verdict, State::Log { entries, total })
}

fn token_bucket(rule: &Rule, state: Option<&State>, now: u64, cost: u64) -> (Verdict, State) {
    let p = u128::from(rule.period_ms);
    let capacity = u128::from(rule.burst) * p;
    // Tokens are capacity − used; refilled limit per period, continuously.
    let (used, last) = in_use(rule, state, now);
    let need = u128::from(cost) * p;
    // Booked ahead (used > capacity), even cost 0 looks short; it never waits.
    let short = if cost == 0 {
        0
    } else {
        (used + need).saturating_sub(capacity)
    };
    // Compared capped: a charge's unbounded booking (max_delay u64::MAX) takes any wait.
    let wait = capped(ceil_div(short, u128::from(rule.limit)));
    let allowed = match rule.max_delay_ms {
        Some(max_delay) => wait <= max_delay,
        None => short == 0,
    };
    // The units in use saturate at MAX_COST.
    let after = if allowed {
        (used + need).min(u128::from(MAX_COST))
    } else {
        used
    };
    let verdict = Verdict {
        allowed,
        remaining: (capacity.saturating_sub(after) / p) as u64,
        reset_ms: capped(ceil_div(after, u128::from(rule.limit))),
        retry_after_ms: if allowed { 0 } else { wait },
        wait_ms: if allowed { wait } else { 0 },
        banned: false,
    };
    (
        verdict,
        State::Bucket {
            scaled: after as u64,
            last,
            period: rule.period_ms,
        },
    )
}

/// gcra and leaky_bucket share token_bucket's state, T = period/limit and tat = last +
/// scaled/limit (the units in use, draining one per T).
/// gcra: allowed when max(tat, now) + cost·T − now ≤ burst·T.
/// leaky_bucket: allowed when the wait max(slot, now) − now ≤ burst·T; it then waits.
fn gcra(
    rule: &Rule,
    state: Option<&State>,
    now: u64,
    cost: u64,
    shaping: bool,
) -> (Verdict, State) {
    let limit = rule.limit as u128;
    let p = rule.period_ms as u128;
    let tolerance = rule.burst as u128 * p;
    // (tat − now) × limit: the units in use × period, saturated at MAX_COST.
    let (ahead, last) = in_use(rule, state, now);
    let step = cost as u128 * p;
    let new_ahead = ahead + step;
    let (allowed, wait, over) = if cost == 0 {
        // Observes: neither queued nor booked ahead.
        (true, 0, 0)
    } else if shaping {
        // The request leaves in the millisecond its slot falls in (rounded down): rounding
        // up would hold every request of a fast queue a whole extra millisecond.
        (
            ahead <= tolerance,
            ahead / limit,
            ceil_div(ahead.saturating_sub(tolerance), limit),
        )
    } else {
        let over = ceil_div(new_ahead.saturating_sub(tolerance), limit);
        match rule.max_delay_ms {
            // Compared capped, as token_bucket's wait.
            Some(max_delay) => (capped(over) <= max_delay, over, over),
            None => (new_ahead <= tolerance, 0, over),
        }
    };
    let new_ahead = new_ahead.min(u128::from(MAX_COST));
    let after = if allowed { new_ahead } else { ahead };
    let remaining = if shaping {
        // Requests that could still join the queue now.
        if after <= tolerance {
            (tolerance - after) / p + 1
        } else {
            0
        }
    } else {
        tolerance.saturating_sub(after) / p
    };
    let verdict = Verdict {
        allowed,
        remaining: remaining as u64,
        reset_ms: capped(ceil_div(after, limit)),
        retry_after_ms: if allowed { 0 } else { capped(over) },
        wait_ms: if allowed { capped(wait) } else { 0 },
        banned: false,
    };
    let state = State::Bucket {
        scaled: after as u64,
        last,
        period: rule.period_ms,
    };
    (verdict, state)
}

/// concurrency: takes a slot for lease `id` (0: just look) when one is free. `cost == 0`
/// only observes: always allowed, takes no slot, and `remaining` is the slots free now.
pub fn acquire(
    rule: &Rule,
    state: Option<&State>,
    now: u64,
    id: u64,
    cost: u64,
) -> (Verdict, State) {
    let mut leases: Vec<(u64, u64)> = match state {
        Some(State::Leases(l)) => l.iter().copied().filter(|(_, exp)| *exp > now).collect(),
        _ => Vec::new(),
    };
    let observe = cost == 0;
    let allowed = observe || (leases.len() as u64) < rule.limit;
    let takes = allowed && !observe;
    if takes && id != 0 {
        leases.push((id, now + rule.lease_ms));
    }
    let held = leases.len() as u64 + u64::from(takes && id == 0);
    let verdict = Verdict {
        allowed,
        remaining: rule.limit.saturating_sub(held),
        reset_ms: 0,
        // Slots free whenever a response ends; a second is the honest hint.
        retry_after_ms: if allowed { 0 } else { 1000 },
        wait_ms: 0,
        banned: false,
    };
    (verdict, State::Leases(leases))
}

/// concurrency: frees lease `id`.
pub fn release(state: &mut State, id: u64) {
    if let State::Leases(leases) = state {
        leases.retain(|(lease, _)| *lease != id);
    }
}

/// concurrency: lease `id`, if still held at `now`, expires `lease_ms` from `now` instead.
/// A released or expired lease is not brought back: its slot may already be another's.
/// Returns whether the lease was held.
pub fn renew(state: &mut State, id: u64, now: u64, lease_ms: u64) -> bool {
    let State::Leases(leases) = state else {
        return false;
    };
    match leases
        .iter_mut()
        .find(|(lease, exp)| *lease == id && *exp > now)
    {
        Some((_, exp)) => {
            *exp = (*exp).max(now + lease_ms);
            true
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(algorithm: Algorithm, limit: u64, period_ms: u64, burst: u64) -> Rule {
        Rule {
            algorithm,
            limit,
            period_ms,
            burst,
            max_delay_ms: None,
            lease_ms: 60_000,
            calendar: None,
        }
    }

    /// Drives one key on a manual clock, keeping state as a backend would.
    struct Bucket {
        rule: Rule,
        state: Option<State>,
    }

    impl Bucket {
        fn new(rule: Rule) -> Self {
            Bucket { rule, state: None }
        }
        fn hit(&mut self, now: u64, cost: u64) -> Verdict {
            let (v, s) = decide(&self.rule, self.state.as_ref(), now, cost);
            if v.allowed {
                self.state = Some(s);
            }
            v
        }
        fn allowed(&mut self, now: u64, n: usize) -> usize {
            (0..n).filter(|_| self.hit(now, 1).allowed).count()
        }
    }

    const T0: u64 = 1_700_000_000_000;

    #[test]
    fn fixed_window_allows_twice_the_limit_across_a_boundary() {
        let mut b = Bucket::new(rule(Algorithm::FixedWindow, 10, 60_000, 10));
        let end = T0 - T0 % 60_000 + 60_000;
        assert_eq!(b.allowed(end - 1, 15), 10);
        assert_eq!(b.allowed(end, 15), 10, "a new window starts whole");
        let v = b.hit(end + 1_000, 1);
        assert!(!v.allowed);
        assert_eq!(v.retry_after_ms, 59_000);
        assert_eq!(v.remaining, 0);
    }

    #[test]
    fn fixed_window_counts_down_and_resets_at_window_end() {
        let mut b = Bucket::new(rule(Algorithm::FixedWindow, 3, 1_000, 3));
        let start = T0 - T0 % 1_000;
        let v = b.hit(start + 250, 1);
        assert_eq!((v.allowed, v.remaining, v.reset_ms), (true, 2, 750));
        assert_eq!(b.hit(start + 250, 2).remaining, 0);
        assert!(!b.hit(start + 999, 1).allowed);
    }

    #[test]
    fn sliding_window_weights_the_previous_window() {
        let r = rule(Algorithm::SlidingWindow, 10, 1_000, 10);
        let start = T0 - T0 % 1_000;
        let mut b = Bucket::new(r);
        assert_eq!(b.allowed(start + 900, 10), 10);
        // 25% into the next window: 10 × 0.75 = 7.5 counted, so 2 more fit.
        assert_eq!(b.allowed(start + 1_250, 5), 2);
        // 60% in: 10 × 0.4 + 2 = 6, so 4 more fit.
        assert_eq!(b.allowed(start + 1_600, 10), 4);
        // A fresh window later: previous (6) × 0.5 = 3, so 7 fit.
        assert_eq!(b.allowed(start + 2_500, 10), 7);
        // Two windows later nothing is remembered.
        assert_eq!(b.allowed(start + 4_000, 20), 10);
    }

    #[test]
    fn sliding_window_retry_after_is_when_the_request_fits() {
        let r = rule(Algorithm::SlidingWindow, 10, 1_000, 10);
        let start = T0 - T0 % 1_000;
        let mut b = Bucket::new(r);
        assert_eq!(b.allowed(start + 500, 10), 10);
        let v = b.hit(start + 1_000, 1);
        assert!(!v.allowed);
        // At start+1000+w: 10 × (1000 − w)/1000 + 1 ≤ 10 ⇒ w ≥ 100.
        assert_eq!(v.retry_after_ms, 100);
        assert!(!b.hit(start + 1_099, 1).allowed);
        assert!(b.hit(start + 1_100, 1).allowed);
    }

    #[test]
    fn sliding_log_is_exact() {
        let mut b = Bucket::new(rule(Algorithm::SlidingLog, 3, 1_000, 3));
        assert!(b.hit(T0, 1).allowed);
        assert!(b.hit(T0 + 100, 1).allowed);
        assert!(b.hit(T0 + 200, 1).allowed);
        let v = b.hit(T0 + 999, 1);
        assert!(!v.allowed);
        assert_eq!(v.retry_after_ms, 1);
        assert!(
            b.hit(T0 + 1_000, 1).allowed,
            "the first entry left (now − period, now]"
        );
        assert!(!b.hit(T0 + 1_050, 1).allowed);
        let v = b.hit(T0 + 1_050, 2);
        assert_eq!(
            v.retry_after_ms, 150,
            "two units must age out: T0+100 and T0+200"
        );
        assert!(b.hit(T0 + 1_100, 1).allowed);
    }

    #[test]
    fn token_bucket_refills_continuously_and_charges_cost() {
        let mut b = Bucket::new(rule(Algorithm::TokenBucket, 10, 1_000, 5));
        let v = b.hit(T0, 3);
        assert_eq!((v.allowed, v.remaining, v.reset_ms), (true, 2, 300));
        assert_eq!(b.hit(T0, 2).remaining, 0);
        let v = b.hit(T0, 1);
        assert_eq!((v.allowed, v.retry_after_ms), (false, 100));
        assert!(!b.hit(T0 + 99, 1).allowed);
        assert!(b.hit(T0 + 100, 1).allowed);
        let v = b.hit(T0 + 100, 2);
        assert_eq!((v.allowed, v.retry_after_ms), (false, 200));
        assert_eq!(b.hit(T0 + 10_000, 1).remaining, 4, "refill stops at burst");
    }

    #[test]
    fn token_bucket_refills_fractions_exactly() {
        // 3 per second: one token every 333.33 ms.
        let mut b = Bucket::new(rule(Algorithm::TokenBucket, 3, 1_000, 1));
        assert!(b.hit(T0, 1).allowed);
        let v = b.hit(T0 + 333, 1);
        assert_eq!((v.allowed, v.retry_after_ms), (false, 1));
        assert!(b.hit(T0 + 334, 1).allowed);
        assert!(!b.hit(T0 + 667, 1).allowed);
        assert!(b.hit(T0 + 668, 1).allowed);
    }

    #[test]
    fn gcra_matches_token_bucket_on_the_same_sequence() {
        let mut seed = 42u64;
        for (limit, period, burst) in [
            (10, 1_000, 10),
            (3, 1_000, 5),
            (7, 60_000, 2),
            (1000, 1, 1000),
        ] {
            let mut tb = Bucket::new(rule(Algorithm::TokenBucket, limit, period, burst));
            let mut gc = Bucket::new(rule(Algorithm::Gcra, limit, period, burst));
            let mut now = T0;
            for _ in 0..5_000 {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                now += (seed >> 33) % (period / 2 + 1);
                let cost = 1 + (seed >> 20) % 3;
                assert_eq!(
                    tb.hit(now, cost),
                    gc.hit(now, cost),
                    "limit {limit} period {period} at {now}"
                );
            }
        }
    }

    #[test]
    fn gcra_meets_redis_rate_expectations() {
        // go-redis/redis_rate: rate 10/s, burst 10.
        let mut b = Bucket::new(rule(Algorithm::Gcra, 10, 1_000, 10));
        assert_eq!(b.hit(T0, 1).remaining, 9);
        assert_eq!(b.hit(T0, 2).remaining, 7);
        assert_eq!(b.hit(T0, 7).remaining, 0);
        let v = b.hit(T0, 1000);
        assert!(!v.allowed);
        assert!(
            (99_000..=101_000).contains(&v.retry_after_ms),
            "{}",
            v.retry_after_ms
        );
    }

    #[test]
    fn delay_books_ahead_up_to_max_delay() {
        for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
            let mut r = rule(algorithm, 10, 1_000, 1);
            r.max_delay_ms = Some(250);
            let mut b = Bucket::new(r);
            assert_eq!(b.hit(T0, 1).wait_ms, 0);
            assert_eq!(b.hit(T0, 1).wait_ms, 100);
            assert_eq!(b.hit(T0, 1).wait_ms, 200);
            let v = b.hit(T0, 1);
            assert_eq!((v.allowed, v.retry_after_ms), (false, 300), "{algorithm:?}");
            assert_eq!(b.hit(T0 + 50, 1).wait_ms, 250);
        }
    }

    #[test]
    fn leaky_bucket_waits_grow_by_t_per_queued_request() {
        let mut b = Bucket::new(rule(Algorithm::LeakyBucket, 4, 1_000, 3));
        let waits: Vec<u64> = (0..4).map(|_| b.hit(T0, 1).wait_ms).collect();
        assert_eq!(waits, [0, 250, 500, 750]);
        let v = b.hit(T0, 1);
        assert_eq!((v.allowed, v.retry_after_ms), (false, 250));
        assert_eq!(b.hit(T0 + 250, 1).wait_ms, 750, "one left the queue");
        assert_eq!(b.hit(T0 + 10_000, 1).wait_ms, 0);
    }

    #[test]
    fn a_fast_leaky_bucket_does_not_hold_requests_a_whole_millisecond() {
        // 10 000 per second: ten slots per millisecond.
        let mut b = Bucket::new(rule(Algorithm::LeakyBucket, 10_000, 1_000, 100));
        let waits: Vec<u64> = (0..25).map(|_| b.hit(T0, 1).wait_ms).collect();
        assert_eq!(&waits[..10], &[0; 10]);
        assert_eq!(&waits[10..20], &[1; 10]);
        assert_eq!(waits[20], 2);
    }

    #[test]
    fn concurrency_frees_released_and_expired_leases() {
        let r = rule(Algorithm::Concurrency, 2, 1_000, 2);
        let (v, s) = acquire(&r, None, T0, 1, 1);
        assert_eq!((v.allowed, v.remaining), (true, 1));
        let (_, mut s) = acquire(&r, Some(&s), T0, 2, 1);
        assert!(!acquire(&r, Some(&s), T0, 3, 1).0.allowed);
        release(&mut s, 1);
        let (v, s) = acquire(&r, Some(&s), T0, 3, 1);
        assert_eq!((v.allowed, v.remaining), (true, 0));
        assert!(
            acquire(&r, Some(&s), T0 + 60_000, 4, 1).0.allowed,
            "leases expire"
        );
    }

    #[test]
    fn concurrency_renewal_extends_only_live_leases() {
        let r = rule(Algorithm::Concurrency, 1, 1_000, 1);
        let (_, mut s) = acquire(&r, None, T0, 1, 1);
        assert!(renew(&mut s, 1, T0 + 50_000, 60_000));
        assert!(
            !acquire(&r, Some(&s), T0 + 100_000, 2, 1).0.allowed,
            "a renewed lease holds its slot past its first expiry"
        );
        assert!(!renew(&mut s, 2, T0 + 50_000, 60_000), "never held");
        assert!(
            !renew(&mut s, 1, T0 + 110_000, 60_000),
            "expired: not revived"
        );
        release(&mut s, 1);
        assert!(
            !renew(&mut s, 1, T0 + 50_000, 60_000),
            "released: not revived"
        );
    }

    #[test]
    fn cost_zero_only_observes() {
        let mut rules: Vec<Rule> = Algorithm::ALL
            .into_iter()
            .filter(|a| *a != Algorithm::Concurrency)
            .map(|a| rule(a, 4, 1_000, 3))
            .collect();
        for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
            let mut r = rule(algorithm, 10, 1_000, 2);
            r.max_delay_ms = Some(500);
            rules.push(r);
        }
        for r in rules {
            let mut b = Bucket::new(r);
            let fresh = b.hit(T0, 0);
            let whole = match r.algorithm {
                Algorithm::TokenBucket | Algorithm::Gcra => r.burst,
                Algorithm::LeakyBucket => r.burst + 1,
                _ => r.limit,
            };
            assert_eq!(
                (fresh.allowed, fresh.remaining, fresh.reset_ms),
                (true, whole, 0),
                "{r:?}"
            );
            // Fill it (book ahead, queue up) until a request of cost 1 is denied.
            let mut filled = 0;
            while b.hit(T0 + 10, 1).allowed {
                filled += 1;
                assert!(filled < 100, "{r:?} never fills");
            }
            assert!(filled > 0, "{r:?}");
            let denied = b.hit(T0 + 10, 1);
            let before = b.state.clone();
            let v = b.hit(T0 + 10, 0);
            assert!(v.allowed, "{r:?}: cost 0 denied");
            assert_eq!(
                (v.wait_ms, v.retry_after_ms),
                (0, 0),
                "{r:?}: cost 0 delayed"
            );
            assert_eq!(
                (v.remaining, v.reset_ms),
                (denied.remaining, denied.reset_ms),
                "{r:?}: cost 0 reports the current state"
            );
            assert_eq!(b.hit(T0 + 10, 1), denied, "{r:?}: cost 0 charged something");
            if let (Some(before), Some(after)) = (&before, &b.state) {
                let at = T0 + 10 + 2 * r.period_ms;
                assert_eq!(
                    decide(&r, Some(before), at, 1),
                    decide(&r, Some(after), at, 1),
                    "{r:?}"
                );
            }
        }

        let r = rule(Algorithm::Concurrency, 2, 1_000, 2);
        let (v, s) = acquire(&r, None, T0, 9, 0);
        assert_eq!(
            (v.allowed, v.remaining, &s),
            (true, 2, &State::Leases(Vec::new()))
        );
        let (_, s) = acquire(&r, Some(&s), T0, 1, 1);
        let (_, mut s) = acquire(&r, Some(&s), T0, 2, 1);
        assert!(!acquire(&r, Some(&s), T0, 3, 1).0.allowed);
        let (v, after) = acquire(&r, Some(&s), T0, 3, 0);
        assert_eq!((v.allowed, v.remaining, v.retry_after_ms), (true, 0, 0));
        assert_eq!(after, s, "cost 0 took a slot");
        release(&mut s, 1);
        assert_eq!(acquire(&r, Some(&s), T0, 3, 0).0.remaining, 1);
    }

    #[test]
    fn counts_near_2_53_and_2_64_never_wrap() {
        // 2^64 − 3 after 3 of 10 used: a u64 sum wraps to 0; it must be refused.
        for algorithm in [
            Algorithm::FixedWindow,
            Algorithm::SlidingWindow,
            Algorithm::SlidingLog,
            Algorithm::TokenBucket,
            Algorithm::Gcra,
        ] {
            let mut b = Bucket::new(rule(algorithm, 10, 60_000, 10));
            assert!(b.hit(T0, 3).allowed);
            let v = b.hit(T0, u64::MAX - 2);
            assert!(!v.allowed, "{algorithm:?}");
            assert_eq!(v.remaining, 7, "{algorithm:?}");
            assert_eq!(
                b.hit(T0, 0).remaining,
                7,
                "{algorithm:?}: the refusal charged"
            );
        }
        // A limit of 2^53: 1 used, 2^53 more does not fit (1 + 2^53 is 2^53 in a double).
        let mut b = Bucket::new(rule(Algorithm::FixedWindow, MAX_COST, 1_000, MAX_COST));
        assert!(b.hit(T0, 1).allowed);
        assert!(!b.hit(T0, MAX_COST).allowed);
        assert!(b.hit(T0, MAX_COST - 1).allowed);
        assert_eq!(b.hit(T0, 0).remaining, 0);
        assert!(!b.hit(T0, 1).allowed);
    }

    #[test]
    fn charges_beyond_2_53_saturate() {
        let charged = |r: Rule, cost| {
            let mut state = None;
            for _ in 0..3 {
                state = charge(&r, state.as_ref(), T0, cost);
            }
            state.expect("charged")
        };
        let w = rule(Algorithm::FixedWindow, 10, 1_000, 10);
        assert_eq!(
            charged(w, u64::MAX),
            State::Window {
                start: T0 - T0 % 1_000,
                count: MAX_COST
            }
        );
        let l = rule(Algorithm::SlidingLog, 10, 1_000, 10);
        let State::Log { total, entries } = charged(l, MAX_COST - 1) else {
            panic!("a log")
        };
        assert_eq!((total, entries.len()), (MAX_COST, 2));
        // A bucket's units in use (× period) stop at 2^53, a tat's lead too.
        let full = State::Bucket {
            scaled: MAX_COST,
            last: T0,
            period: 1_000,
        };
        let t = rule(Algorithm::TokenBucket, 10, 1_000, 10);
        assert_eq!(charged(t, u64::MAX), full);
        let g = rule(Algorithm::Gcra, 10, 1_000, 10);
        let tat = charged(g, u64::MAX);
        assert_eq!(tat, full);
        let (v, _) = decide(&g, Some(&tat), T0, 1);
        assert!(!v.allowed);
        assert!(
            v.retry_after_ms <= MAX_COST && v.reset_ms <= MAX_COST,
            "{v:?}"
        );
    }

    /// An override changes the numbers, not the units used (DESIGN §9.1): a key charged
    /// under one rule decides under another as if that one had counted it all along.
    #[test]
    fn new_numbers_keep_the_units_used() {
        let algorithms = [
            Algorithm::FixedWindow,
            Algorithm::SlidingWindow,
            Algorithm::SlidingLog,
            Algorithm::TokenBucket,
            Algorithm::Gcra,
            Algorithm::LeakyBucket,
        ];
        // (before, after): raised, lowered below the units used, a longer period.
        let changes = [
            ((3, 60_000, 3), (5_000, 60_000, 5_000)),
            ((10, 60_000, 10), (2, 60_000, 2)),
            ((3, 60_000, 3), (5_000, 3_600_000, 5_000)),
        ];
        for algorithm in algorithms {
            for ((l0, p0, b0), (l1, p1, b1)) in changes {
                let old = rule(algorithm, l0, p0, b0);
                let new = rule(algorithm, l1, p1, b1);
                let (mut before, mut all_along) = (Bucket::new(old), Bucket::new(new));
                for _ in 0..3 {
                    before.hit(T0, 1);
                    all_along.hit(T0, 1);
                }
                let at = T0 + 7;
                let got = decide(&new, before.state.as_ref(), at, 0).0;
                let want = decide(&new, all_along.state.as_ref(), at, 0).0;
                assert_eq!(got.remaining, want.remaining, "{algorithm:?} {l0}->{l1}");
                if algorithm != Algorithm::LeakyBucket && l1 == 5_000 {
                    assert_eq!(got.remaining, 4_997, "{algorithm:?}");
                }
                if l1 == 2 && algorithm != Algorithm::LeakyBucket {
                    assert_eq!(got.remaining, 0, "{algorithm:?}: 3 used of 2");
                }
            }
        }
    }

    #[test]
    fn expiry_marks_state_equal_to_none() {
        let cases = [
            (rule(Algorithm::FixedWindow, 5, 1_000, 5), 1),
            (rule(Algorithm::SlidingWindow, 5, 1_000, 5), 3),
            (rule(Algorithm::SlidingLog, 5, 1_000, 5), 2),
            (rule(Algorithm::TokenBucket, 3, 1_000, 5), 4),
            (rule(Algorithm::Gcra, 3, 1_000, 5), 4),
            (rule(Algorithm::LeakyBucket, 3, 1_000, 5), 1),
        ];
        for (r, cost) in cases {
            let (_, s) = decide(&r, None, T0 + 123, cost);
            let at = expires_at(&r, &s);
            assert!(at > T0 + 123);
            assert_eq!(
                decide(&r, Some(&s), at, 1).0,
                decide(&r, None, at, 1).0,
                "{:?}",
                r.algorithm
            );
            assert_ne!(
                decide(&r, Some(&s), at - 1, 1).0,
                decide(&r, None, at - 1, 1).0,
                "{:?}",
                r.algorithm
            );
        }
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        /// Costs near the edges that matter (0, 2^53, 2^64) and anywhere.
        fn cost() -> impl Strategy<Value = u64> {
            prop_oneof![
                0..=12u64,
                (MAX_COST - 3)..=(MAX_COST + 3),
                (u64::MAX - 3)..=u64::MAX,
                any::<u64>(),
            ]
        }

        #[derive(Debug, Clone, Copy)]
        enum Op {
            Decide,
            Charge,
            Refund,
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![Just(Op::Decide), Just(Op::Charge), Just(Op::Refund)]
        }

        fn rules() -> impl Strategy<Value = Rule> {
            let algorithm = prop_oneof![
                Just(Algorithm::FixedWindow),
                Just(Algorithm::SlidingWindow),
                Just(Algorithm::SlidingLog),
                Just(Algorithm::TokenBucket),
                Just(Algorithm::Gcra),
                Just(Algorithm::LeakyBucket),
            ];
            (algorithm, 1..=1_000u64, 1..=100_000u64, 1..=1_000u64)
                .prop_map(|(a, limit, period, burst)| rule(a, limit, period, burst))
        }

        proptest! {
            #[test]
            fn saturating_sums_never_wrap_and_are_monotone(a in cost(), b in cost(), c in cost()) {
                let sum = add_units(a, b);
                prop_assert_eq!(u128::from(sum), (u128::from(a) + u128::from(b)).min(u128::from(MAX_COST)));
                prop_assert!(add_units(a.max(c), b) >= sum);
                prop_assert!(add_units(a, b.max(c)) >= sum);
                prop_assert_eq!(fits(a, b, c), u128::from(a) + u128::from(b) <= u128::from(c));
                prop_assert!(clamp_cost(a) <= MAX_COST);
                prop_assert!(clamp_cost(a.max(b)) >= clamp_cost(a));
            }

            /// Whatever came before (decisions, charges and refunds of any size), a request
            /// is admitted only when its cost fits in what is left; a charge never gives units
            /// back; nothing a verdict reports, and no state's expiry, runs past 2^53 ms.
            #[test]
            fn a_cost_is_admitted_only_when_it_fits(
                r in rules(),
                history in proptest::collection::vec((0..5_000u64, op(), cost()), 0..12),
                asked in cost(),
            ) {
                let mut state: Option<State> = None;
                let mut now = T0;
                for (dt, op, cost) in history {
                    now += dt;
                    state = match op {
                        Op::Decide => {
                            let (v, s) = decide(&r, state.as_ref(), now, cost);
                            if v.allowed { Some(s) } else { state }
                        }
                        Op::Charge if r.algorithm != Algorithm::LeakyBucket => {
                            let before = decide(&r, state.as_ref(), now, 0).0.remaining;
                            let after = charge(&r, state.as_ref(), now, cost);
                            if let Some(s) = &after {
                                let left = decide(&r, Some(s), now, 0).0.remaining;
                                prop_assert!(left <= before, "a charge of {} gave units back", cost);
                            }
                            after.or(state)
                        }
                        Op::Charge => state,
                        Op::Refund => match &state {
                            Some(s) => refund(&r, s, now, cost).or(state),
                            None => None,
                        },
                    };
                    if let Some(s) = &state {
                        prop_assert!(expires_at(&r, s) <= now + MAX_COST + 2 * r.period_ms, "{:?}", s);
                    }
                }
                let left = decide(&r, state.as_ref(), now, 0).0;
                let (v, _) = decide(&r, state.as_ref(), now, asked);
                for ms in [v.retry_after_ms, v.reset_ms, v.wait_ms] {
                    prop_assert!(ms <= MAX_COST, "{:?}", v);
                }
                if v.allowed && r.algorithm != Algorithm::LeakyBucket {
                    prop_assert!(asked <= left.remaining, "{} admitted with {} left", asked, left.remaining);
                }
                if asked > MAX_COST {
                    prop_assert_eq!(v, decide(&r, state.as_ref(), now, MAX_COST).0);
                }
            }
        }
    }
}

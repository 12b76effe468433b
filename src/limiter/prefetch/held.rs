//! The units of hot keys this instance holds (DESIGN §19): taken ahead from Redis by
//! `prefetch`, admitted once each under the key's lock, dropped by resets, overrides and
//! bans (`runtime`). The rules are `prefetch`'s.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::Arc;

use parking_lot::Mutex;
use prometheus::IntCounter;
use tokio::sync::Notify;

use crate::config::Algorithm;
use crate::limiter::algorithm::{Rule, Verdict};
use crate::limiter::backend::{BackendError, Check};
use crate::limiter::KEY_HASHER;

/// What a "prefetch" call answered (`lua/prefetch.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Taken {
    /// The script's clock when it took them.
    pub now: u64,
    pub granted: u64,
    /// What the key has left after the take, and when it resets.
    pub remaining: u64,
    pub reset_ms: u64,
    /// Units of the previous take the key took back.
    pub returned: u64,
}

impl Taken {
    pub(crate) fn from_reply(reply: &[i64]) -> Result<Taken, BackendError> {
        let whole = |n: i64| {
            u64::try_from(n)
                .map_err(|_| BackendError::Script(format!("prefetch: negative value {n}")))
        };
        match *reply {
            [now, granted, remaining, reset_ms, _delay, returned] => Ok(Taken {
                now: whole(now)?,
                granted: whole(granted)?,
                remaining: whole(remaining)?,
                reset_ms: whole(reset_ms)?,
                returned: whole(returned)?,
            }),
            _ => Err(BackendError::Script(format!(
                "prefetch: expected 6 integers, got {}",
                reply.len()
            ))),
        }
    }
}

const SHARDS: usize = 16;
/// Hot keys followed per shard; past it, keys holding nothing are forgotten.
const KEYS_PER_SHARD: usize = 4096;
/// Cold keys whose rate is followed per shard; past it, all are forgotten (a key then
/// starts cold again: under-prefetching, never more).
const RATES_PER_SHARD: usize = 8192;

/// The units this instance holds, per storage key. Survives reloads (the units are
/// charged in Redis); emptied when the backend changes.
#[derive(Default)]
pub struct Holder {
    shards: [Mutex<Shard>; SHARDS],
}

#[derive(Default)]
struct Shard {
    /// Keys that turned hot: their units and rate.
    entries: HashMap<String, Arc<Entry>>,
    /// The rate of keys not (yet) hot, by the key's 64-bit hash: on a long tail almost
    /// every key is cold, and following one costs no allocation. Two keys sharing a hash
    /// only look hotter, which changes when units are taken, never how many are admitted.
    rates: HashMap<u64, Rate, foldhash::fast::FixedState>,
}

/// Units asked for in the current `hold` interval (from `since`) and in the one before.
#[derive(Default, Clone, Copy)]
struct Rate {
    since: u64,
    this: u64,
    last: u64,
}

impl Rate {
    /// Counts `cost` units asked for at `now`; returns what the key is expected to ask
    /// for within `hold`: the last interval's units, or this one's so far if more.
    fn ask(&mut self, cost: u64, hold: u64, now: u64) -> u64 {
        if now >= self.since + hold {
            self.last = if now < self.since + 2 * hold {
                self.this
            } else {
                0
            };
            self.this = 0;
            self.since = now;
        }
        self.this += cost;
        self.last.max(self.this)
    }
}

/// Whether a key expected to ask for `expected` units within `hold` is worth taking units
/// ahead for: three requests' worth, and an eighth of `max`. A take is a call of its own,
/// while the normal path shares its calls with other keys' decisions (a batch): below an
/// eighth of `max` a take would save fewer calls than it makes.
fn hot(expected: u64, cost: u64, max: u64) -> bool {
    expected >= (3 * cost).max(max / 8)
}

#[derive(Default)]
pub(super) struct Entry {
    state: Mutex<State>,
    refilled: Notify,
}

/// `sluice_prefetch_units_total` of the route and policy that last took units for a key.
pub(super) struct Units {
    pub(super) taken: IntCounter,
    pub(super) used: IntCounter,
    pub(super) returned: IntCounter,
    pub(super) dropped: IntCounter,
}

#[derive(Default)]
struct State {
    /// The numbers the held units were taken under.
    rule: Option<Rule>,
    held: u64,
    /// The script's clock at the take (a refund names it).
    taken_at: u64,
    /// Local ms from which the held units are no longer admitted.
    expires: u64,
    /// Bumped by every take and drop: units taken before it cannot be put back after.
    generation: u64,
    /// What the key had left at the take, and when it resets (local ms).
    remaining: u64,
    reset_at: u64,
    refilling: bool,
    rate: Rate,
    units: Option<Arc<Units>>,
}

/// Units taken from the holder for one request: used when it passes, else put back.
pub(super) struct Ticket {
    entry: Arc<Entry>,
    generation: u64,
    units: u64,
    pub(super) verdict: Verdict,
}

impl Ticket {
    pub(super) fn used(self) {
        if let Some(u) = &self.entry.state.lock().units {
            u.used.inc_by(self.units);
        }
    }

    pub(super) fn put_back(self) {
        let mut s = self.entry.state.lock();
        if s.generation == self.generation {
            s.held += self.units;
        } else if let Some(u) = &s.units {
            // Given back already with the take they came from, or dropped.
            u.dropped.inc_by(self.units);
        }
    }
}

/// What the holder says for one request's check.
pub(super) enum Step<'e> {
    Took(Ticket),
    Cold,
    Wait(tokio::sync::futures::Notified<'e>),
    Refill {
        want: u64,
        back: u64,
        back_at: u64,
        generation: u64,
    },
}

impl Holder {
    fn shard(&self, hash: u64) -> &Mutex<Shard> {
        &self.shards[(hash as usize) % SHARDS]
    }

    /// The entry of `key` once it is hot, counting `cost` units asked for at `now`; None
    /// while it is cold (go the normal path).
    pub(super) fn hot_entry(
        &self,
        key: &str,
        cost: u64,
        hold: u64,
        max: u64,
        now: u64,
    ) -> Option<Arc<Entry>> {
        let hash = KEY_HASHER.hash_one(key);
        let mut shard = self.shard(hash).lock();
        if let Some(e) = shard.entries.get(key) {
            return Some(e.clone());
        }
        if shard.rates.len() >= RATES_PER_SHARD && !shard.rates.contains_key(&hash) {
            shard.rates.clear();
        }
        let rate = shard.rates.entry(hash).or_default();
        let expected = rate.ask(cost, hold, now);
        if !hot(expected, cost, max) {
            return None;
        }
        let rate = *rate;
        shard.rates.remove(&hash);
        if shard.entries.len() >= KEYS_PER_SHARD {
            shard.entries.retain(|_, e| {
                let s = e.state.lock();
                s.held > 0 || s.refilling
            });
        }
        let e = Arc::new(Entry::default());
        // This request's units are counted already: `step` counts them again.
        e.state.lock().rate = Rate {
            this: rate.this - cost,
            ..rate
        };
        shard.entries.insert(key.to_owned(), e.clone());
        Some(e)
    }

    /// Whether this instance holds units of `key`: charged already, so no cached denial
    /// may refuse a request they could admit.
    pub(crate) fn holds(&self, key: &str) -> bool {
        self.entry(key).is_some_and(|e| e.state.lock().held > 0)
    }

    /// Drops the units held for `key` (a reset, a ban).
    pub fn drop_key(&self, key: &str) {
        if let Some(e) = self.entry(key) {
            e.drop_held();
        }
    }

    /// `key`'s entry, if it turned hot (taken out of the shard's lock).
    fn entry(&self, key: &str) -> Option<Arc<Entry>> {
        let shard = self.shard(KEY_HASHER.hash_one(key)).lock();
        shard.entries.get(key).cloned()
    }

    /// Drops every unit held (an override changed, the backend failed or changed).
    pub fn drop_all(&self) {
        for shard in &self.shards {
            let entries: Vec<Arc<Entry>> = shard.lock().entries.values().cloned().collect();
            for e in entries {
                e.drop_held();
            }
        }
    }
}

impl Entry {
    fn drop_held(&self) {
        let mut s = self.state.lock();
        if s.held > 0 {
            if let Some(u) = &s.units {
                u.dropped.inc_by(s.held);
            }
        }
        s.held = 0;
        s.generation += 1;
    }

    /// Takes `check.cost` units if held, else says whether to refill, wait or go the
    /// normal path; counts the units asked for.
    pub(super) fn step(self: &Arc<Self>, check: &Check, hold: u64, max: u64, now: u64) -> Step<'_> {
        let cost = check.cost;
        let mut s = self.state.lock();
        let expected = s.rate.ask(cost, hold, now);
        let usable = s.rule == Some(check.rule) && now < s.expires;
        if usable && s.held >= cost {
            s.held -= cost;
            return Step::Took(Ticket {
                entry: self.clone(),
                generation: s.generation,
                units: cost,
                verdict: Verdict {
                    allowed: true,
                    remaining: s.remaining + s.held,
                    reset_ms: s.reset_at.saturating_sub(now),
                    ..Verdict::default()
                },
            });
        }
        if s.refilling {
            return Step::Wait(self.refilled.notified());
        }
        if !hot(expected, cost, max) {
            return Step::Cold;
        }
        // The units left of the last take go back with this one: under other numbers (an
        // override) they could be given back to the wrong window, so they are dropped.
        let mut back = std::mem::take(&mut s.held);
        if back > 0 && s.rule != Some(check.rule) {
            if let Some(u) = &s.units {
                u.dropped.inc_by(back);
            }
            back = 0;
        }
        s.refilling = true;
        s.generation += 1;
        Step::Refill {
            want: expected.min(max).max(cost),
            back,
            back_at: s.taken_at,
            generation: s.generation,
        }
    }

    /// Stores what a refill brought; the request that made it gets its own units first.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn refilled(
        self: &Arc<Self>,
        check: &Check,
        taken: Option<Taken>,
        back: u64,
        generation: u64,
        hold: u64,
        sent: u64,
        units: &Arc<Units>,
    ) -> Option<Ticket> {
        let mut s = self.state.lock();
        s.refilling = false;
        let ticket = taken.and_then(|t| {
            units.taken.inc_by(t.granted);
            units.returned.inc_by(t.returned);
            units.dropped.inc_by(back.saturating_sub(t.returned));
            s.units = Some(units.clone());
            if t.granted < check.cost {
                return None;
            }
            let rest = t.granted - check.cost;
            if s.generation != generation {
                // Dropped while the call was out (a reset, a ban): the rest is not held.
                units.dropped.inc_by(rest);
            } else {
                let rule = check.rule;
                let life = match rule.algorithm {
                    Algorithm::FixedWindow | Algorithm::SlidingWindow => {
                        hold.min(rule.period_ms - t.now % rule.period_ms)
                    }
                    _ => hold,
                };
                s.rule = Some(rule);
                s.held = rest;
                s.taken_at = t.now;
                // From when the call was sent: never later than the script's own clock.
                s.expires = sent + life;
                s.remaining = t.remaining;
                s.reset_at = sent + t.reset_ms;
            }
            Some(Ticket {
                entry: self.clone(),
                generation: s.generation,
                units: check.cost,
                verdict: Verdict {
                    allowed: true,
                    remaining: t.remaining + s.held,
                    reset_ms: t.reset_ms,
                    ..Verdict::default()
                },
            })
        });
        drop(s);
        self.refilled.notify_waiters();
        ticket
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check() -> Check {
        Check {
            key: "s:{h}:hot:fixed_window".into(),
            rule: Rule {
                algorithm: Algorithm::FixedWindow,
                limit: 100,
                period_ms: 1_000,
                burst: 100,
                max_delay_ms: None,
                lease_ms: 60_000,
                calendar: None,
            },
            cost: 1,
            enforce: true,
            lease: 0,
            ban_ms: 0,
        }
    }

    fn units() -> Arc<Units> {
        let c = || IntCounter::new("u", "u").unwrap_or_else(|e| panic!("{e}"));
        Arc::new(Units {
            taken: c(),
            used: c(),
            returned: c(),
            dropped: c(),
        })
    }

    /// Runs steps until one asks for a refill, and answers it with `granted` units taken at
    /// `now`; returns the refilling request's ticket.
    fn refill(e: &Arc<Entry>, granted: u64, now: u64, u: &Arc<Units>) -> Option<Ticket> {
        let c = check();
        loop {
            match e.step(&c, 250, 16, now) {
                Step::Refill {
                    back, generation, ..
                } => {
                    let taken = Taken {
                        now,
                        granted,
                        remaining: 50,
                        reset_ms: 1_000 - now % 1_000,
                        returned: 0,
                    };
                    return e.refilled(&c, Some(taken), back, generation, 250, now, u);
                }
                Step::Cold => continue,
                Step::Took(_) => panic!("nothing held yet"),
                Step::Wait(_) => panic!("no refill in flight"),
            }
        }
    }

    #[test]
    fn a_cold_key_goes_the_normal_way_until_it_asks_often() {
        let e = Arc::new(Entry::default());
        let c = check();
        assert!(matches!(e.step(&c, 250, 16, 10_000), Step::Cold));
        assert!(matches!(e.step(&c, 250, 16, 10_001), Step::Cold));
        // The third unit asked for within `hold` makes it hot: want what it asked for.
        assert!(matches!(
            e.step(&c, 250, 16, 10_002),
            Step::Refill {
                want: 3,
                back: 0,
                ..
            }
        ));
    }

    #[test]
    fn a_cold_key_has_no_entry_until_it_asks_for_an_eighth_of_max() {
        let h = Holder::default();
        let entries = |h: &Holder| {
            h.shards
                .iter()
                .map(|s| s.lock().entries.len())
                .sum::<usize>()
        };
        // max 256: hot from 32 units asked for within `hold`.
        for i in 0..31 {
            assert!(h.hot_entry("k", 1, 250, 256, 10_000 + i).is_none());
        }
        assert!(h.hot_entry("other", 1, 250, 256, 10_000).is_none());
        assert_eq!(entries(&h), 0);
        let e = h.hot_entry("k", 1, 250, 256, 10_031).expect("hot");
        assert_eq!(entries(&h), 1);
        // Its request is counted once: it asks for the 32 units it expects.
        assert!(matches!(
            e.step(&check(), 250, 256, 10_031),
            Step::Refill { want: 32, .. }
        ));
        // A key whose rate fell away long ago starts cold again.
        for i in 0..31 {
            assert!(h.hot_entry("late", 1, 250, 256, 10_000 + i).is_none());
        }
        assert!(h.hot_entry("late", 1, 250, 256, 20_000).is_none());
    }

    #[test]
    fn held_units_are_admitted_once_each_and_a_refill_is_waited_on() {
        let (e, u) = (Arc::new(Entry::default()), units());
        let c = check();
        let mine = refill(&e, 4, 10_000, &u).expect("granted");
        mine.used();
        // Three held: three admissions, then a refill, which the next request waits on.
        for _ in 0..3 {
            let Step::Took(t) = e.step(&c, 250, 16, 10_010) else {
                panic!("held units")
            };
            assert!(t.verdict.allowed);
            t.used();
        }
        assert!(matches!(
            e.step(&c, 250, 16, 10_011),
            Step::Refill { back: 0, .. }
        ));
        assert!(matches!(e.step(&c, 250, 16, 10_011), Step::Wait(_)));
        assert_eq!((u.taken.get(), u.used.get()), (4, 4));
    }

    #[test]
    fn the_holder_says_whether_it_holds_units_of_a_key() {
        let (h, u, c) = (Holder::default(), units(), check());
        let e = (0..3)
            .find_map(|i| h.hot_entry(&c.key, 1, 250, 16, 10_000 + i))
            .expect("hot on the third request");
        assert!(!h.holds(&c.key), "nothing taken yet");
        refill(&e, 2, 10_010, &u).expect("granted").used();
        assert!(h.holds(&c.key) && !h.holds("s:{h}:other:fixed_window"));
        let Step::Took(t) = e.step(&c, 250, 16, 10_011) else {
            panic!("held")
        };
        t.used();
        assert!(!h.holds(&c.key), "the last unit was used");
    }

    #[test]
    fn units_expire_with_their_window_and_go_back_with_the_next_take() {
        let (e, u) = (Arc::new(Entry::default()), units());
        let c = check();
        // Taken 100 ms before the window ends (hold is 250 ms): they expire with it.
        let _ = refill(&e, 10, 10_900, &u);
        assert!(matches!(e.step(&c, 250, 16, 10_999), Step::Took(_)));
        assert!(matches!(
            e.step(&c, 250, 16, 11_000),
            Step::Refill {
                back: 8,
                back_at: 10_900,
                ..
            }
        ));
    }

    #[test]
    fn a_refused_request_puts_its_units_back_unless_they_were_dropped() {
        let (e, u) = (Arc::new(Entry::default()), units());
        let c = check();
        let _ = refill(&e, 5, 10_000, &u);
        let Step::Took(t) = e.step(&c, 250, 16, 10_001) else {
            panic!("held")
        };
        t.put_back();
        assert_eq!(e.state.lock().held, 4);
        let Step::Took(t) = e.step(&c, 250, 16, 10_002) else {
            panic!("held")
        };
        e.drop_held();
        t.put_back();
        assert_eq!(e.state.lock().held, 0);
        // The 3 held when dropped, and the one put back after.
        assert_eq!(u.dropped.get(), 4);
    }

    #[test]
    fn a_drop_while_a_refill_is_out_keeps_only_the_requests_own_units() {
        let (e, u) = (Arc::new(Entry::default()), units());
        let c = check();
        let (generation, back) = loop {
            if let Step::Refill {
                generation, back, ..
            } = e.step(&c, 250, 16, 10_000)
            {
                break (generation, back);
            }
        };
        e.drop_held();
        let taken = Taken {
            now: 10_000,
            granted: 8,
            remaining: 50,
            reset_ms: 1_000,
            returned: 0,
        };
        assert!(e
            .refilled(&c, Some(taken), back, generation, 250, 10_000, &u)
            .is_some());
        assert_eq!(e.state.lock().held, 0);
        assert_eq!(u.dropped.get(), 7);
    }

    #[test]
    fn replies_read_as_six_integers() {
        let t = Taken::from_reply(&[99, 8, 40, 900, 0, 3]).expect("a reply");
        assert_eq!((t.now, t.granted, t.remaining, t.returned), (99, 8, 40, 3));
        assert!(Taken::from_reply(&[99, 8, 40]).is_err());
        assert!(Taken::from_reply(&[99, -8, 40, 900, 0, 3]).is_err());
    }
}

//! The embedded backend: limiter state in sharded in-process maps, bounded by `max_keys`.

use std::collections::HashMap;
use std::hash::BuildHasher;

use indexmap::IndexMap;

use async_trait::async_trait;
use parking_lot::{Mutex, MutexGuard};

use super::algorithm::{self, State, Verdict};
use super::backend::{Adjustment, Backend, BackendError, Check};
use crate::config::Algorithm;

const SHARDS: usize = 64;
/// Entries looked at, at random places, to find a victim when a shard is full (Redis-style
/// sampled LRU eviction).
const EVICTION_SAMPLE: usize = 16;
/// Every this many inserts a shard drops all its expired entries.
const SWEEP_EVERY: u64 = 4096;

struct Entry {
    state: State,
    expires: u64,
    /// When a decision last read or wrote it: the least recently used of a sample is
    /// evicted first (DESIGN §21), so a flood of new keys cannot reset a key in use.
    used: u64,
}

#[derive(Default)]
struct Shard {
    /// Indexed as well as hashed, so an eviction samples entries at random places, never
    /// the same first few of the table.
    map: IndexMap<String, Entry, foldhash::fast::RandomState>,
    /// Banned keys (`Check::ban_ms`) and until when; bounded like `map`. In the same shard
    /// as the key's state, so a ban is read and set under the lock of its decision.
    bans: HashMap<String, u64, foldhash::fast::RandomState>,
    inserts: u64,
    /// xorshift state for the eviction sample's places.
    rng: u64,
}

pub struct MemoryBackend {
    shards: Vec<Mutex<Shard>>,
    per_shard: usize,
    /// Live keys dropped to stay within `max_keys` (`sluice_memory_evictions_total`).
    evictions: prometheus::IntCounter,
}

impl MemoryBackend {
    pub fn new(max_keys: usize) -> Self {
        MemoryBackend {
            shards: (0..SHARDS)
                .map(|_| {
                    Mutex::new(Shard {
                        rng: rand::random::<u64>() | 1,
                        ..Shard::default()
                    })
                })
                .collect(),
            per_shard: max_keys.div_ceil(SHARDS).max(1),
            evictions: prometheus::IntCounter::new("evictions", "unregistered")
                .expect("valid counter"),
        }
    }

    /// Counts evictions of live keys in `counter` (the registered metric).
    pub fn counting_evictions(mut self, counter: prometheus::IntCounter) -> Self {
        self.evictions = counter;
        self
    }

    fn shard_of(key: &str) -> usize {
        super::KEY_HASHER.hash_one(key) as usize % SHARDS
    }

    /// Keys tracked now (including expired ones not yet dropped).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().map.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Decides a batch synchronously; every shard it touches is held for the whole batch,
    /// so concurrent batches cannot interleave between check and charge.
    pub fn decide_now(&self, checks: &[Check], now: u64) -> Vec<Verdict> {
        let mut order: Vec<usize> = checks.iter().map(|c| Self::shard_of(&c.key)).collect();
        order.sort_unstable();
        order.dedup();
        // Locks taken in ascending shard order never deadlock.
        let mut guards: Vec<(usize, MutexGuard<'_, Shard>)> =
            order.iter().map(|&i| (i, self.shards[i].lock())).collect();
        let mut outcomes = Vec::with_capacity(checks.len());
        for check in checks {
            let shard = Self::guard(&mut guards, &check.key);
            if let Some(rest) = shard.banned(check, now) {
                outcomes.push((banned(rest), State::Leases(Vec::new())));
                continue;
            }
            let state = shard.live(&check.key, now);
            let outcome = match check.rule.algorithm {
                Algorithm::Concurrency => {
                    algorithm::acquire(&check.rule, state, now, check.lease, check.cost)
                }
                _ => algorithm::decide(&check.rule, state, now, check.cost),
            };
            outcomes.push(outcome);
        }
        let commit = checks
            .iter()
            .zip(&outcomes)
            .all(|(c, (v, _))| v.allowed || !c.enforce);
        if commit {
            for (check, (verdict, state)) in checks.iter().zip(outcomes.iter_mut()) {
                // Cost 0 only observes: its state is unchanged, and storing it again would
                // move its expiry to the numbers of this call (an override's), which the
                // Lua scripts never do.
                if verdict.allowed && check.cost > 0 {
                    let state = std::mem::replace(state, State::Leases(Vec::new()));
                    let expires = algorithm::expires_at(&check.rule, &state);
                    let per_shard = self.per_shard;
                    let evicted = Self::guard(&mut guards, &check.key)
                        .insert(&check.key, state, expires, now, per_shard);
                    if evicted {
                        self.evictions.inc();
                    }
                }
            }
        } else {
            // A key its policy rejects now is banned from now on, and answered as a ban is
            // (DESIGN §17): its wait is the ban's, never the window's.
            for (check, (verdict, _)) in checks.iter().zip(outcomes.iter_mut()) {
                if check.enforce && check.ban_ms > 0 && !verdict.allowed && !verdict.banned {
                    let per_shard = self.per_shard;
                    Self::guard(&mut guards, &check.key).ban(
                        &check.key,
                        now + check.ban_ms,
                        now,
                        per_shard,
                    );
                    verdict.retry_after_ms = check.ban_ms;
                    verdict.reset_ms = check.ban_ms;
                }
            }
        }
        outcomes.into_iter().map(|(v, _)| v).collect()
    }

    fn guard<'a, 'g>(guards: &'a mut [(usize, MutexGuard<'g, Shard>)], key: &str) -> &'a mut Shard {
        let i = Self::shard_of(key);
        let at = guards.partition_point(|(s, _)| *s < i);
        &mut guards[at].1
    }

    /// Evaluates `checks` at `now` without charging or banning.
    pub fn peek_now(&self, checks: &[Check], now: u64) -> Vec<Verdict> {
        checks
            .iter()
            .map(|check| {
                let mut shard = self.shards[Self::shard_of(&check.key)].lock();
                if let Some(rest) = shard.banned(check, now) {
                    return banned(rest);
                }
                let state = shard.live(&check.key, now);
                match check.rule.algorithm {
                    Algorithm::Concurrency => {
                        algorithm::acquire(&check.rule, state, now, check.lease, check.cost).0
                    }
                    _ => algorithm::decide(&check.rule, state, now, check.cost).0,
                }
            })
            .collect()
    }

    /// Applies each adjustment to its key's live state (a charge creates it; a refund of a
    /// key with no live state has nothing to take back).
    pub fn adjust_now(&self, adjustments: &[Adjustment], now: u64) {
        for adjustment in adjustments {
            let check = &adjustment.check;
            let mut shard = self.shards[Self::shard_of(&check.key)].lock();
            let state = shard.live(&check.key, now);
            let amount = adjustment.amount.unsigned_abs();
            let adjusted = match (adjustment.amount > 0, state) {
                (true, state) => algorithm::charge(&check.rule, state, now, amount),
                (false, Some(state)) => {
                    algorithm::refund(&check.rule, state, adjustment.charged_at, amount)
                }
                (false, None) => None,
            };
            if let Some(state) = adjusted {
                let expires = algorithm::expires_at(&check.rule, &state);
                if shard.insert(&check.key, state, expires, now, self.per_shard) {
                    self.evictions.inc();
                }
            }
        }
    }

    /// Forgets `key`'s state and ban.
    pub fn reset_now(&self, key: &str) {
        let mut shard = self.shards[Self::shard_of(key)].lock();
        shard.map.swap_remove(key);
        shard.bans.remove(key);
    }

    pub fn release_now(&self, key: &str, lease: u64) {
        let mut shard = self.shards[Self::shard_of(key)].lock();
        if let Some(entry) = shard.map.get_mut(key) {
            algorithm::release(&mut entry.state, lease);
        }
    }

    pub fn renew_now(&self, key: &str, lease: u64, lease_ms: u64, now: u64) -> bool {
        let mut shard = self.shards[Self::shard_of(key)].lock();
        let Some(entry) = shard.map.get_mut(key).filter(|e| e.expires > now) else {
            return false;
        };
        let held = algorithm::renew(&mut entry.state, lease, now, lease_ms);
        if held {
            entry.expires = entry.expires.max(now + lease_ms);
        }
        held
    }
}

/// The verdict for a key under a ban that has `rest` ms to run.
fn banned(rest: u64) -> Verdict {
    Verdict {
        allowed: false,
        remaining: 0,
        reset_ms: rest,
        retry_after_ms: rest,
        wait_ms: 0,
        banned: true,
    }
}

impl Shard {
    /// `key`'s state, unless it has expired by `now` (then it means no state at all); a
    /// live key is marked used at `now`.
    fn live(&mut self, key: &str, now: u64) -> Option<&State> {
        let entry = self.map.get_mut(key).filter(|e| e.expires > now)?;
        entry.used = now;
        Some(&entry.state)
    }

    /// The rest of `check`'s ban, if its key is banned at `now`.
    fn banned(&self, check: &Check, now: u64) -> Option<u64> {
        if !check.enforce || check.ban_ms == 0 {
            return None;
        }
        let until = *self.bans.get(&check.key)?;
        (until > now).then(|| until - now)
    }

    fn ban(&mut self, key: &str, until: u64, now: u64, capacity: usize) {
        if self.bans.len() >= capacity && !self.bans.contains_key(key) {
            self.bans.retain(|_, u| *u > now);
            if self.bans.len() >= capacity {
                // Still full: the ban that ends soonest among a few goes.
                if let Some(victim) = self
                    .bans
                    .iter()
                    .take(EVICTION_SAMPLE)
                    .min_by_key(|(_, u)| **u)
                    .map(|(k, _)| k.clone())
                {
                    self.bans.remove(&victim);
                }
            }
        }
        self.bans.insert(key.to_owned(), until);
    }

    /// Stores `key`; true when a live key had to be dropped to make room.
    fn insert(&mut self, key: &str, state: State, expires: u64, now: u64, capacity: usize) -> bool {
        self.inserts += 1;
        if self.inserts.is_multiple_of(SWEEP_EVERY) {
            self.map.retain(|_, e| e.expires > now);
            self.bans.retain(|_, until| *until > now);
        }
        // A key already held is updated in place: no new String, no second hash.
        let entry = Entry {
            state,
            expires,
            used: now,
        };
        if let Some(held) = self.map.get_mut(key) {
            *held = entry;
            return false;
        }
        let evicted = self.map.len() >= capacity && self.evict(now);
        self.map.insert(key.to_owned(), entry);
        evicted
    }

    /// Drops the expired entries of a sample taken at random places, or else the least
    /// recently used entry of it (then returns true: a live key was evicted).
    fn evict(&mut self, now: u64) -> bool {
        let len = self.map.len();
        if len == 0 {
            return false;
        }
        let mut sample = [0usize; EVICTION_SAMPLE];
        for place in &mut sample {
            *place = (self.next_random() % len as u64) as usize;
        }
        // Highest place first: a swap_remove moves the last entry into the freed place,
        // which no lower sampled place can be. Each place once.
        sample.sort_unstable_by(|a, b| b.cmp(a));
        let places = || {
            sample
                .iter()
                .enumerate()
                .filter(|&(i, p)| i == 0 || sample[i - 1] != *p)
                .map(|(_, &p)| p)
        };
        let expired = |map: &IndexMap<String, Entry, _>, i: usize| {
            map.get_index(i).is_some_and(|(_, e)| e.expires <= now)
        };
        if places().any(|i| expired(&self.map, i)) {
            for i in places() {
                if expired(&self.map, i) {
                    self.map.swap_remove_index(i);
                }
            }
            return false;
        }
        let victim =
            places().min_by_key(|&i| self.map.get_index(i).map_or(u64::MAX, |(_, e)| e.used));
        victim.is_some_and(|i| self.map.swap_remove_index(i).is_some())
    }

    fn next_random(&mut self) -> u64 {
        // xorshift64: enough to spread a sample; the seed is random per shard.
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        x
    }
}

#[async_trait]
impl Backend for MemoryBackend {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn decide(&self, checks: &[Check], now_ms: u64) -> Result<Vec<Verdict>, BackendError> {
        Ok(self.decide_now(checks, now_ms))
    }

    async fn adjust(&self, adjustments: &[Adjustment], now_ms: u64) -> Result<(), BackendError> {
        self.adjust_now(adjustments, now_ms);
        Ok(())
    }

    async fn release(&self, key: &str, lease: u64) -> Result<(), BackendError> {
        self.release_now(key, lease);
        Ok(())
    }

    fn decide_in_place(&self, checks: &[Check], now_ms: u64) -> Option<Vec<Verdict>> {
        Some(self.decide_now(checks, now_ms))
    }

    fn release_in_place(&self, key: &str, lease: u64) -> bool {
        self.release_now(key, lease);
        true
    }

    async fn renew(
        &self,
        key: &str,
        lease: u64,
        lease_ms: u64,
        now_ms: u64,
    ) -> Result<bool, BackendError> {
        Ok(self.renew_now(key, lease, lease_ms, now_ms))
    }

    async fn ping(&self) -> bool {
        true
    }

    async fn peek(&self, checks: &[Check], now_ms: u64) -> Result<Vec<Verdict>, BackendError> {
        Ok(self.peek_now(checks, now_ms))
    }

    async fn reset(&self, key: &str) -> Result<(), BackendError> {
        self.reset_now(key);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::algorithm::Rule;

    fn check(key: &str, algorithm: Algorithm, limit: u64, enforce: bool) -> Check {
        Check {
            key: key.to_owned(),
            rule: Rule {
                algorithm,
                limit,
                period_ms: 1_000,
                burst: limit,
                max_delay_ms: None,
                lease_ms: 60_000,
                calendar: None,
            },
            cost: 1,
            enforce,
            lease: 7,
            ban_ms: 0,
        }
    }

    #[test]
    fn a_denied_batch_charges_nothing() {
        let m = MemoryBackend::new(1000);
        let wide = check("a", Algorithm::FixedWindow, 10, true);
        let narrow = check("b", Algorithm::FixedWindow, 1, true);
        let both = [wide.clone(), narrow.clone()];
        assert!(m.decide_now(&both, 5_000).iter().all(|v| v.allowed));
        let second = m.decide_now(&both, 5_000);
        assert!(second[0].allowed && !second[1].allowed);
        // `wide` was not charged by the denied batch: 8 left after this one, not 7.
        assert_eq!(m.decide_now(&[wide], 5_000)[0].remaining, 8);
    }

    #[test]
    fn a_shadow_denial_does_not_block_the_batch() {
        let m = MemoryBackend::new(1000);
        let enforce = check("a", Algorithm::FixedWindow, 10, true);
        let shadow = check("b", Algorithm::FixedWindow, 1, false);
        let both = [enforce.clone(), shadow];
        m.decide_now(&both, 5_000);
        let v = m.decide_now(&both, 5_000);
        assert!(v[0].allowed && !v[1].allowed);
        assert_eq!(m.decide_now(&[enforce], 5_000)[0].remaining, 7);
    }

    #[test]
    fn distinct_keys_beyond_max_keys_are_evicted() {
        let m = MemoryBackend::new(640);
        for i in 0..50_000 {
            m.decide_now(&[check(&format!("k{i}"), Algorithm::Gcra, 10, true)], 5_000);
        }
        assert!(m.len() <= 640, "{}", m.len());
        assert!(m.evictions.get() >= 50_000 - 640, "{}", m.evictions.get());
    }

    /// A flood of fresh keys into full shards evicts the least recently used keys of its
    /// samples: keys spent a moment ago (and expiring soonest) keep their counts while
    /// older keys remain (DESIGN §21).
    #[test]
    fn a_flood_of_new_keys_does_not_reset_keys_in_use() {
        let m = MemoryBackend::new(SHARDS * 64);
        let period = |mut c: Check, ms: u64| {
            c.rule.period_ms = ms;
            c
        };
        let hour = |key: &str| period(check(key, Algorithm::FixedWindow, 1, true), 3_600_000);
        for i in 0..SHARDS * 64 {
            m.decide_now(&[hour(&format!("old{i}"))], 1_000);
        }
        let in_use: Vec<Check> = (0..64)
            .map(|i| {
                period(
                    check(&format!("in-use{i}"), Algorithm::FixedWindow, 1, true),
                    60_000,
                )
            })
            .collect();
        for c in &in_use {
            assert!(m.decide_now(std::slice::from_ref(c), 5_000)[0].allowed);
            assert!(!m.decide_now(std::slice::from_ref(c), 5_000)[0].allowed);
        }
        for i in 0..SHARDS * 16 {
            m.decide_now(&[hour(&format!("fresh{i}"))], 5_500);
        }
        assert!(m.evictions.get() >= (SHARDS * 16) as u64 / 2);
        for c in &in_use {
            let v = m.decide_now(std::slice::from_ref(c), 5_600);
            assert!(
                !v[0].allowed,
                "{} was evicted and counts from 0 again",
                c.key
            );
        }
    }

    #[test]
    fn expired_state_reads_as_none() {
        let m = MemoryBackend::new(1000);
        let c = check("a", Algorithm::FixedWindow, 1, true);
        assert!(m.decide_now(std::slice::from_ref(&c), 5_000)[0].allowed);
        assert!(!m.decide_now(std::slice::from_ref(&c), 5_999)[0].allowed);
        assert!(m.decide_now(&[c], 6_000)[0].allowed);
    }

    #[test]
    fn a_rejected_key_stays_banned_for_ban_ms() {
        let m = MemoryBackend::new(1000);
        let mut c = check("a", Algorithm::FixedWindow, 1, true);
        c.ban_ms = 5_000;
        assert!(m.decide_now(std::slice::from_ref(&c), 1_000)[0].allowed);
        let v = m.decide_now(std::slice::from_ref(&c), 1_500)[0];
        assert!(
            !v.allowed && !v.banned && v.retry_after_ms == 5_000,
            "{v:?}"
        );
        // A ban shorter than the window's wait answers with its own.
        let mut short = check("short", Algorithm::FixedWindow, 1, true);
        short.rule.period_ms = 60_000;
        short.ban_ms = 2_000;
        assert!(m.decide_now(std::slice::from_ref(&short), 1_000)[0].allowed);
        let v = m.decide_now(std::slice::from_ref(&short), 1_000)[0];
        assert_eq!((v.retry_after_ms, v.reset_ms), (2_000, 2_000), "{v:?}");
        let v = m.decide_now(std::slice::from_ref(&short), 2_500)[0];
        assert!(v.banned && v.retry_after_ms == 500, "{v:?}");
        // The window turned, but the ban holds until 6_500.
        let v = m.decide_now(std::slice::from_ref(&c), 2_000)[0];
        assert!(v.banned && v.retry_after_ms == 4_500, "{v:?}");
        assert!(m.decide_now(std::slice::from_ref(&c), 6_500)[0].allowed);
        // A shadow check bans nobody.
        let mut s = check("s", Algorithm::FixedWindow, 1, false);
        s.ban_ms = 5_000;
        m.decide_now(std::slice::from_ref(&s), 1_000);
        assert!(!m.decide_now(std::slice::from_ref(&s), 1_001)[0].allowed);
        assert!(m.decide_now(std::slice::from_ref(&s), 2_000)[0].allowed);
    }

    #[test]
    fn a_peek_charges_nothing_and_a_reset_forgets_state_and_ban() {
        let m = MemoryBackend::new(1000);
        let mut c = check("a", Algorithm::FixedWindow, 2, true);
        c.ban_ms = 5_000;
        for _ in 0..3 {
            assert_eq!(m.peek_now(std::slice::from_ref(&c), 1_000)[0].remaining, 1);
        }
        m.decide_now(std::slice::from_ref(&c), 1_000);
        m.decide_now(std::slice::from_ref(&c), 1_000);
        assert!(!m.decide_now(std::slice::from_ref(&c), 1_000)[0].allowed);
        assert!(m.peek_now(std::slice::from_ref(&c), 1_100)[0].banned);
        m.reset_now("a");
        let v = m.peek_now(std::slice::from_ref(&c), 1_100)[0];
        assert!(v.allowed && !v.banned, "{v:?}");
    }

    #[test]
    fn concurrency_release_frees_the_slot() {
        let m = MemoryBackend::new(1000);
        let mut c = check("a", Algorithm::Concurrency, 1, true);
        assert!(m.decide_now(std::slice::from_ref(&c), 5_000)[0].allowed);
        c.lease = 8;
        assert!(!m.decide_now(std::slice::from_ref(&c), 5_000)[0].allowed);
        m.release_now("a", 7);
        assert!(m.decide_now(&[c], 5_000)[0].allowed);
    }

    #[test]
    fn a_renewed_lease_outlives_its_first_expiry() {
        let m = MemoryBackend::new(1000);
        let mut c = check("a", Algorithm::Concurrency, 1, true);
        assert!(m.decide_now(std::slice::from_ref(&c), 5_000)[0].allowed);
        assert!(m.renew_now("a", 7, 60_000, 50_000));
        c.lease = 8;
        assert!(!m.decide_now(std::slice::from_ref(&c), 100_000)[0].allowed);
        assert!(!m.renew_now("a", 7, 60_000, 110_000), "expired");
        assert!(m.decide_now(&[c], 110_000)[0].allowed);
    }
}

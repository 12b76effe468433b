//! The local cache of over-limit keys: rejects without asking the backend until the
//! key's `retry_after` has passed. A denied request consumes nothing, so this changes
//! no decision, only where it is made.
//!
//! Overrides: a denial holds for the numbers it was decided with. One key can be counted
//! with other numbers by another request (an override that matches on a part outside the
//! policy's key, or a runtime override set since), so an entry remembers its `Rule` and
//! answers only a request resolved to the same one; any other asks the backend. A ban
//! holds for the key whatever its numbers, so a ban entry answers every request.
//!
//! Costs: a denial holds for its cost and any larger one, not for a smaller one (a request
//! of 2^53 units refused must not refuse the next of 1; an RLS `hits_addend`, a `reserve =
//! "request"` bound, vary per request), so an entry remembers its cost too.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use super::algorithm::Rule;

const SHARDS: usize = 16;

/// Until when a key is denied, for which numbers (`None`: banned, for all of them) and from
/// which cost up.
#[derive(Debug, Clone, Copy)]
struct Entry {
    until: u64,
    rule: Option<Rule>,
    cost: u64,
}

/// A cached denial that answers a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hit {
    pub retry_after_ms: u64,
    /// The key is under a ban (counted as `banned`, not `rejected`).
    pub banned: bool,
}

#[derive(Clone)]
pub struct DenyCache {
    shards: Arc<[Mutex<HashMap<String, Entry>>]>,
    per_shard: usize,
}

impl DenyCache {
    pub fn new(entries: usize) -> Self {
        DenyCache {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            per_shard: entries.div_ceil(SHARDS).max(1),
        }
    }

    fn shard(&self, key: &str) -> &Mutex<HashMap<String, Entry>> {
        // Keys carry a hex hash after the prefix; any byte spread is fine here.
        let h = key
            .bytes()
            .fold(0usize, |h, b| h.wrapping_mul(31).wrapping_add(b as usize));
        &self.shards[h % SHARDS]
    }

    /// Milliseconds until `key` may pass, if it is still known to be over its limit with
    /// `rule`'s numbers for `cost`, or banned.
    pub fn get(&self, key: &str, now: u64, rule: &Rule, cost: u64) -> Option<Hit> {
        let mut shard = self.shard(key).lock();
        match shard.get(key) {
            Some(e) if e.until > now => {
                let banned = e.rule.is_none();
                (banned || (e.rule.as_ref() == Some(rule) && cost >= e.cost)).then(|| Hit {
                    retry_after_ms: e.until - now,
                    banned,
                })
            }
            Some(_) => {
                shard.remove(key);
                None
            }
            None => None,
        }
    }

    /// Entries held now (some may have passed their time and not been dropped yet).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    /// `key` is over its limit with `rule`'s numbers until `until`, for `cost` (> 0) and
    /// more.
    pub fn insert(&self, key: &str, until: u64, rule: &Rule, cost: u64) {
        self.put(key, until, Some(*rule), cost);
    }

    /// Drops whatever is known about `key` (a reset).
    pub fn forget(&self, key: &str) {
        self.shard(key).lock().remove(key);
    }

    /// `key` is banned until `until`.
    pub fn insert_ban(&self, key: &str, until: u64) {
        self.put(key, until, None, 0);
    }

    fn put(&self, key: &str, until: u64, rule: Option<Rule>, cost: u64) {
        let mut shard = self.shard(key).lock();
        if shard.len() >= self.per_shard && !shard.contains_key(key) {
            // Full: forget the entry that frees soonest among a few.
            if let Some(victim) = shard
                .iter()
                .take(8)
                .min_by_key(|(_, e)| e.until)
                .map(|(k, _)| k.clone())
            {
                shard.remove(&victim);
            }
        }
        shard.insert(key.to_owned(), Entry { until, rule, cost });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Algorithm;

    fn rule(limit: u64) -> Rule {
        Rule {
            algorithm: Algorithm::Gcra,
            limit,
            period_ms: 1_000,
            burst: limit,
            max_delay_ms: None,
            lease_ms: 1,
            calendar: None,
        }
    }

    #[test]
    fn entries_last_until_retry_after() {
        let c = DenyCache::new(100);
        c.insert("k", 1_500, &rule(3), 1);
        let hit = |ms| {
            Some(Hit {
                retry_after_ms: ms,
                banned: false,
            })
        };
        assert_eq!(c.get("k", 1_000, &rule(3), 1), hit(500));
        assert_eq!(c.get("k", 1_500, &rule(3), 1), None);
        assert_eq!(c.get("other", 1_000, &rule(3), 1), None);
    }

    #[test]
    fn a_denial_answers_only_its_numbers_and_a_ban_all() {
        let c = DenyCache::new(100);
        c.insert("k", 1_500, &rule(3), 1);
        assert_eq!(
            c.get("k", 1_000, &rule(10), 1),
            None,
            "other numbers ask the backend"
        );
        assert!(c.get("k", 1_000, &rule(3), 1).is_some());
        c.insert_ban("k", 9_000);
        assert_eq!(
            c.get("k", 1_000, &rule(10), 0),
            Some(Hit {
                retry_after_ms: 8_000,
                banned: true
            })
        );
    }

    #[test]
    fn a_denial_answers_its_cost_and_more_only() {
        let c = DenyCache::new(100);
        c.insert("k", 1_500, &rule(3), 1 << 53);
        assert_eq!(
            c.get("k", 1_000, &rule(3), 1),
            None,
            "a smaller cost may fit"
        );
        assert_eq!(c.get("k", 1_000, &rule(3), 0), None, "cost 0 only reads");
        assert!(c.get("k", 1_000, &rule(3), 1 << 53).is_some());
        assert!(c.get("k", 1_000, &rule(3), u64::MAX).is_some());
    }

    #[test]
    fn size_is_bounded() {
        let c = DenyCache::new(32);
        for i in 0..10_000 {
            c.insert(&format!("k{i}"), 5_000, &rule(1), 1);
        }
        let total: usize = c.shards.iter().map(|s| s.lock().len()).sum();
        assert!(total <= 32, "{total}");
    }
}

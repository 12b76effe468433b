//! The local cache of over-limit keys: rejects without asking the backend until the
//! key's `retry_after` has passed. A denied request consumes nothing, so this changes
//! no decision, only where it is made.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

const SHARDS: usize = 16;

#[derive(Clone)]
pub struct DenyCache {
    shards: Arc<[Mutex<HashMap<String, u64>>]>,
    per_shard: usize,
}

impl DenyCache {
    pub fn new(entries: usize) -> Self {
        DenyCache {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            per_shard: entries.div_ceil(SHARDS).max(1),
        }
    }

    fn shard(&self, key: &str) -> &Mutex<HashMap<String, u64>> {
        // Keys carry a hex hash after the prefix; any byte spread is fine here.
        let h = key
            .bytes()
            .fold(0usize, |h, b| h.wrapping_mul(31).wrapping_add(b as usize));
        &self.shards[h % SHARDS]
    }

    /// Milliseconds until `key` may pass, if it is still known to be over its limit.
    pub fn get(&self, key: &str, now: u64) -> Option<u64> {
        let mut shard = self.shard(key).lock();
        match shard.get(key) {
            Some(&until) if until > now => Some(until - now),
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

    pub fn insert(&self, key: &str, until: u64) {
        let mut shard = self.shard(key).lock();
        if shard.len() >= self.per_shard && !shard.contains_key(key) {
            // Full: forget the entry that frees soonest among a few.
            if let Some(victim) = shard
                .iter()
                .take(8)
                .min_by_key(|(_, u)| **u)
                .map(|(k, _)| k.clone())
            {
                shard.remove(&victim);
            }
        }
        shard.insert(key.to_owned(), until);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_last_until_retry_after() {
        let c = DenyCache::new(100);
        c.insert("k", 1_500);
        assert_eq!(c.get("k", 1_000), Some(500));
        assert_eq!(c.get("k", 1_500), None);
        assert_eq!(c.get("other", 1_000), None);
    }

    #[test]
    fn size_is_bounded() {
        let c = DenyCache::new(32);
        for i in 0..10_000 {
            c.insert(&format!("k{i}"), 5_000);
        }
        let total: usize = c.shards.iter().map(|s| s.lock().len()).sum();
        assert!(total <= 32, "{total}");
    }
}

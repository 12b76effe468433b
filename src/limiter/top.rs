//! The heaviest keys of one policy, in fixed memory: a Space-Saving sketch (Metwally et al.).
//!
//! `capacity` slots; a key not held takes the slot with the smallest count and inherits
//! that count as its error bound, so every held key's request count is over-estimated by
//! at most its `error`, and any key seen more than total/capacity times is held.

use std::collections::HashMap;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The key's values, one per part of the policy's key.
    pub key: Vec<String>,
    /// Requests counted: seen since the slot was taken, plus `error`.
    pub requests: u64,
    /// Rejections seen since the slot was taken (the true count is at most `error` more).
    pub rejected: u64,
    /// Allowed requests seen since the slot was taken.
    pub allowed: u64,
    /// How much `requests` may over-count.
    pub error: u64,
}

#[derive(Debug)]
pub struct SpaceSaving {
    capacity: usize,
    index: HashMap<u64, usize>,
    hashes: Vec<u64>,
    /// Estimated count per slot (seen + error): scanned for the minimum, so kept apart.
    counts: Vec<u64>,
    entries: Vec<Entry>,
}

impl SpaceSaving {
    pub fn new(capacity: usize) -> SpaceSaving {
        SpaceSaving {
            capacity,
            index: HashMap::with_capacity(capacity),
            hashes: Vec::with_capacity(capacity),
            counts: Vec::with_capacity(capacity),
            entries: Vec::with_capacity(capacity),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Counts one request of the key with hash `hash`; `key` names it, asked only when the
    /// key takes a slot.
    pub fn record(&mut self, hash: u64, key: impl FnOnce() -> Vec<String>, rejected: bool) {
        if self.capacity == 0 {
            return;
        }
        let slot = match self.index.get(&hash) {
            Some(&i) => i,
            None if self.entries.len() < self.capacity => {
                self.index.insert(hash, self.entries.len());
                self.hashes.push(hash);
                self.counts.push(0);
                self.entries.push(Entry {
                    key: key(),
                    requests: 0,
                    rejected: 0,
                    allowed: 0,
                    error: 0,
                });
                self.entries.len() - 1
            }
            None => {
                let (i, &min) = self
                    .counts
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, c)| **c)
                    .unwrap_or((0, &0));
                self.index.remove(&self.hashes[i]);
                self.index.insert(hash, i);
                self.hashes[i] = hash;
                self.entries[i] = Entry {
                    key: key(),
                    requests: min,
                    rejected: 0,
                    allowed: 0,
                    error: min,
                };
                i
            }
        };
        self.counts[slot] += 1;
        let e = &mut self.entries[slot];
        e.requests += 1;
        if rejected {
            e.rejected += 1;
        } else {
            e.allowed += 1;
        }
    }

    /// The `n` heaviest keys: by rejections, then by requests.
    pub fn top(&self, n: usize) -> Vec<Entry> {
        let mut all = self.entries.clone();
        all.sort_by(|a, b| {
            b.rejected
                .cmp(&a.rejected)
                .then(b.requests.cmp(&a.requests))
                .then(a.key.cmp(&b.key))
        });
        all.truncate(n);
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Zipf-like stream (weight 1/rank) over `keys` keys, from a fixed-seed generator.
    fn zipf(keys: usize, events: usize) -> Vec<usize> {
        let weights: Vec<f64> = (1..=keys).map(|r| 1.0 / r as f64).collect();
        let total: f64 = weights.iter().sum();
        let mut cumulative = Vec::with_capacity(keys);
        let mut acc = 0.0;
        for w in &weights {
            acc += w / total;
            cumulative.push(acc);
        }
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        (0..events)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let u = (state >> 11) as f64 / (1u64 << 53) as f64;
                cumulative.partition_point(|c| *c < u).min(keys - 1)
            })
            .collect()
    }

    #[test]
    fn the_true_top_5_of_a_zipf_stream_is_in_the_top_10() {
        let stream = zipf(10_000, 200_000);
        let mut truth = vec![0u64; 10_000];
        let mut sketch = SpaceSaving::new(100);
        for &k in &stream {
            truth[k] += 1;
            sketch.record(k as u64 * 7919, || vec![format!("k{k}")], false);
        }
        let mut ranked: Vec<usize> = (0..10_000).collect();
        ranked.sort_by(|a, b| truth[*b].cmp(&truth[*a]));
        let top10: Vec<Vec<String>> = sketch.top(10).into_iter().map(|e| e.key).collect();
        for k in &ranked[..5] {
            assert!(
                top10.contains(&vec![format!("k{k}")]),
                "k{k} not in {top10:?}"
            );
        }
        // Every estimate over-counts by at most its error bound.
        for e in sketch.top(100) {
            let k: usize = e.key[0][1..].parse().expect("key");
            assert!(
                e.requests >= truth[k] && e.requests - e.error <= truth[k],
                "{e:?}"
            );
        }
        assert_eq!(sketch.top(1000).len(), 100, "bounded by capacity");
    }

    #[test]
    fn rejections_rank_first_and_zero_capacity_holds_nothing() {
        let mut s = SpaceSaving::new(10);
        for _ in 0..50 {
            s.record(1, || vec!["busy".into()], false);
        }
        for _ in 0..3 {
            s.record(2, || vec!["limited".into()], true);
        }
        let top = s.top(2);
        assert_eq!(top[0].key, ["limited"]);
        assert_eq!((top[0].rejected, top[0].allowed), (3, 0));
        assert_eq!((top[1].key[0].as_str(), top[1].requests), ("busy", 50));
        let mut off = SpaceSaving::new(0);
        off.record(1, || vec!["x".into()], true);
        assert!(off.top(10).is_empty());
    }
}

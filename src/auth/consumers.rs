//! Consumers by API key digest: the config's, swapped whole with each config, and the
//! runtime ones the admin API creates, shared by the fleet (DESIGN §11).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use arc_swap::ArcSwap;
use serde::{Deserialize, Serialize};

pub use crate::config::parse_hex;
use crate::config::Consumer;

/// SHA-256 of an API key: the only form in which keys are kept.
pub fn digest(key: &[u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(ring::digest::digest(&ring::digest::SHA256, key).as_ref());
    out
}

pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 15)]));
    }
    out
}

/// A consumer's name and plan, as a request carries them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Named {
    pub name: Arc<str>,
    pub plan: Option<Arc<str>>,
}

/// The config's consumers, by key digest and by name.
#[derive(Default)]
pub struct Directory {
    by_digest: HashMap<[u8; 32], Named>,
    by_name: HashMap<String, Named>,
}

impl Directory {
    pub fn new(consumers: &[Consumer]) -> Directory {
        let mut d = Directory::default();
        for c in consumers {
            let named = Named {
                name: c.name.as_str().into(),
                plan: c.plan.as_deref().map(Into::into),
            };
            for key in &c.keys {
                d.by_digest.insert(*key, named.clone());
            }
            d.by_name.insert(c.name.clone(), named);
        }
        d
    }

    pub fn by_digest(&self, digest: &[u8; 32]) -> Option<&Named> {
        self.by_digest.get(digest)
    }

    pub fn by_name(&self, name: &str) -> Option<&Named> {
        self.by_name.get(name)
    }
}

/// A consumer created through the admin API, as stored (JSON in the fleet's hash).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeConsumer {
    pub name: String,
    pub plan: Option<String>,
    pub keys: Vec<RuntimeKey>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeKey {
    pub id: String,
    /// Lowercase hex SHA-256 of the key.
    pub digest: String,
}

#[derive(Default)]
struct Index {
    by_name: BTreeMap<String, RuntimeConsumer>,
    by_digest: HashMap<[u8; 32], Named>,
}

impl Index {
    fn build(by_name: BTreeMap<String, RuntimeConsumer>) -> Index {
        let mut by_digest = HashMap::new();
        for c in by_name.values() {
            let named = Named {
                name: c.name.as_str().into(),
                plan: c.plan.as_deref().map(Into::into),
            };
            for k in &c.keys {
                if let Some(d) = parse_hex(&k.digest) {
                    by_digest.insert(d, named.clone());
                }
            }
        }
        Index { by_name, by_digest }
    }
}

/// The runtime consumers: read lock-free on every request, rebuilt whole on each change.
#[derive(Default)]
pub struct RuntimeConsumers {
    index: ArcSwap<Index>,
}

impl RuntimeConsumers {
    pub fn by_digest(&self, digest: &[u8; 32]) -> Option<Named> {
        let index = self.index.load();
        if index.by_digest.is_empty() {
            return None;
        }
        index.by_digest.get(digest).cloned()
    }

    pub fn get(&self, name: &str) -> Option<RuntimeConsumer> {
        self.index.load().by_name.get(name).cloned()
    }

    pub fn all(&self) -> Vec<RuntimeConsumer> {
        self.index.load().by_name.values().cloned().collect()
    }

    pub fn len(&self) -> usize {
        self.index.load().by_name.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn set(&self, consumer: RuntimeConsumer) {
        let mut all = self.index.load().by_name.clone();
        all.insert(consumer.name.clone(), consumer);
        self.index.store(Arc::new(Index::build(all)));
    }

    pub fn remove(&self, name: &str) -> bool {
        let mut all = self.index.load().by_name.clone();
        let had = all.remove(name).is_some();
        self.index.store(Arc::new(Index::build(all)));
        had
    }

    pub fn replace(&self, list: Vec<RuntimeConsumer>) {
        let all = list.into_iter().map(|c| (c.name.clone(), c)).collect();
        self.index.store(Arc::new(Index::build(all)));
    }
}

/// Where the fleet keeps runtime consumers, and the announcement that they changed.
pub fn hash_name(key_prefix: &str) -> String {
    format!("{key_prefix}consumers")
}

pub const CHANGED: &str = "consumers";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_round_trip_through_hex() {
        let d = digest(b"sk_test");
        assert_eq!(parse_hex(&hex(&d)), Some(d));
        assert_eq!(parse_hex(&hex(&d).to_uppercase()), None);
        assert_eq!(parse_hex("abc"), None);
        // SHA-256("password"), the DESIGN example's digest family.
        assert_eq!(
            hex(&digest(b"password")),
            "5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8"
        );
    }

    #[test]
    fn runtime_consumers_are_found_by_digest_until_removed() {
        let r = RuntimeConsumers::default();
        let key = digest(b"sk_1");
        r.set(RuntimeConsumer {
            name: "acme".into(),
            plan: Some("gold".into()),
            keys: vec![RuntimeKey {
                id: "k1".into(),
                digest: hex(&key),
            }],
        });
        assert_eq!(r.by_digest(&key).map(|n| n.plan), Some(Some("gold".into())));
        assert!(r.by_digest(&digest(b"sk_2")).is_none());
        assert!(r.remove("acme"));
        assert!(r.by_digest(&key).is_none());
    }
}

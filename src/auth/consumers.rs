//! Consumers by API key digest: the config's, swapped whole with each config, and the
//! runtime ones the admin API creates, shared by the fleet (DESIGN §11).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
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

/// One change to the runtime consumers, made whole against what is stored now (never a
/// copy read earlier): on the memory backend under one lock, on Redis in one script
/// (`lua/consumer.lua`, which does exactly what `apply` does).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConsumerChange {
    /// Creates the consumer, or changes its plan; its keys stay as they are.
    Put { name: String, plan: Option<String> },
    /// Removes the consumer and its keys.
    Delete { name: String },
    /// Adds a key to an existing consumer.
    AddKey { name: String, key: RuntimeKey },
    /// Removes the consumer's key `id`.
    RevokeKey { name: String, id: String },
}

impl ConsumerChange {
    pub fn name(&self) -> &str {
        match self {
            ConsumerChange::Put { name, .. }
            | ConsumerChange::Delete { name }
            | ConsumerChange::AddKey { name, .. }
            | ConsumerChange::RevokeKey { name, .. } => name,
        }
    }

    /// Makes the change to `all`.
    pub fn apply(&self, all: &mut BTreeMap<String, RuntimeConsumer>) -> Changed {
        match self {
            ConsumerChange::Put { name, plan } => {
                let c = all.entry(name.clone()).or_insert_with(|| RuntimeConsumer {
                    name: name.clone(),
                    plan: None,
                    keys: Vec::new(),
                });
                c.plan.clone_from(plan);
                Changed::Done(Some(c.clone()))
            }
            ConsumerChange::Delete { name } => match all.remove(name) {
                Some(_) => Changed::Done(None),
                None => Changed::NoConsumer,
            },
            ConsumerChange::AddKey { name, key } => match all.get_mut(name) {
                Some(c) => {
                    c.keys.push(key.clone());
                    Changed::Done(Some(c.clone()))
                }
                None => Changed::NoConsumer,
            },
            ConsumerChange::RevokeKey { name, id } => match all.get_mut(name) {
                Some(c) => {
                    let before = c.keys.len();
                    c.keys.retain(|k| k.id != *id);
                    if c.keys.len() == before {
                        return Changed::NoKey;
                    }
                    Changed::Done(Some(c.clone()))
                }
                None => Changed::NoConsumer,
            },
        }
    }
}

/// What a `ConsumerChange` came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Changed {
    /// Made: the consumer as it is now (None: deleted).
    Done(Option<RuntimeConsumer>),
    /// No runtime consumer has that name; nothing changed.
    NoConsumer,
    /// The consumer has no key of that id; nothing changed.
    NoKey,
}

#[derive(Default)]
struct Index {
    by_name: BTreeMap<String, RuntimeConsumer>,
    by_digest: HashMap<[u8; 32], Named>,
    named: HashMap<String, Named>,
}

impl Index {
    fn build(by_name: BTreeMap<String, RuntimeConsumer>) -> Index {
        let mut by_digest = HashMap::new();
        let mut named_by_name = HashMap::with_capacity(by_name.len());
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
            named_by_name.insert(c.name.clone(), named);
        }
        Index {
            by_name,
            by_digest,
            named: named_by_name,
        }
    }
}

/// The runtime consumers: read lock-free on every request, rebuilt whole on each change.
/// Changes are made one at a time (each reads the index it replaces), and every change of
/// content moves `generation` on, so what was looked up before it can tell it is stale.
#[derive(Default)]
pub struct RuntimeConsumers {
    index: ArcSwap<Index>,
    writing: Mutex<()>,
    generation: AtomicU64,
}

impl RuntimeConsumers {
    pub fn by_digest(&self, digest: &[u8; 32]) -> Option<Named> {
        let index = self.index.load();
        if index.by_digest.is_empty() {
            return None;
        }
        index.by_digest.get(digest).cloned()
    }

    /// The consumer `name` as a request carries it: one lookup, no copy of its keys.
    pub fn named(&self, name: &str) -> Option<Named> {
        let index = self.index.load();
        if index.named.is_empty() {
            return None;
        }
        index.named.get(name).cloned()
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

    /// Moves on with every change of content: an answer derived from the consumers (a
    /// remembered token's consumer and plan) holds while this has not moved since. Read it
    /// before looking consumers up.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Stores `all` (under `writing`) when it differs from what is there.
    fn store(&self, all: BTreeMap<String, RuntimeConsumer>) {
        if self.index.load().by_name == all {
            return;
        }
        self.index.store(Arc::new(Index::build(all)));
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Makes `change` here, atomically with any other change in this process (the memory
    /// backend's store, and the copy of a fleet's).
    pub fn change(&self, change: &ConsumerChange) -> Changed {
        let _writing = self.writing.lock();
        let mut all = self.index.load().by_name.clone();
        let changed = change.apply(&mut all);
        if matches!(changed, Changed::Done(_)) {
            self.store(all);
        }
        changed
    }

    /// Everything at once: the fleet's consumers as just read from the backend.
    pub fn replace(&self, list: Vec<RuntimeConsumer>) {
        let all = list.into_iter().map(|c| (c.name.clone(), c)).collect();
        let _writing = self.writing.lock();
        self.store(all);
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
        r.replace(vec![RuntimeConsumer {
            name: "acme".into(),
            plan: Some("gold".into()),
            keys: vec![RuntimeKey {
                id: "k1".into(),
                digest: hex(&key),
            }],
        }]);
        assert_eq!(r.by_digest(&key).map(|n| n.plan), Some(Some("gold".into())));
        assert!(r.by_digest(&digest(b"sk_2")).is_none());
        let removed = r.change(&ConsumerChange::Delete {
            name: "acme".into(),
        });
        assert!(matches!(removed, Changed::Done(_)));
        assert!(r.by_digest(&key).is_none());
    }

    fn key(id: &str) -> RuntimeKey {
        RuntimeKey {
            id: id.into(),
            digest: hex(&digest(id.as_bytes())),
        }
    }

    #[test]
    fn each_change_keeps_what_it_does_not_name() {
        let r = RuntimeConsumers::default();
        let put = |plan: Option<&str>| ConsumerChange::Put {
            name: "acme".into(),
            plan: plan.map(Into::into),
        };
        let add = |id: &str| ConsumerChange::AddKey {
            name: "acme".into(),
            key: key(id),
        };
        let revoke = |id: &str| ConsumerChange::RevokeKey {
            name: "acme".into(),
            id: id.into(),
        };
        assert_eq!(r.change(&add("k1")), Changed::NoConsumer);
        assert_eq!(r.change(&revoke("k1")), Changed::NoConsumer);
        let g0 = r.generation();
        assert!(matches!(
            r.change(&put(Some("gold"))),
            Changed::Done(Some(_))
        ));
        assert!(r.change(&add("k1")) != Changed::NoConsumer);
        assert!(r.change(&add("k2")) != Changed::NoConsumer);
        // A plan change keeps the keys; a revoke keeps the plan and the other keys.
        let Changed::Done(Some(c)) = r.change(&put(Some("silver"))) else {
            panic!("put")
        };
        assert_eq!(c.keys, vec![key("k1"), key("k2")]);
        let Changed::Done(Some(c)) = r.change(&revoke("k1")) else {
            panic!("revoke")
        };
        assert_eq!(
            (c.plan.as_deref(), c.keys),
            (Some("silver"), vec![key("k2")])
        );
        assert_eq!(r.change(&revoke("k1")), Changed::NoKey);
        assert!(r.by_digest(&digest(b"k1")).is_none());
        assert_eq!(
            r.by_digest(&digest(b"k2")).and_then(|n| n.plan).as_deref(),
            Some("silver")
        );
        assert!(r.generation() > g0);
        assert_eq!(
            r.named("acme"),
            Some(Named {
                name: "acme".into(),
                plan: Some("silver".into())
            })
        );
        let delete = ConsumerChange::Delete {
            name: "acme".into(),
        };
        assert_eq!(r.change(&delete), Changed::Done(None));
        assert_eq!(r.change(&delete), Changed::NoConsumer);
        assert!(r.by_digest(&digest(b"k2")).is_none());
        assert!(r.named("acme").is_none());
    }

    #[test]
    fn only_a_change_of_content_moves_the_generation() {
        let r = RuntimeConsumers::default();
        let acme = RuntimeConsumer {
            name: "acme".into(),
            plan: None,
            keys: vec![key("k1")],
        };
        r.replace(vec![acme.clone()]);
        let g = r.generation();
        r.replace(vec![acme.clone()]);
        assert_eq!(r.generation(), g, "the same consumers read again");
        let plan = ConsumerChange::Put {
            name: "acme".into(),
            plan: Some("gold".into()),
        };
        r.change(&plan);
        assert_eq!(r.generation(), g + 1);
        r.change(&plan);
        assert_eq!(r.generation(), g + 1, "a put of the plan it has");
    }

    #[test]
    fn concurrent_changes_in_process_lose_nothing() {
        let r = Arc::new(RuntimeConsumers::default());
        r.change(&ConsumerChange::Put {
            name: "acme".into(),
            plan: None,
        });
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let r = r.clone();
                std::thread::spawn(move || {
                    for i in 0..200 {
                        let id = format!("t{t}-{i}");
                        r.change(&ConsumerChange::AddKey {
                            name: "acme".into(),
                            key: key(&id),
                        });
                        if i % 2 == 0 {
                            r.change(&ConsumerChange::RevokeKey {
                                name: "acme".into(),
                                id,
                            });
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("a thread");
        }
        let keys = r.get("acme").map(|c| c.keys).unwrap_or_default();
        assert_eq!(keys.len(), 8 * 100);
        assert!(keys.iter().all(|k| k
            .id
            .rsplit('-')
            .next()
            .and_then(|i| i.parse::<u32>().ok())
            .is_some_and(|i| i % 2 == 1)));
    }
}

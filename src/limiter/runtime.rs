//! Runtime overrides (DESIGN §9.2): one key's numbers set through the admin API, winning
//! over the config. Held in-process; with a shared backend also in a hash under
//! `key_prefix`, with every change announced on a channel that every instance follows
//! (`FleetListener`) and the hash re-read in full after every (re)subscription, so
//! instances converge.

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};

use super::backend::BackendError;
use super::deny_cache::DenyCache;
use super::fleet::{Fleet, Listener};
use super::Limiter;
use crate::auth::consumers::{self, Changed, ConsumerChange, RuntimeConsumer, RuntimeConsumers};
use crate::clock::unix_ms;
use crate::config::Numbers;

/// One runtime override, as stored (JSON in the fleet's hash) and shown by the admin API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeOverride {
    pub policy: String,
    /// The key's values, one per part of the policy's key.
    pub key: Vec<String>,
    pub limit: u64,
    pub period_ms: u64,
    pub burst: u64,
    /// Unix time in ms after which the override no longer applies (None: never).
    pub expires_at_ms: Option<u64>,
}

impl RuntimeOverride {
    fn live(&self, now_ms: u64) -> bool {
        self.expires_at_ms.is_none_or(|t| t > now_ms)
    }

    fn numbers(&self) -> Option<Numbers> {
        Some(Numbers {
            limit: NonZeroU64::new(self.limit)?,
            period: Duration::from_millis(self.period_ms),
            burst: NonZeroU64::new(self.burst)?,
        })
    }
}

/// What survives reloads: the runtime overrides by storage key, and the deny cache that
/// resets announced by other instances must reach.
#[derive(Default)]
pub struct Shared {
    overrides: RwLock<HashMap<String, RuntimeOverride>>,
    /// `overrides.len()`, read without the lock on every decision.
    count: AtomicUsize,
    deny_cache: Mutex<Option<DenyCache>>,
    /// Consumers created through the admin API (DESIGN §11).
    pub consumers: Arc<RuntimeConsumers>,
    /// Held from reading the fleet's consumers until they are stored: a read that began
    /// later never lands before one that began earlier, so a revoke once seen stays seen.
    consumers_read: tokio::sync::Mutex<()>,
    /// Addresses banned by `max_failures`: storage key -> until (Unix ms), checked before
    /// any credential, here and (announced) on every instance.
    auth_bans: Mutex<HashMap<String, u64>>,
    /// `auth_bans.len()`, read without the lock (or a key) on every request.
    auth_ban_count: AtomicUsize,
    /// Units taken ahead for hot keys (DESIGN §19), dropped by resets, overrides and bans.
    pub prefetch: super::prefetch::held::Holder,
}

/// Bans remembered at most; past it, expired ones go first, then the oldest half.
const AUTH_BANS: usize = 100_000;

impl Shared {
    /// The numbers of a live override for the storage key `key`.
    pub fn numbers(&self, key: &str) -> Option<Numbers> {
        if self.count.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let map = self.overrides.read();
        let o = map.get(key)?;
        if o.live(unix_ms()) {
            o.numbers()
        } else {
            None
        }
    }

    pub fn get(&self, key: &str) -> Option<RuntimeOverride> {
        self.overrides
            .read()
            .get(key)
            .filter(|o| o.live(unix_ms()))
            .cloned()
    }

    pub fn set(&self, key: &str, o: RuntimeOverride) {
        let mut map = self.overrides.write();
        map.insert(key.to_owned(), o);
        self.count.store(map.len(), Ordering::Relaxed);
        self.prefetch.drop_all();
    }

    pub fn remove(&self, key: &str) -> bool {
        let mut map = self.overrides.write();
        let had = map.remove(key).is_some();
        self.count.store(map.len(), Ordering::Relaxed);
        if had {
            self.prefetch.drop_all();
        }
        had
    }

    fn replace(&self, all: HashMap<String, RuntimeOverride>) {
        let mut map = self.overrides.write();
        if *map != all {
            self.prefetch.drop_all();
        }
        *map = all;
        self.count.store(map.len(), Ordering::Relaxed);
    }

    /// The live overrides of `policy`, by storage key.
    pub fn of_policy(&self, policy: &str) -> Vec<RuntimeOverride> {
        let now = unix_ms();
        let mut list: Vec<RuntimeOverride> = self
            .overrides
            .read()
            .values()
            .filter(|o| o.policy == policy && o.live(now))
            .cloned()
            .collect();
        list.sort_by(|a, b| a.key.cmp(&b.key));
        list
    }

    pub fn set_deny_cache(&self, cache: Option<DenyCache>) {
        *self.deny_cache.lock() = cache;
    }

    /// The deny cache forgets `key` (a reset here or on another instance), and so do the
    /// `max_failures` bans.
    pub fn forget(&self, key: &str) {
        if let Some(cache) = self.deny_cache.lock().as_ref() {
            cache.forget(key);
        }
        self.prefetch.drop_key(key);
        let mut bans = self.auth_bans.lock();
        bans.remove(key);
        self.auth_ban_count.store(bans.len(), Ordering::Relaxed);
    }

    /// Milliseconds left of a `max_failures` ban on `key`, if one stands.
    pub fn auth_banned(&self, key: &str, now_ms: u64) -> Option<u64> {
        let until = *self.auth_bans.lock().get(key)?;
        (until > now_ms).then(|| until - now_ms)
    }

    /// Whether any address is banned by `max_failures` (then a request's key is worth
    /// building).
    pub fn any_auth_ban(&self) -> bool {
        self.auth_ban_count.load(Ordering::Relaxed) > 0
    }

    pub fn auth_ban(&self, key: &str, until_ms: u64) {
        let mut bans = self.auth_bans.lock();
        if bans.len() >= AUTH_BANS {
            let now = unix_ms();
            bans.retain(|_, until| *until > now);
            if bans.len() >= AUTH_BANS {
                let mut ends: Vec<u64> = bans.values().copied().collect();
                ends.sort_unstable();
                let cut = ends[ends.len() / 2];
                bans.retain(|_, until| *until > cut);
            }
        }
        let entry = bans.entry(key.to_owned()).or_insert(until_ms);
        *entry = (*entry).max(until_ms);
        self.auth_ban_count.store(bans.len(), Ordering::Relaxed);
    }
}

/// Where the fleet keeps overrides, and the channel changes are announced on.
pub fn hash_name(key_prefix: &str) -> String {
    format!("{key_prefix}overrides")
}

pub fn channel_name(key_prefix: &str) -> String {
    format!("{key_prefix}admin")
}

/// Announcements: "override" (re-read the hash), "reset <storage key>", "consumers"
/// (re-read the runtime consumers), or "ban <until ms> <storage key>" (`max_failures`).
pub const CHANGED: &str = "override";
pub const RESET: &str = "reset ";
pub const BAN: &str = "ban ";
/// "prefetch-drop <storage key>": a prefetch key was banned; every instance drops the units
/// it holds for it (DESIGN §19).
pub const DROP: &str = "prefetch-drop ";

/// Reads the fleet's runtime consumers into `shared`, one read at a time.
pub(super) async fn reload_consumers(
    shared: &Shared,
    fleet: &dyn Fleet,
    hash: &str,
) -> Result<(), String> {
    let _reading = shared.consumers_read.lock().await;
    let entries = fleet.hash_read(hash).await.map_err(|e| e.to_string())?;
    let mut list = Vec::with_capacity(entries.len());
    for (field, value) in entries {
        match serde_json::from_str::<RuntimeConsumer>(&value) {
            Ok(c) => list.push(c),
            Err(e) => log::warn!("runtime consumer {field}: unreadable ({e}); ignored"),
        }
    }
    shared.consumers.replace(list);
    Ok(())
}

impl Limiter {
    /// Makes one change to the runtime consumers (DESIGN §11, §17) against what is stored
    /// now, never a copy read earlier: with a shared backend in one atomic call for the
    /// fleet (`lua/consumer.lua`), after which this instance re-reads the fleet's consumers
    /// and the others are told to; in process under one lock. So a key revoked anywhere
    /// stays revoked whatever else is changed at the same time.
    pub async fn change_consumer(&self, change: &ConsumerChange) -> Result<Changed, BackendError> {
        let Some(fleet) = &self.fleet else {
            return Ok(self.shared.consumers.change(change));
        };
        let hash = consumers::hash_name(&self.settings.key_prefix);
        let changed = self.bounded(fleet.change_consumer(&hash, change)).await?;
        if !matches!(changed, Changed::Done(_)) {
            return Ok(changed);
        }
        let (shared, fleet) = (self.shared.clone(), fleet.clone());
        let reread = self
            .bounded(async move {
                reload_consumers(&shared, fleet.as_ref(), &hash)
                    .await
                    .map_err(BackendError::Connection)
            })
            .await;
        if let Err(e) = reread {
            // Made for the fleet, which is told; this instance catches up on its next read.
            log::warn!("runtime consumers: re-reading after a change failed: {e}");
        }
        // The change is made and answered as made; an instance that missed the word
        // catches up when it next reads the fleet's consumers.
        if let Err(e) = self.announce(consumers::CHANGED).await {
            log::warn!("runtime consumers: announcing a change failed: {e}");
        }
        Ok(changed)
    }
}

/// Reads the fleet's overrides into `shared`, dropping (and deleting) expired ones.
pub(super) async fn reload(shared: &Shared, fleet: &dyn Fleet, hash: &str) -> Result<(), String> {
    let entries = fleet.hash_read(hash).await.map_err(|e| e.to_string())?;
    let now = unix_ms();
    let mut all = HashMap::with_capacity(entries.len());
    let mut expired = Vec::new();
    for (field, value) in entries {
        match serde_json::from_str::<RuntimeOverride>(&value) {
            Ok(o) if o.live(now) => {
                all.insert(field, o);
            }
            Ok(_) => expired.push(field),
            Err(e) => log::warn!("runtime override {field}: unreadable ({e}); ignored"),
        }
    }
    shared.replace(all);
    for field in expired {
        let _ = fleet.hash_write(hash, &field, None).await;
    }
    Ok(())
}

/// Keeps `shared` in step with the fleet: reads the hash in full after every
/// (re)subscription and every probe, applies each announcement as it comes.
pub(super) struct FleetListener {
    pub(super) shared: Weak<Shared>,
    pub(super) fleet: Arc<dyn Fleet>,
    pub(super) hash: String,
    /// The runtime consumers' hash.
    pub(super) consumers: String,
    pub(super) io_timeout: Duration,
}

impl FleetListener {
    /// Re-reads the overrides, and the consumers when `consumers` (or both when every
    /// announcement may have been missed).
    async fn reload_some(&self, overrides: bool, consumers: bool) -> Result<(), String> {
        let Some(shared) = self.shared.upgrade() else {
            return Ok(());
        };
        let fleet = self.fleet.as_ref();
        let work = async {
            if overrides {
                reload(&shared, fleet, &self.hash).await?;
            }
            if consumers {
                reload_consumers(&shared, fleet, &self.consumers).await?;
            }
            Ok(())
        };
        match tokio::time::timeout(self.io_timeout, work).await {
            Ok(result) => result,
            Err(_) => Err(format!("no answer within {:?}", self.io_timeout)),
        }
    }

    async fn reload(&self) -> Result<(), String> {
        self.reload_some(true, true).await
    }
}

#[async_trait]
impl Listener for FleetListener {
    fn wanted(&self) -> bool {
        self.shared.strong_count() > 0
    }

    async fn subscribed(&self) -> Result<(), String> {
        // A reset or a ban may have gone unheard: units held for any key may be stale.
        if let Some(shared) = self.shared.upgrade() {
            shared.prefetch.drop_all();
        }
        self.reload().await
    }

    async fn message(&self, text: &str) {
        if let Some(key) = text.strip_prefix(DROP) {
            if let Some(shared) = self.shared.upgrade() {
                shared.prefetch.drop_key(key);
            }
        } else if let Some(key) = text.strip_prefix(RESET) {
            if let Some(shared) = self.shared.upgrade() {
                shared.forget(key);
            }
        } else if let Some(ban) = text.strip_prefix(BAN) {
            let parsed = ban
                .split_once(' ')
                .and_then(|(until, key)| Some((until.parse::<u64>().ok()?, key)));
            if let (Some(shared), Some((until, key))) = (self.shared.upgrade(), parsed) {
                shared.auth_ban(key, until);
            }
        } else if text == crate::auth::consumers::CHANGED {
            if let Err(e) = self.reload_some(false, true).await {
                log::warn!("runtime consumers: re-reading after a change failed: {e}");
            }
        } else if let Err(e) = self.reload_some(true, false).await {
            log::warn!("runtime overrides: re-reading after {text:?} failed: {e}");
        }
    }

    async fn probed(&self) {
        if let Err(e) = self.reload().await {
            log::debug!("runtime overrides: re-reading failed: {e}");
        }
    }
}

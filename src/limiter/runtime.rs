//! Runtime overrides (DESIGN §9.2): one key's numbers set through the admin API, winning
//! over the config. Held in-process; with a shared backend also in a hash under
//! `key_prefix`, with every change announced on a channel that every instance follows and
//! the hash re-read in full after every (re)subscription, so instances converge.

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::StreamExt;
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};

use super::backend::Backend;
use super::deny_cache::DenyCache;
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

/// Wall-clock Unix ms: override deadlines are compared across instances.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What survives reloads: the runtime overrides by storage key, and the deny cache that
/// resets announced by other instances must reach.
#[derive(Default)]
pub struct Shared {
    overrides: RwLock<HashMap<String, RuntimeOverride>>,
    /// `overrides.len()`, read without the lock on every decision.
    count: AtomicUsize,
    deny_cache: Mutex<Option<DenyCache>>,
}

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
    }

    pub fn remove(&self, key: &str) -> bool {
        let mut map = self.overrides.write();
        let had = map.remove(key).is_some();
        self.count.store(map.len(), Ordering::Relaxed);
        had
    }

    fn replace(&self, all: HashMap<String, RuntimeOverride>) {
        let mut map = self.overrides.write();
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

    /// The deny cache forgets `key` (a reset here or on another instance).
    pub fn forget(&self, key: &str) {
        if let Some(cache) = self.deny_cache.lock().as_ref() {
            cache.forget(key);
        }
    }
}

/// Where the fleet keeps overrides, and the channel changes are announced on.
pub fn hash_name(key_prefix: &str) -> String {
    format!("{key_prefix}overrides")
}

pub fn channel_name(key_prefix: &str) -> String {
    format!("{key_prefix}admin")
}

/// Announcements: "override" (re-read the hash) or "reset <storage key>".
pub const CHANGED: &str = "override";
pub const RESET: &str = "reset ";

/// Reads the fleet's overrides into `shared`, dropping (and deleting) expired ones.
pub async fn reload(shared: &Shared, backend: &dyn Backend, hash: &str) -> Result<(), String> {
    let entries = backend.hash_read(hash).await.map_err(|e| e.to_string())?;
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
        let _ = backend.hash_write(hash, &field, None).await;
    }
    Ok(())
}

/// Pauses between attempts to subscribe, and the full re-read while subscribed (a safety
/// net for expiry clean-up; messages make changes arrive at once).
const PAUSE_FIRST: Duration = Duration::from_millis(100);
const PAUSE_LAST: Duration = Duration::from_secs(2);
const REREAD: Duration = Duration::from_secs(10);
/// Without a channel to follow (Cluster, Sentinel): how often the hash is read.
const POLL: Duration = Duration::from_millis(500);

/// Follows the fleet's changes while `shared` lives. `url`: a single Redis to subscribe
/// to; without one the hash is polled.
pub async fn follow(
    shared: Weak<Shared>,
    backend: Arc<dyn Backend>,
    url: Option<String>,
    key_prefix: String,
    io_timeout: Duration,
) {
    let (hash, channel) = (hash_name(&key_prefix), channel_name(&key_prefix));
    let Some(url) = url else {
        loop {
            let Some(s) = shared.upgrade() else { return };
            if let Ok(Err(e)) =
                tokio::time::timeout(io_timeout, reload(&s, backend.as_ref(), &hash)).await
            {
                log::debug!("runtime overrides: {e}");
            }
            drop(s);
            tokio::time::sleep(POLL).await;
        }
    };
    let mut pause = PAUSE_FIRST;
    let mut complained = false;
    loop {
        let subscribed = async {
            let mut pubsub = redis::Client::open(url.as_str())?
                .get_async_pubsub()
                .await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(pubsub)
        };
        match tokio::time::timeout(io_timeout, subscribed).await {
            Ok(Ok(pubsub)) => {
                pause = PAUSE_FIRST;
                complained = false;
                let why = listen(&shared, backend.as_ref(), &hash, pubsub, io_timeout).await;
                match why {
                    Some(why) => {
                        log::warn!("runtime overrides: lost {channel} ({why}); subscribing again")
                    }
                    None => return,
                }
            }
            Ok(Err(e)) if !complained => {
                complained = true;
                log::warn!("runtime overrides: cannot follow {channel} ({e}); will keep trying");
            }
            _ => {}
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(PAUSE_LAST);
        if shared.strong_count() == 0 {
            return;
        }
    }
}

/// Handles announcements until the connection fails (returns why) or `shared` is gone.
async fn listen(
    shared: &Weak<Shared>,
    backend: &dyn Backend,
    hash: &str,
    pubsub: redis::aio::PubSub,
    io_timeout: Duration,
) -> Option<String> {
    // Subscribed first, then read: a change made in between is in the read or announced.
    {
        let s = shared.upgrade()?;
        if let Ok(Err(e)) = tokio::time::timeout(io_timeout, reload(&s, backend, hash)).await {
            return Some(e);
        }
    }
    let (mut sink, mut messages) = pubsub.split();
    let mut tick = tokio::time::interval(REREAD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            message = messages.next() => {
                let Some(message) = message else {
                    return Some("the server closed the connection".into());
                };
                let s = shared.upgrade()?;
                let text: String = message.get_payload().unwrap_or_default();
                if let Some(key) = text.strip_prefix(RESET) {
                    s.forget(key);
                } else if let Ok(Err(e)) =
                    tokio::time::timeout(io_timeout, reload(&s, backend, hash)).await
                {
                    log::warn!("runtime overrides: re-reading after {text:?} failed: {e}");
                }
            }
            _ = tick.tick() => {
                let s = shared.upgrade()?;
                match tokio::time::timeout(io_timeout, sink.ping::<redis::Value>()).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => return Some(e.to_string()),
                    Err(_) => return Some("no answer to PING".into()),
                }
                let _ = tokio::time::timeout(io_timeout, reload(&s, backend, hash)).await;
            }
        }
    }
}

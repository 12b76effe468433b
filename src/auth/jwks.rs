//! An issuer's `jwks_url`: the source that fetches its JWKS (read into keys by
//! `config::jwks`), refreshes it, keeps the last good set while the URL
//! fails, and re-fetches (rate-limited) when a token names a key it does not have.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use jsonwebtoken::Algorithm;

pub use crate::config::jwks::{KeySet, SetKey};
use crate::metrics::Metrics;

/// How often a URL that has never answered is tried again.
const FIRST_FETCH_RETRY: Duration = Duration::from_secs(2);
/// Longest wait for one fetch, and the largest document read.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);
const MAX_DOCUMENT: usize = 1 << 20;

/// A `jwks_url`: the current set (None until the first success) and its refresher.
pub struct UrlSource {
    pub url: String,
    pub issuer: String,
    allowed: Vec<Algorithm>,
    refresh: Duration,
    refetch_every: Duration,
    current: ArcSwapOption<KeySet>,
    /// SHA-256 of the document `current` was read from.
    document: parking_lot::Mutex<Option<[u8; 32]>>,
    /// Moves on each time a fetch brings a different document (a key dropped or added):
    /// a token verified before no longer counts as verified (DESIGN §17).
    generation: AtomicU64,
    /// Unix ms of the last fetch started for an unknown `kid` (rate limit).
    last_kid_fetch: AtomicU64,
    wake: tokio::sync::Notify,
    metrics: Arc<Metrics>,
}

impl UrlSource {
    /// Starts fetching `url` now and every `refresh` after (every few seconds until the
    /// first success); the task ends when the source is dropped.
    pub fn start(
        url: &str,
        issuer: &str,
        allowed: &[Algorithm],
        refresh: Duration,
        refetch_every: Duration,
        previous: Option<&UrlSource>,
        metrics: Arc<Metrics>,
    ) -> Arc<UrlSource> {
        let source = Arc::new(UrlSource {
            url: url.to_owned(),
            issuer: issuer.to_owned(),
            allowed: allowed.to_vec(),
            refresh,
            refetch_every,
            current: ArcSwapOption::new(previous.and_then(|p| p.current.load_full())),
            document: parking_lot::Mutex::new(previous.and_then(|p| *p.document.lock())),
            generation: AtomicU64::new(0),
            last_kid_fetch: AtomicU64::new(0),
            wake: tokio::sync::Notify::new(),
            metrics,
        });
        let weak = Arc::downgrade(&source);
        tokio::spawn(refresh_while_wanted(weak));
        source
    }

    /// Whether the settings match (then a reload keeps this source and its set).
    pub fn same(
        &self,
        url: &str,
        allowed: &[Algorithm],
        refresh: Duration,
        refetch: Duration,
    ) -> bool {
        self.url == url
            && self.allowed == allowed
            && self.refresh == refresh
            && self.refetch_every == refetch
    }

    pub fn keys(&self) -> Option<Arc<KeySet>> {
        self.current.load_full()
    }

    /// Which set `keys` gives: read it first, and a verification against the set then is
    /// good while it has not moved.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// A token named a `kid` the set lacks: fetch again, at most once per `unknown_kid_refetch`.
    pub fn unknown_kid(&self) {
        let now = crate::clock::unix_ms();
        let last = self.last_kid_fetch.load(Ordering::Relaxed);
        let every = self.refetch_every.as_millis() as u64;
        if now.saturating_sub(last) >= every
            && self
                .last_kid_fetch
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.wake.notify_one();
        }
    }

    /// What a failed fetch leaves in force, for its log line.
    fn meanwhile(&self) -> &'static str {
        if self.current.load().is_some() {
            "keeping the last good set"
        } else {
            "no key set yet: this issuer's tokens get 503 until one is fetched"
        }
    }

    async fn fetch_once(&self) -> bool {
        let up = self.metrics.jwks_up.with_label_values(&[&self.issuer]);
        match tokio::time::timeout(FETCH_TIMEOUT, super::fetch::get(&self.url, MAX_DOCUMENT)).await
        {
            Ok(Ok(body)) => match KeySet::parse(&body, &self.allowed) {
                Ok(set) => {
                    let digest = super::consumers::digest(&body);
                    let mut document = self.document.lock();
                    if *document != Some(digest) {
                        *document = Some(digest);
                        self.current.store(Some(Arc::new(set)));
                        self.generation.fetch_add(1, Ordering::AcqRel);
                    }
                    drop(document);
                    up.set(1);
                    self.metrics
                        .jwks_refresh_timestamp
                        .with_label_values(&[&self.issuer])
                        .set(crate::clock::unix_ms() as f64 / 1000.0);
                    true
                }
                Err(e) => {
                    log::warn!("jwks_url {}: {e}; {}", self.url, self.meanwhile());
                    up.set(0);
                    false
                }
            },
            Ok(Err(e)) => {
                log::warn!("jwks_url {}: {e}; {}", self.url, self.meanwhile());
                up.set(0);
                false
            }
            Err(_) => {
                let meanwhile = self.meanwhile();
                log::warn!(
                    "jwks_url {}: no answer within {FETCH_TIMEOUT:?}; {meanwhile}",
                    self.url
                );
                up.set(0);
                false
            }
        }
    }
}

async fn refresh_while_wanted(source: Weak<UrlSource>) {
    loop {
        let Some(s) = source.upgrade() else { return };
        let fetched = s.fetch_once().await;
        let wait = if fetched || s.current.load().is_some() {
            s.refresh
        } else {
            FIRST_FETCH_RETRY
        };
        // Woken early by an unknown `kid`, or at the next refresh. A source a reload
        // dropped ends here, after at most one more wait.
        let _ = tokio::time::timeout(wait, s.wake.notified()).await;
    }
}

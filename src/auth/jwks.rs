//! An issuer's verification keys: a JWKS document read into the keys it may use, and the
//! `jwks_url` source that fetches it, refreshes it, keeps the last good set while the URL
//! fails, and re-fetches (rate-limited) when a token names a key it does not have.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey};

use crate::metrics::Metrics;

/// One usable key of a set.
#[derive(Clone)]
pub struct SetKey {
    pub kid: Option<String>,
    /// The allowed algorithms this key can check (its type's, narrowed by its `alg`).
    pub algorithms: Vec<Algorithm>,
    pub key: DecodingKey,
}

/// The keys of a JWKS that an issuer's allow-list can use; the rest are left out.
#[derive(Clone, Default)]
pub struct KeySet {
    pub keys: Vec<SetKey>,
}

impl std::fmt::Debug for KeySet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kids: Vec<&str> = self
            .keys
            .iter()
            .map(|k| k.kid.as_deref().unwrap_or("-"))
            .collect();
        write!(f, "KeySet{kids:?}")
    }
}

impl KeySet {
    /// Reads a JWKS document. Keys of other types, for encryption, or for algorithms the
    /// allow-list does not name are skipped; an HMAC (`oct`) key is never taken from a set.
    pub fn parse(text: &[u8], allowed: &[Algorithm]) -> Result<KeySet, String> {
        let doc: serde_json::Value =
            serde_json::from_slice(text).map_err(|e| format!("not JSON: {e}"))?;
        let Some(list) = doc.get("keys").and_then(|k| k.as_array()) else {
            return Err("no \"keys\" array".into());
        };
        let keys = list
            .iter()
            .filter_map(|value| {
                let jwk: Jwk = serde_json::from_value(value.clone()).ok()?;
                usable(&jwk, allowed)
            })
            .collect::<Vec<_>>();
        if keys.is_empty() {
            return Err(format!(
                "no usable key for {} among its {} keys",
                names(allowed),
                list.len()
            ));
        }
        Ok(KeySet { keys })
    }

    /// The keys that may have signed a token with `alg` and `kid`.
    pub fn candidates<'a>(
        &'a self,
        alg: Algorithm,
        kid: Option<&'a str>,
    ) -> impl Iterator<Item = &'a SetKey> + 'a {
        self.keys.iter().filter(move |k| {
            k.algorithms.contains(&alg) && (kid.is_none() || k.kid.as_deref() == kid)
        })
    }

    pub fn has_kid(&self, kid: &str) -> bool {
        self.keys.iter().any(|k| k.kid.as_deref() == Some(kid))
    }
}

pub fn names(algorithms: &[Algorithm]) -> String {
    let list: Vec<String> = algorithms.iter().map(|a| format!("{a:?}")).collect();
    list.join(", ")
}

fn usable(jwk: &Jwk, allowed: &[Algorithm]) -> Option<SetKey> {
    if jwk.common.public_key_use == Some(PublicKeyUse::Encryption) {
        return None;
    }
    use Algorithm::*;
    let by_type: &[Algorithm] = match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => &[RS256, RS384, RS512, PS256, PS384, PS512],
        AlgorithmParameters::EllipticCurve(ec) => match ec.curve {
            EllipticCurve::P256 => &[ES256],
            EllipticCurve::P384 => &[ES384],
            _ => return None,
        },
        AlgorithmParameters::OctetKeyPair(okp) if okp.curve == EllipticCurve::Ed25519 => &[EdDSA],
        _ => return None,
    };
    let own = jwk
        .common
        .key_algorithm
        .and_then(|a| serde_json::to_value(a).ok())
        .and_then(|v| v.as_str().and_then(|s| s.parse::<Algorithm>().ok()));
    let algorithms: Vec<Algorithm> = by_type
        .iter()
        .copied()
        .filter(|a| allowed.contains(a) && own.is_none_or(|own| own == *a))
        .collect();
    if algorithms.is_empty() {
        return None;
    }
    let key = DecodingKey::from_jwk(jwk).ok()?;
    Some(SetKey {
        kid: jwk.common.key_id.clone(),
        algorithms,
        key,
    })
}

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

    /// A token named a `kid` the set lacks: fetch again, at most once per `unknown_kid_refetch`.
    pub fn unknown_kid(&self) {
        let now = crate::limiter::runtime::unix_ms();
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

    async fn fetch_once(&self) -> bool {
        let up = self.metrics.jwks_up.with_label_values(&[&self.issuer]);
        match tokio::time::timeout(FETCH_TIMEOUT, super::fetch::get(&self.url, MAX_DOCUMENT)).await
        {
            Ok(Ok(body)) => match KeySet::parse(&body, &self.allowed) {
                Ok(set) => {
                    self.current.store(Some(Arc::new(set)));
                    up.set(1);
                    self.metrics
                        .jwks_refresh_timestamp
                        .with_label_values(&[&self.issuer])
                        .set(crate::limiter::runtime::unix_ms() as f64 / 1000.0);
                    true
                }
                Err(e) => {
                    log::warn!("jwks_url {}: {e}; keeping the last good set", self.url);
                    up.set(0);
                    false
                }
            },
            Ok(Err(e)) => {
                log::warn!("jwks_url {}: {e}; keeping the last good set", self.url);
                up.set(0);
                false
            }
            Err(_) => {
                log::warn!("jwks_url {}: no answer within {FETCH_TIMEOUT:?}", self.url);
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

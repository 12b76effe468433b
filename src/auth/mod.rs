//! Who is asking, verified (DESIGN §11): credentials from the request, API keys by their
//! SHA-256 digest, bearer tokens by `jwt` against each issuer's keys (`jwks`), and a
//! bounded cache of tokens already verified. The limiter never learns what a credential
//! is: it sees the `consumer`, `plan` and `claim:` key parts of the `Identity` made here.

pub mod consumers;
mod fetch;
pub mod jwks;
pub mod jwt;
pub mod ring_provider;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use http::HeaderMap;
use parking_lot::Mutex;
use serde_json::{Map, Value};

use crate::config::{self, AuthMode, JwtKeys, KeyPart, ANONYMOUS};
use crate::metrics::Metrics;
use consumers::{Directory, Named, RuntimeConsumers};
use jwks::UrlSource;
use jwt::{Failure, Issuer};

/// What the limiter may key on: the verified consumer, its plan, the token's claims.
#[derive(Debug, Clone, Default)]
pub struct Identity {
    /// Absent for anonymous requests.
    pub consumer: Option<Arc<str>>,
    /// `anonymous` without a consumer; absent for a consumer without a plan.
    pub plan: Option<Arc<str>>,
    pub claims: Option<Arc<Map<String, Value>>>,
}

/// Shared by every anonymous request: no allocation per request.
static ANONYMOUS_PLAN: std::sync::LazyLock<Arc<str>> =
    std::sync::LazyLock::new(|| Arc::from(ANONYMOUS));

impl Identity {
    pub fn anonymous() -> Identity {
        Identity {
            consumer: None,
            plan: Some(ANONYMOUS_PLAN.clone()),
            claims: None,
        }
    }

    fn of(named: Named) -> Identity {
        Identity {
            consumer: Some(named.name),
            plan: named.plan,
            claims: None,
        }
    }

    /// A claim of the verified token as a key part reads it: strings, and integers in
    /// decimal.
    pub fn claim(&self, name: &str) -> Option<std::borrow::Cow<'_, str>> {
        match self.claims.as_ref()?.get(name)? {
            Value::String(s) => Some(s.as_str().into()),
            Value::Number(n) if n.is_i64() || n.is_u64() => Some(n.to_string().into()),
            _ => None,
        }
    }
}

/// How a request came out of authentication.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// Verified: the identity, and where the credentials were (for `hide_credentials`).
    Verified(Identity, Presented),
    /// No credential on an `optional` route (or an `off` route).
    Anonymous,
    /// No credential on a `required` route.
    Missing,
    /// A credential that is not good; the text says why, never what it was.
    Invalid(String),
    /// A token whose issuer's keys sluice could not get (503).
    Unavailable(String),
}

impl Outcome {
    /// The `result` label of `sluice_auth_total`.
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Verified(..) => "ok",
            Outcome::Anonymous => "anonymous",
            Outcome::Missing => "missing",
            Outcome::Invalid(_) => "invalid",
            Outcome::Unavailable(_) => "unavailable",
        }
    }
}

/// The `result` labels of `sluice_auth_total`.
pub const AUTH_RESULTS: [&str; 6] = [
    "ok",
    "anonymous",
    "missing",
    "invalid",
    "banned",
    "unavailable",
];

/// Creates at 0 every auth series `config` determines (`sluice_auth_total` of each route
/// with auth, `sluice_jwks_up` of issuers with fixed keys, `sluice_consumers{source="config"}`),
/// and removes those only `previous` had (DESIGN §5).
pub fn prime_metrics(
    metrics: &Metrics,
    config: &config::Config,
    previous: Option<&config::Config>,
) {
    for route in config.routes.iter().filter(|r| r.auth != AuthMode::Off) {
        for result in AUTH_RESULTS {
            metrics
                .auth
                .with_label_values(&[&route.name, result])
                .inc_by(0);
        }
    }
    for issuer in &config.auth.jwt {
        if !matches!(issuer.keys, JwtKeys::Url(_)) {
            metrics.jwks_up.with_label_values(&[&issuer.issuer]).set(1);
        }
    }
    metrics
        .consumers
        .with_label_values(&["config"])
        .set(config.consumers.len() as i64);
    let Some(previous) = previous else { return };
    let authed = |c: &config::Config| -> HashSet<String> {
        c.routes
            .iter()
            .filter(|r| r.auth != AuthMode::Off)
            .map(|r| r.label().to_owned())
            .collect()
    };
    let still = authed(config);
    for label in authed(previous).difference(&still) {
        for result in AUTH_RESULTS {
            let _ = metrics.auth.remove_label_values(&[label, result]);
        }
    }
    for issuer in &previous.auth.jwt {
        if !config.auth.jwt.iter().any(|i| i.issuer == issuer.issuer) {
            let _ = metrics.jwks_up.remove_label_values(&[&issuer.issuer]);
            let _ = metrics
                .jwks_refresh_timestamp
                .remove_label_values(&[&issuer.issuer]);
        }
    }
}

/// Which credentials a request presented.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Presented {
    /// Index into `[auth] api_key` of the source the key came from.
    pub api_key: Option<usize>,
    pub bearer: bool,
}

/// Verified tokens remembered, at most this many.
const TOKEN_CACHE: usize = 100_000;
const CACHE_SHARDS: usize = 16;

/// Tokens already verified, by SHA-256, each until its `exp`: a client repeating its
/// token costs a hash and a lookup, not a signature check.
struct TokenCache {
    shards: Vec<Mutex<CacheShard>>,
}

/// Token digest -> (identity, `exp` in Unix seconds).
type CacheShard = HashMap<[u8; 32], (Identity, u64)>;

impl TokenCache {
    fn new() -> TokenCache {
        TokenCache {
            shards: (0..CACHE_SHARDS)
                .map(|_| Mutex::new(HashMap::new()))
                .collect(),
        }
    }

    fn shard(&self, digest: &[u8; 32]) -> &Mutex<CacheShard> {
        &self.shards[usize::from(digest[0]) % CACHE_SHARDS]
    }

    fn get(&self, digest: &[u8; 32], now_s: u64) -> Option<Identity> {
        let shard = self.shard(digest).lock();
        let (identity, exp) = shard.get(digest)?;
        (*exp > now_s).then(|| identity.clone())
    }

    fn insert(&self, digest: [u8; 32], identity: Identity, exp: u64, now_s: u64) {
        let mut shard = self.shard(&digest).lock();
        if shard.len() >= TOKEN_CACHE / CACHE_SHARDS {
            shard.retain(|_, (_, e)| *e > now_s);
            if shard.len() >= TOKEN_CACHE / CACHE_SHARDS {
                // Full of live tokens: start over rather than grow (a verification each).
                shard.clear();
            }
        }
        shard.insert(digest, (identity, exp));
    }
}

/// Authentication for one config, swapped whole on reload; the runtime consumers and the
/// `jwks_url` sources outlive it.
pub struct Authenticator {
    settings: config::Auth,
    directory: Directory,
    runtime: Arc<RuntimeConsumers>,
    issuers: Vec<Issuer>,
    cache: TokenCache,
    /// The `auth_failures` policy's index among the config's policies (`max_failures`).
    failures: Option<usize>,
    /// `sluice_auth_total` of each route (by index), one counter per result in the order of
    /// `AUTH_RESULTS`, resolved once per config: no label lookup per request.
    counters: Vec<Vec<prometheus::IntCounter>>,
}

impl Authenticator {
    pub fn new(
        config: &config::Config,
        previous: Option<&Authenticator>,
        runtime: Arc<RuntimeConsumers>,
        metrics: &Arc<Metrics>,
    ) -> Authenticator {
        ring_provider::install();
        let sources = previous.map(|p| p.url_sources()).unwrap_or_default();
        let issuers = config
            .auth
            .jwt
            .iter()
            .map(|i| Issuer::new(i, &sources, metrics))
            .collect();
        Authenticator {
            settings: config.auth.clone(),
            directory: Directory::new(&config.consumers),
            runtime,
            issuers,
            cache: TokenCache::new(),
            counters: config
                .routes
                .iter()
                .map(|r| {
                    if r.auth == AuthMode::Off {
                        return Vec::new();
                    }
                    AUTH_RESULTS
                        .iter()
                        .map(|result| metrics.auth.with_label_values(&[r.label(), result]))
                        .collect()
                })
                .collect(),
            failures: config.auth.max_failures.and_then(|_| {
                config
                    .policies
                    .iter()
                    .position(|p| p.name == config::AUTH_FAILURES)
            }),
        }
    }

    /// Counts one request of route `route` with `result` (one of `AUTH_RESULTS`).
    pub fn count(&self, route: usize, result: &str) {
        let at = AUTH_RESULTS.iter().position(|r| *r == result);
        if let Some(counter) = at.and_then(|i| self.counters.get(route)?.get(i)) {
            counter.inc();
        }
    }

    /// The policy counting invalid credentials per address, when `max_failures` is set.
    pub fn failures_policy(&self) -> Option<usize> {
        self.failures
    }

    fn url_sources(&self) -> Vec<Arc<UrlSource>> {
        self.issuers
            .iter()
            .filter_map(|i| match &i.keys {
                jwt::Keys::Url(s) => Some(s.clone()),
                _ => None,
            })
            .collect()
    }

    /// False while some `jwks_url` has never been fetched (`/readyz`).
    pub fn ready(&self) -> bool {
        self.issuers.iter().all(Issuer::ready)
    }

    pub fn settings(&self) -> &config::Auth {
        &self.settings
    }

    /// Who sent this request, for a route with `mode`.
    pub fn authenticate(
        &self,
        mode: AuthMode,
        headers: &HeaderMap,
        query: Option<&str>,
    ) -> Outcome {
        if mode == AuthMode::Off {
            return Outcome::Anonymous;
        }
        let mut presented = Presented::default();
        let api_key = self
            .settings
            .api_key
            .iter()
            .enumerate()
            .find_map(|(i, source)| {
                // Borrowed from a header; decoded (owned) only from a query parameter.
                let value: std::borrow::Cow<[u8]> = match source {
                    KeyPart::Header(name) => {
                        headers.get(name.as_str()).map(|v| v.as_bytes().into())
                    }
                    KeyPart::Query(name) => query_value(query?, name).map(Into::into),
                    _ => None,
                }?;
                presented.api_key = Some(i);
                Some(value)
            });
        let bearer = bearer_token(headers);
        presented.bearer = bearer.is_some();
        let from_key = match api_key {
            None => None,
            Some(key) => match self.by_key(&key) {
                Some(named) => Some(named),
                None => return Outcome::Invalid("unknown API key".into()),
            },
        };
        let from_token = match bearer {
            None => None,
            Some(token) => match self.by_token(token) {
                Ok(identity) => Some(identity),
                Err(Failure::Invalid(why)) => return Outcome::Invalid(why),
                Err(Failure::Unavailable(why)) => return Outcome::Unavailable(why),
            },
        };
        let identity = match (from_key, from_token) {
            (None, None) => {
                return match mode {
                    AuthMode::Required => Outcome::Missing,
                    _ => Outcome::Anonymous,
                }
            }
            (Some(named), None) => Identity::of(named),
            (None, Some(identity)) => identity,
            (Some(named), Some(identity)) => {
                if identity.consumer.as_deref() != Some(&*named.name) {
                    return Outcome::Invalid(
                        "the API key and the bearer token name different consumers".into(),
                    );
                }
                identity
            }
        };
        Outcome::Verified(identity, presented)
    }

    /// One SHA-256 and a lookup: the config's consumers, then the runtime ones.
    fn by_key(&self, key: &[u8]) -> Option<Named> {
        let digest = consumers::digest(key);
        self.directory
            .by_digest(&digest)
            .cloned()
            .or_else(|| self.runtime.by_digest(&digest))
    }

    fn by_token(&self, token: &str) -> Result<Identity, Failure> {
        let digest = consumers::digest(token.as_bytes());
        let now_s = crate::clock::unix_ms() / 1000;
        if let Some(identity) = self.cache.get(&digest, now_s) {
            return Ok(identity);
        }
        let verified = jwt::verify(token, &self.issuers)?;
        // The plan: the token's own claim, else that of the consumer of that name.
        let plan = match verified.plan {
            Some(p) => Some(Arc::<str>::from(p)),
            None => self
                .directory
                .by_name(&verified.consumer)
                .and_then(|n| n.plan.clone())
                .or_else(|| {
                    self.runtime
                        .get(&verified.consumer)
                        .and_then(|c| c.plan.map(Into::into))
                }),
        };
        let identity = Identity {
            consumer: Some(verified.consumer.as_str().into()),
            plan,
            claims: Some(Arc::new(verified.claims)),
        };
        self.cache
            .insert(digest, identity.clone(), verified.exp, now_s);
        Ok(identity)
    }
}

/// `Authorization: Bearer <token>` (the scheme is case-insensitive).
fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// The first value of query parameter `name`, percent-decoded.
fn query_value(query: &str, name: &str) -> Option<Vec<u8>> {
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == name).then(|| percent_encoding::percent_decode_str(v).collect())
    })
}

/// `query` without parameter `name` (`hide_credentials`); None when nothing is left.
pub fn query_without(query: &str, name: &str) -> Option<String> {
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| pair.split_once('=').map_or(*pair, |(k, _)| k) != name)
        .collect();
    (!kept.is_empty()).then(|| kept.join("&"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens_and_query_keys_are_read_as_sent() {
        let mut h = HeaderMap::new();
        h.insert(
            "authorization",
            http::HeaderValue::from_static("bearer abc.def.ghi"),
        );
        assert_eq!(bearer_token(&h), Some("abc.def.ghi"));
        h.insert(
            "authorization",
            http::HeaderValue::from_static("Basic dXNlcjpwYXNz"),
        );
        assert_eq!(bearer_token(&h), None);
        assert_eq!(
            query_value("a=1&api_key=sk%5F1&b", "api_key"),
            Some(b"sk_1".to_vec())
        );
        assert_eq!(query_value("a=1", "api_key"), None);
        assert_eq!(
            query_without("a=1&api_key=x&b", "api_key").as_deref(),
            Some("a=1&b")
        );
        assert_eq!(query_without("api_key=x", "api_key"), None);
    }
}

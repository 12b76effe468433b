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

use http::{HeaderMap, HeaderName, HeaderValue};
use parking_lot::Mutex;
use serde_json::{Map, Value};

use crate::config::{self, AuthMode, JwtConsumers, JwtKeys, KeyPart, ANONYMOUS};
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

/// Which kinds of credential a request presented (`hide_credentials` removes every copy).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Presented {
    /// An API key in a `header:` source of `[auth] api_key`.
    pub key_header: bool,
    /// An API key in a `query:` source.
    pub key_query: bool,
    pub bearer: bool,
}

/// Verified tokens remembered, at most this many.
const TOKEN_CACHE: usize = 100_000;
const CACHE_SHARDS: usize = 16;

/// Tokens already verified, by SHA-256, each until its `exp` and only against the key sets
/// it was verified with (`Authenticator::keys_generation`; a `jwks_file` is read again with
/// a new Authenticator): a client repeating its token costs a hash and a lookup, not a
/// signature check, and a key dropped from its JWKS takes its tokens along (DESIGN §17).
struct TokenCache {
    shards: Vec<Mutex<CacheShard>>,
}

/// Token digest -> (identity, `exp` in Unix seconds, key sets' generation when verified).
type CacheShard = HashMap<[u8; 32], (Identity, u64, u64)>;

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

    fn get(&self, digest: &[u8; 32], now_s: u64, keys: u64) -> Option<Identity> {
        let shard = self.shard(digest).lock();
        let (identity, exp, verified_with) = shard.get(digest)?;
        (*exp > now_s && *verified_with == keys).then(|| identity.clone())
    }

    fn insert(&self, digest: [u8; 32], identity: Identity, exp: u64, now_s: u64, keys: u64) {
        let mut shard = self.shard(&digest).lock();
        if shard.len() >= TOKEN_CACHE / CACHE_SHARDS {
            shard.retain(|_, (_, e, _)| *e > now_s);
            if shard.len() >= TOKEN_CACHE / CACHE_SHARDS {
                // Full of live tokens: start over rather than grow (a verification each).
                shard.clear();
            }
        }
        shard.insert(digest, (identity, exp, keys));
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

    /// Moves on whenever a `jwks_url` brings a different set: a few atomic loads, read
    /// before a token is looked up or verified.
    fn keys_generation(&self) -> u64 {
        self.issuers.iter().fold(0, |sum, i| match &i.keys {
            jwt::Keys::Url(s) => sum.wrapping_add(s.generation()),
            _ => sum,
        })
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

    /// Who sent this request, for a route with `mode`. Every credential is read (each
    /// `api_key` source, every copy, every `Authorization: Bearer`): each must be valid and
    /// all must name one consumer (DESIGN §17).
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
        let mut from_key: Option<Named> = None;
        let any_underscored = has_underscore(headers);
        for source in &self.settings.api_key {
            let checked = match source {
                KeyPart::Header(name) => header_values(headers, name, any_underscored)
                    .try_for_each(|v| {
                        presented.key_header = true;
                        self.one_key(v.as_bytes(), &mut from_key)
                    }),
                KeyPart::Query(name) => query.map_or(Ok(()), |q| {
                    query_values(q, name).try_for_each(|v| {
                        presented.key_query = true;
                        self.one_key(&v, &mut from_key)
                    })
                }),
                _ => Ok(()),
            };
            if let Err(why) = checked {
                return Outcome::Invalid(why);
            }
        }
        let mut from_token: Option<Identity> = None;
        for token in headers
            .get_all(http::header::AUTHORIZATION)
            .iter()
            .filter_map(bearer_token)
        {
            presented.bearer = true;
            let identity = match self.by_token(token) {
                Ok(identity) => identity,
                Err(Failure::Invalid(why)) => return Outcome::Invalid(why),
                Err(Failure::Unavailable(why)) => return Outcome::Unavailable(why),
            };
            match &from_token {
                None => from_token = Some(identity),
                Some(first) if first.consumer != identity.consumer => {
                    return Outcome::Invalid("two bearer tokens name different consumers".into())
                }
                Some(_) => {}
            }
        }
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

    /// One presented API key: valid, and the same consumer as the keys before it.
    fn one_key(&self, key: &[u8], so_far: &mut Option<Named>) -> Result<(), String> {
        let Some(named) = self.by_key(key) else {
            return Err("unknown API key".into());
        };
        match so_far {
            None => *so_far = Some(named),
            Some(first) if first.name != named.name => {
                return Err("two API keys name different consumers".into())
            }
            Some(_) => {}
        }
        Ok(())
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
        let keys = self.keys_generation();
        if let Some(identity) = self.cache.get(&digest, now_s, keys) {
            return self.token_consumer(identity);
        }
        let verified = jwt::verify(token, &self.issuers)?;
        // The plan of the token's own claim; a `match` issuer's gets its consumer's below.
        let identity = Identity {
            consumer: Some(verified.consumer.as_str().into()),
            plan: verified.plan.map(Arc::<str>::from),
            claims: Some(Arc::new(verified.claims)),
        };
        self.cache
            .insert(digest, identity.clone(), verified.exp, now_s, keys);
        self.token_consumer(identity)
    }

    /// A verified token's consumer against the consumers of API keys (DESIGN §17), on
    /// every request, remembered tokens too, as those consumers come and go: a `separate`
    /// issuer's token may not name one, a `match` issuer's must, and is then that consumer
    /// with its plan.
    fn token_consumer(&self, mut identity: Identity) -> Result<Identity, Failure> {
        let iss = identity
            .claims
            .as_deref()
            .and_then(|c| c.get("iss"))
            .and_then(Value::as_str);
        let Some(issuer) = self.issuers.iter().find(|i| Some(&*i.config.issuer) == iss) else {
            return Err(Failure::Invalid("unknown issuer".into()));
        };
        let name = identity.consumer.as_deref().unwrap_or_default();
        let holder = self
            .directory
            .by_name(name)
            .cloned()
            .or_else(|| self.runtime.named(name));
        // Every refusal names the consumer looked up: a claim was checked to be one that
        // may be shown (no control character, at most 128 bytes).
        match (issuer.config.consumers, holder) {
            (JwtConsumers::Separate, None) => Ok(identity),
            (JwtConsumers::Separate, Some(_)) => Err(Failure::Invalid(format!(
                "the token names {name:?}, a consumer of API keys, and its issuer does not say consumers = \"match\""
            ))),
            (JwtConsumers::Match, None) => Err(Failure::Invalid(format!(
                "the token names {name:?}, which is no consumer of API keys (its issuer says consumers = \"match\")"
            ))),
            (JwtConsumers::Match, Some(named)) => {
                identity.consumer = Some(named.name);
                identity.plan = named.plan;
                Ok(identity)
            }
        }
    }
}

/// The token of one `Authorization: Bearer <token>` (the scheme is case-insensitive, and
/// any run of spaces or tabs may follow it, as lenient upstreams read it: DESIGN §21);
/// None for another scheme, which is not sluice's to check.
fn bearer_token(value: &HeaderValue) -> Option<&str> {
    const BLANK: [char; 2] = [' ', '\t'];
    let (scheme, token) = value.to_str().ok()?.split_once(BLANK)?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim_matches(BLANK))
        .filter(|t| !t.is_empty())
}

/// Every value of query parameter `name`, its name and value percent-decoded.
fn query_values<'a>(query: &'a str, name: &'a str) -> impl Iterator<Item = Vec<u8>> + 'a {
    query.split('&').filter_map(move |pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        is_param(k, name).then(|| percent_encoding::percent_decode_str(v).collect())
    })
}

/// Whether a query parameter's name as sent is `name` once percent-decoded, as PHP and Rack
/// read names too (DESIGN §21): `.`, ` ` (or `+`) and `[` taken as `_`, so `api.key` is
/// `api_key`.
fn is_param(sent: &str, name: &str) -> bool {
    let fold = |b: u8| match b {
        b'.' | b' ' | b'+' | b'[' => b'_',
        b => b,
    };
    let name = name.bytes().map(fold);
    if !sent.contains('%') {
        return sent.bytes().map(fold).eq(name);
    }
    percent_encoding::percent_decode_str(sent)
        .map(fold)
        .eq(name)
}

/// `query` without any parameter of the `query:` sources of `api_key`, whatever their
/// names' percent-encoding (`hide_credentials`); None when nothing is left.
pub fn query_without_keys(query: &str, sources: &[KeyPart]) -> Option<String> {
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| {
            let k = pair.split_once('=').map_or(*pair, |(k, _)| k);
            !sources
                .iter()
                .any(|s| matches!(s, KeyPart::Query(name) if is_param(k, name)))
        })
        .collect();
    (!kept.is_empty()).then(|| kept.join("&"))
}

/// A header name as CGI, WSGI, Rack and PHP servers read it (DESIGN §17): ASCII case
/// ignored and `_` taken as `-`, so `X_Consumer` is `x-consumer`.
pub fn fold_header_byte(b: u8) -> u8 {
    match b {
        b'_' => b'-',
        _ => b.to_ascii_lowercase(),
    }
}

/// Whether two header names are one once folded (`fold_header_byte`); no allocation.
pub fn same_header_name(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .all(|(x, y)| fold_header_byte(x) == fold_header_byte(y))
}

/// Whether some header's name holds `_`: only then can a name other than the exact one
/// fold onto it (a `HeaderMap`'s names are already lower case).
fn has_underscore(headers: &HeaderMap) -> bool {
    headers.keys().any(|k| underscored(k.as_str()))
}

/// Whether `name` holds `_`. This runs for every header of every request, on names
/// mostly under 20 bytes, which `contains` searches byte by byte (its word-wise search
/// starts at 16): eight bytes at a time instead, the last eight overlapping the ones
/// before (`w` has a zero byte where `name` has `_`; the classic test for a zero byte).
fn underscored(name: &str) -> bool {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGHS: u64 = u64::from_ne_bytes([0x80; 8]);
    const UNDERSCORES: u64 = u64::from_ne_bytes([b'_'; 8]);
    let bytes = name.as_bytes();
    if bytes.len() < 8 {
        return bytes.contains(&b'_');
    }
    let has = |at: usize| {
        let w = bytes
            .get(at..at + 8)
            .and_then(|s| s.try_into().ok())
            .map_or(0, u64::from_ne_bytes)
            ^ UNDERSCORES;
        w.wrapping_sub(ONES) & !w & HIGHS != 0
    };
    (0..bytes.len() - 8).step_by(8).any(has) || has(bytes.len() - 8)
}

/// Every value of header `name` in any spelling: a lookup when neither `name` nor any
/// header's name holds `_` (`any_underscored`: `has_underscore`), else a scan of all
/// headers.
fn header_values<'a>(
    headers: &'a HeaderMap,
    name: &'a str,
    any_underscored: bool,
) -> impl Iterator<Item = &'a HeaderValue> + 'a {
    let (exact, scan) = if any_underscored || underscored(name) {
        let scan = headers
            .iter()
            .filter(move |(k, _)| same_header_name(k.as_str(), name))
            .map(|(_, v)| v);
        (None, Some(scan))
    } else {
        (Some(headers.get_all(name).iter()), None)
    };
    exact
        .into_iter()
        .flatten()
        .chain(scan.into_iter().flatten())
}

/// The names of `headers` that fold onto one of `names`, when some name (theirs or one of
/// `names`) holds `_`: the spellings a removal by name misses, which must go too before
/// the request is sent upstream. Empty, without allocating, when no name holds `_`.
pub fn other_spellings<'a>(
    headers: &HeaderMap,
    names: impl Iterator<Item = &'a str> + Clone,
) -> Vec<HeaderName> {
    if !has_underscore(headers) && !names.clone().any(underscored) {
        return Vec::new();
    }
    headers
        .keys()
        .filter(|k| names.clone().any(|n| same_header_name(k.as_str(), n)))
        .cloned()
        .collect()
}

/// The identity headers of `[auth]` (`consumer_header`, `plan_header`, `strip_headers`):
/// never taken from the client, in any spelling.
pub fn identity_header_names(settings: &config::Auth) -> impl Iterator<Item = &str> + Clone {
    [&settings.consumer_header, &settings.plan_header]
        .into_iter()
        .chain(&settings.strip_headers)
        .map(HeaderName::as_str)
}

/// The `header:` sources of `[auth] api_key`.
pub fn key_header_names(settings: &config::Auth) -> impl Iterator<Item = &str> + Clone {
    settings.api_key.iter().filter_map(|s| match s {
        KeyPart::Header(name) => Some(name.as_str()),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens_and_query_keys_are_read_as_sent() {
        let bearer =
            |v: &'static str| bearer_token(&HeaderValue::from_static(v)).map(str::to_owned);
        assert_eq!(bearer("bearer abc.def.ghi").as_deref(), Some("abc.def.ghi"));
        assert_eq!(bearer("Basic dXNlcjpwYXNz"), None);
        assert_eq!(bearer("Bearer  "), None);
        assert_eq!(bearer("Bearer\tabc").as_deref(), Some("abc"));
        assert_eq!(bearer("bearer \t \tabc\t").as_deref(), Some("abc"));
        assert_eq!(bearer("Bearer\t\t"), None);
        assert_eq!(bearer("Basic\tabc"), None);
        let values = |q, name| query_values(q, name).collect::<Vec<_>>();
        assert_eq!(
            values("a=1&api_key=sk%5F1&b", "api_key"),
            [b"sk_1".to_vec()]
        );
        assert_eq!(
            values(
                "api%5Fkey=1&api_key=2&api%5fkey=3&apikey=4&api_key",
                "api_key"
            ),
            [b"1".to_vec(), b"2".to_vec(), b"3".to_vec(), Vec::new()]
        );
        assert!(values("a=1", "api_key").is_empty());
        assert_eq!(
            values(
                "api.key=1&api+key=2&api%20key=3&api[key=4&api%2Ekey=5&apiXkey=6",
                "api_key"
            ),
            [
                b"1".to_vec(),
                b"2".to_vec(),
                b"3".to_vec(),
                b"4".to_vec(),
                b"5".to_vec()
            ]
        );
        let sources = [
            KeyPart::Query("api_key".into()),
            KeyPart::Header("api_key".into()),
        ];
        assert_eq!(
            query_without_keys("a=1&api_key=x&b&api%5Fkey=y&c=%5F", &sources).as_deref(),
            Some("a=1&b&c=%5F")
        );
        assert_eq!(query_without_keys("api_key=x&api%5fkey", &sources), None);
        assert_eq!(
            query_without_keys("api.key=x&a=1&api[key=y", &sources).as_deref(),
            Some("a=1")
        );
    }

    /// Every spelling of a header is found, by lookup when no name holds `_` and by a scan
    /// otherwise; a name that only resembles it is not.
    #[test]
    fn headers_are_found_in_every_spelling() {
        let mut h = HeaderMap::new();
        h.append("x-api-key", HeaderValue::from_static("1"));
        h.append("x-api-key", HeaderValue::from_static("2"));
        let found = |h: &HeaderMap, name| {
            header_values(h, name, has_underscore(h))
                .map(|v| v.to_str().unwrap_or("?").to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(found(&h, "x-api-key"), ["1", "2"]);
        assert_eq!(found(&h, "x_api_key"), ["1", "2"]);
        assert!(other_spellings(&h, ["x-consumer"].into_iter()).is_empty());
        h.append("x_api_key", HeaderValue::from_static("3"));
        h.append("x-api_key", HeaderValue::from_static("4"));
        h.append("x-apikey", HeaderValue::from_static("5"));
        h.append("x__api-key", HeaderValue::from_static("6"));
        assert_eq!(found(&h, "x-api-key"), ["1", "2", "3", "4"]);
        let mut names: Vec<String> = other_spellings(&h, ["x-api-key"].into_iter())
            .iter()
            .map(|n| n.as_str().to_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["x-api-key", "x-api_key", "x_api_key"]);
    }

    /// The name folded byte by byte: only ASCII bytes change, so it stays UTF-8.
    fn folded(name: &str) -> String {
        String::from_utf8(name.bytes().map(fold_header_byte).collect()).expect("UTF-8")
    }

    /// Whether `a` and `b` differ only in ASCII case and `_`/`-`, position by position.
    fn differ_only_in_case_and_dashes(a: &str, b: &str) -> bool {
        let dash = |c: u8| c == b'_' || c == b'-';
        a.len() == b.len()
            && a.bytes()
                .zip(b.bytes())
                .all(|(x, y)| x.eq_ignore_ascii_case(&y) || (dash(x) && dash(y)))
    }

    proptest::proptest! {
        /// Folding (DESIGN §17) is idempotent, ignores ASCII case, takes `_` as `-`, and two
        /// names fold alike exactly when they differ only in case and `_`/`-`.
        #[test]
        fn header_name_folding(
            a in "[a-cA-C_\\-]{0,6}",
            b in "[a-cA-C_\\-]{0,6}",
            any in "\\PC{0,12}",
        ) {
            for name in [&a, &b, &any] {
                proptest::prop_assert_eq!(folded(&folded(name)), folded(name));
                proptest::prop_assert!(same_header_name(name, &name.to_ascii_uppercase()));
                proptest::prop_assert!(same_header_name(name, &name.to_ascii_lowercase()));
                proptest::prop_assert!(same_header_name(name, &name.replace('_', "-")));
                proptest::prop_assert!(same_header_name(name, &name.replace('-', "_")));
                proptest::prop_assert!(same_header_name(name, &folded(name)));
            }
            for name in [&a, &b, &any, &format!("{a}{any}{b}{a}")] {
                proptest::prop_assert_eq!(underscored(name), name.contains('_'));
            }
            for (x, y) in [(&a, &b), (&a, &any), (&any, &b)] {
                let same = same_header_name(x, y);
                proptest::prop_assert_eq!(same, folded(x) == folded(y));
                proptest::prop_assert_eq!(same, differ_only_in_case_and_dashes(x, y), "{:?} {:?}", x, y);
            }
        }
    }
}

//! The validated configuration model: every other module reads this, never raw TOML.
//!
//! `load` parses a file, checks all of it, and returns either a `Config` or every
//! problem found, each located at FILE:LINE:COL.

mod auth;
mod certs;
mod edge;
mod metering;
mod rls;
mod tree;
mod validate;
pub use validate::parse_duration;

use std::fmt;
use std::net::SocketAddr;
use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use regex::Regex;
use rustls::pki_types::CertificateDer;
use rustls::sign::CertifiedKey;

#[derive(Debug, Clone)]
pub struct Config {
    pub server: Server,
    pub admin: Admin,
    pub limiter: Limiter,
    pub upstreams: Vec<Upstream>,
    pub policies: Vec<Policy>,
    pub routes: Vec<Route>,
    pub tls: Tls,
    /// Read and checked from their files; the first is the default (DESIGN §8).
    pub certificates: Vec<Certificate>,
    /// `[auth]` and `[[auth.jwt]]` (DESIGN §11).
    pub auth: Auth,
    /// `[[consumers]]` of the config and its `consumer_files`, in file order.
    pub consumers: Vec<Consumer>,
    /// Problems that do not stop sluice (a certificate about to expire), located like errors.
    pub warnings: Vec<ConfigError>,
    /// `[rls]`: Envoy's rate limit service (DESIGN §13).
    pub rls: Option<Rls>,
}

impl Config {
    /// The routes HTTP requests are matched against: all but the `[rls]` domains' routes.
    pub fn proxy_routes(&self) -> &[Route] {
        let end = self
            .rls
            .as_ref()
            .map_or(self.routes.len(), |r| r.first_route);
        &self.routes[..end]
    }
}

/// `[rls]`: the listener and the domains of its YAML files. Each limited rule is a policy
/// (`Limit::policy`), and domain `i` is counted as route `first_route + i` (`rls:<domain>`).
#[derive(Debug, Clone)]
pub struct Rls {
    pub listen: SocketAddr,
    pub domains: Vec<crate::rls::rules::Domain>,
    pub first_route: usize,
}

#[derive(Debug, Clone)]
pub struct Server {
    /// Plain HTTP listeners; may be empty when `tls_listen` is not.
    pub listen: Vec<SocketAddr>,
    /// HTTPS listeners.
    pub tls_listen: Vec<SocketAddr>,
    pub threads: usize,
    pub grace_period: Duration,
    pub trusted_proxies: Vec<IpNet>,
    /// Lower-case header name.
    pub client_ip_header: String,
    pub access_log: AccessLog,
    pub headers: HeaderStyle,
    /// The whole request header must arrive within this (else 408 and close).
    pub header_timeout: Duration,
    /// Longest pause between two reads of a request body (else 408 and close).
    pub body_timeout: Duration,
    /// A keep-alive connection waiting for its next request is closed after this.
    pub idle_timeout: Duration,
    /// Bytes; 0 = unlimited. Routes may override it.
    pub max_request_body: u64,
    /// Open client connections one address may hold; 0 = unlimited.
    pub max_connections_per_ip: u32,
    /// Cleartext listeners also accept prior-knowledge HTTP/2 (read at start-up).
    pub h2c: bool,
    /// `request_id`: the header carrying each request's id (DESIGN §14); None = off.
    pub request_id: Option<http::HeaderName>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccessLog {
    Json,
    Text,
    Off,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderStyle {
    Ietf,
    Legacy,
    Off,
}

/// `[tls]`: settings shared by every `tls_listen` listener.
#[derive(Debug, Clone, PartialEq)]
pub struct Tls {
    pub min_version: TlsVersion,
    pub client_auth: ClientAuth,
    /// The CA certificates from `client_ca` (empty when it is not given).
    pub client_ca: Vec<CertificateDer<'static>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum TlsVersion {
    V1_2,
    V1_3,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    Off,
    Optional,
    Require,
}

/// One `[[certificates]]` entry, read from its files when the config was loaded.
#[derive(Debug, Clone)]
pub struct Certificate {
    /// SNI names: exact names, or `*.example.com` as `Suffix(".example.com")`.
    pub hosts: Vec<HostMatch>,
    /// The first entry of `hosts` as written: the `certificate` metric label.
    pub name: String,
    /// The chain (leaf first) with its private key, checked to match.
    pub key: Arc<CertifiedKey>,
    /// The leaf's notAfter, in Unix seconds.
    pub not_after: i64,
}

#[derive(Debug, Clone)]
pub struct Admin {
    pub listen: SocketAddr,
    /// The bearer token of the `/v1/` API, read from `token_file` at load (None: no file,
    /// every `/v1/` call answers 403).
    pub token: Option<Token>,
    /// Heavy-hitter slots per policy for `/v1/top` (0: off).
    pub top_keys: usize,
}

/// A secret that never shows in `Debug` output or logs.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(pub String);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(..)")
    }
}

impl Admin {
    pub const DEFAULT_TOP_KEYS: usize = 1000;
}

#[derive(Debug, Clone, PartialEq)]
pub struct Limiter {
    pub backend: Backend,
    pub timeout: Duration,
    pub key_prefix: String,
    pub clock: ClockSource,
    pub on_error: OnError,
    pub deny_cache: usize,
    pub max_keys: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    Memory,
    Redis(String),
    Cluster(Vec<String>),
    Sentinel { master: String, nodes: Vec<String> },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClockSource {
    Redis,
    Local,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnError {
    Allow,
    Deny,
    Local,
}

#[derive(Debug, Clone)]
pub struct Upstream {
    pub name: String,
    pub servers: Vec<String>,
    pub balance: Balance,
    pub tls: bool,
    pub sni: String,
    pub connect_timeout: Duration,
    pub read_timeout: Duration,
    /// Active checks; `None`: servers are only judged by the requests they serve.
    pub health_check: Option<HealthCheck>,
    /// Passive checks (nginx's names): this many consecutive connect errors or timeouts
    /// take a server out for `fail_timeout`.
    pub max_fails: u32,
    pub fail_timeout: Duration,
    pub protocol: UpstreamProtocol,
}

/// What an upstream speaks: HTTP/2 is over TLS with ALPN, or prior-knowledge h2c without.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamProtocol {
    Http1,
    H2,
}

/// `health_check = { interval, path, timeout }` of an upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheck {
    pub interval: Duration,
    /// `Some`: an HTTP GET of this path, healthy on 2xx/3xx; `None`: a TCP connect.
    pub path: Option<String>,
    /// The whole check (connect, request, response header and body) must end within this.
    pub timeout: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Balance {
    RoundRobin,
    Random,
    Hash,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    FixedWindow,
    SlidingWindow,
    SlidingLog,
    TokenBucket,
    Gcra,
    LeakyBucket,
    Concurrency,
}

impl Algorithm {
    pub const ALL: [Algorithm; 7] = [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::SlidingLog,
        Algorithm::TokenBucket,
        Algorithm::Gcra,
        Algorithm::LeakyBucket,
        Algorithm::Concurrency,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::SlidingLog => "sliding_log",
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::Gcra => "gcra",
            Algorithm::LeakyBucket => "leaky_bucket",
            Algorithm::Concurrency => "concurrency",
        }
    }
}

/// One part of a policy key (DESIGN §2.1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPart {
    ClientIp,
    ClientNet(u8),
    Header(String),
    Query(String),
    Cookie(String),
    Path,
    Method,
    Host,
    Route,
    /// Lower-case hex SHA-256 of the client's leaf certificate (DER), with mutual TLS only.
    ClientCert,
    /// The verified consumer's name (DESIGN §11); absent for anonymous requests.
    Consumer,
    /// The verified consumer's plan; `anonymous` without a consumer.
    Plan,
    /// A string or integer claim of the verified token.
    Claim(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Enforce,
    Shadow,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnMissing {
    Skip,
    Deny,
    Shared,
    /// The absent parts are replaced by the client IP (anonymous clients per address).
    ClientIp,
}

#[derive(Debug, Clone)]
pub struct Policy {
    pub name: String,
    pub algorithm: Algorithm,
    pub limit: NonZeroU64,
    pub period: Duration,
    pub burst: NonZeroU64,
    pub key: Vec<KeyPart>,
    pub cost: u64,
    pub mode: Mode,
    /// `Some(max_delay)` when `on_exceed = "delay"`.
    pub delay: Option<Duration>,
    pub status: u16,
    pub on_missing: OnMissing,
    pub exempt: Vec<IpNet>,
    pub on_error: Option<OnError>,
    pub lease: Duration,
    /// `[[policies.NAME.overrides]]`, in order: the first that matches a request wins.
    pub overrides: Vec<Override>,
    /// Once this policy rejects a key, the key is rejected for this long; zero = never.
    pub ban: Duration,
    /// `count` or `cost = { … }`: the charge made at admission (`cost`, which then holds
    /// the `reserve`) is settled when the response is known (DESIGN §12).
    pub metering: Option<Metering>,
    /// `reserve = "request"`: the request's own upper bound is held, this much
    /// (`max_reserve`, also `cost`) when its body gives none.
    pub reserve_request: Option<u64>,
}

/// How a policy's charge is settled from the response (DESIGN §12).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Metering {
    /// `count = { status = [...] }`: the charge stands when the status is listed, else
    /// it is refunded.
    Status(Vec<StatusRange>),
    /// `cost = { header = NAME }`: the response's integer header is the cost.
    Header(http::HeaderName),
    /// `cost = { usage = FORMAT }`: the tokens the response's body reports.
    Usage(UsageFormat),
}

/// Statuses `low..=high`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusRange {
    pub low: u16,
    pub high: u16,
}

impl Metering {
    /// `count`: whether a response with `status` keeps its charge.
    pub fn counts(&self, status: u16) -> bool {
        match self {
            Metering::Status(ranges) => ranges.iter().any(|r| (r.low..=r.high).contains(&status)),
            _ => true,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageFormat {
    OpenAi,
    Anthropic,
    Gemini,
}

/// `reserve`: units held at admission for a response's cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reserve {
    Units(u64),
    /// `"request"`: the request's own upper bound, at most `most` (`max_reserve`).
    Request {
        most: u64,
    },
}

/// The numbers a policy counts with: its own, an override's, or (later) a runtime
/// override's. Backends never see where they came from (DESIGN §9.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Numbers {
    pub limit: NonZeroU64,
    pub period: Duration,
    pub burst: NonZeroU64,
}

/// One `[[policies.NAME.overrides]]` entry: when every condition holds, the policy counts
/// with `numbers` (already completed from the policy: an override that sets `limit` but
/// not `burst` gets the policy's written `burst`, else its own `limit`, as a policy does).
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    pub when: Vec<Condition>,
    pub numbers: Numbers,
}

/// One `when` entry: a key part and the values it may take.
#[derive(Debug, Clone, PartialEq)]
pub struct Condition {
    pub part: KeyPart,
    pub values: Values,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Values {
    /// Exact, case-sensitive values (headers, query parameters, cookies, path, route, ...).
    Exact(Vec<String>),
    /// `host` and `method`: compared ignoring ASCII case; stored lower-case.
    Caseless(Vec<String>),
    /// `client_ip` and `client_ip/N`: the address (or its /N network) lies in one of these.
    Nets(Vec<IpNet>),
}

impl Policy {
    /// The policy's own numbers (no override).
    pub fn numbers(&self) -> Numbers {
        Numbers {
            limit: self.limit,
            period: self.period,
            burst: self.burst,
        }
    }

    /// The decisions this policy's settings can produce on `backend` (DESIGN §16): only
    /// their series are primed at 0, so a config's metrics grow with what can move.
    pub fn possible_decisions(
        &self,
        backend: &Backend,
        default_on_error: OnError,
    ) -> Vec<&'static str> {
        let enforce = self.mode == Mode::Enforce;
        let mut out = vec![
            "allowed",
            if enforce {
                "rejected"
            } else {
                "shadow_rejected"
            },
        ];
        if self.delay.is_some() || self.algorithm == Algorithm::LeakyBucket {
            out.push("delayed");
        }
        let can_miss = self.key.iter().any(|p| {
            matches!(
                p,
                KeyPart::Header(_)
                    | KeyPart::Query(_)
                    | KeyPart::Cookie(_)
                    | KeyPart::ClientCert
                    | KeyPart::Consumer
                    | KeyPart::Plan
                    | KeyPart::Claim(_)
            )
        });
        if can_miss && self.on_missing == OnMissing::Skip {
            out.push("skipped");
        }
        if !self.exempt.is_empty() {
            out.push("exempt");
        }
        if *backend != Backend::Memory {
            match self.on_error.unwrap_or(default_on_error) {
                OnError::Allow => out.push("error_allowed"),
                OnError::Deny => out.push("error_denied"),
                OnError::Local => {}
            }
        }
        if enforce && !self.ban.is_zero() {
            out.push("banned");
        }
        out
    }

    /// Whether two versions of a policy count the same way (so cached denials stay true).
    pub fn same_rule(&self, other: &Policy) -> bool {
        self.algorithm == other.algorithm
            && self.limit == other.limit
            && self.period == other.period
            && self.burst == other.burst
            && self.key == other.key
            && self.cost == other.cost
            && self.overrides == other.overrides
            && self.ban == other.ban
            && self.metering == other.metering
    }
}

#[derive(Debug, Clone)]
pub struct Route {
    pub name: String,
    pub hosts: Vec<HostMatch>,
    pub path: PathMatch,
    /// Empty means every method.
    pub methods: Vec<String>,
    pub target: Target,
    /// Indexes into `Config::policies`.
    pub policies: Vec<usize>,
    /// Overrides `[server] max_request_body` for this route (0 = unlimited).
    pub max_request_body: Option<u64>,
    pub auth: AuthMode,
    /// `metrics_as`: the `route` label this route is counted under (DESIGN §16).
    pub metrics_as: Option<String>,
    /// `scheme`: only requests that arrived over this scheme match (DESIGN §14).
    pub scheme: Option<Scheme>,
    /// `strip_prefix`: the upstream gets the path without the route's `path_prefix`.
    pub strip_prefix: bool,
    /// Header rules for the upstream request, and for every response of the route.
    pub request_headers: HeaderRules,
    pub response_headers: HeaderRules,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    Http,
    Https,
}

/// `{ set = { NAME = VALUE }, remove = [NAME] }`: removals first, then sets.
#[derive(Debug, Clone, Default)]
pub struct HeaderRules {
    pub set: Vec<(http::HeaderName, http::HeaderValue)>,
    pub remove: Vec<http::HeaderName>,
}

impl HeaderRules {
    pub fn is_empty(&self) -> bool {
        self.set.is_empty() && self.remove.is_empty()
    }
}

/// Where a `redirect` route sends the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedirectTo {
    /// The same host, path and query, over this scheme.
    Scheme(Scheme),
    /// A fixed location.
    Location(String),
}

impl Route {
    /// The `route` label of this route's metrics: its `metrics_as`, else its name.
    pub fn label(&self) -> &str {
        self.metrics_as.as_deref().unwrap_or(&self.name)
    }
}

/// A route's `auth` (DESIGN §11).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthMode {
    /// Credentials are not checked; every request is anonymous.
    Off,
    /// No credential: anonymous; an invalid one: 401.
    Optional,
    /// No credential or an invalid one: 401.
    Required,
}

/// `[auth]`: where credentials come from and what the upstream is told.
#[derive(Debug, Clone)]
pub struct Auth {
    /// `header:NAME` / `query:NAME` sources of an API key, tried in order.
    pub api_key: Vec<KeyPart>,
    /// Parsed once: set on every authenticated request.
    pub consumer_header: http::HeaderName,
    pub plan_header: http::HeaderName,
    pub strip_headers: Vec<http::HeaderName>,
    pub hide_credentials: bool,
    pub max_failures: Option<MaxFailures>,
    pub jwt: Vec<JwtIssuer>,
}

impl Default for Auth {
    fn default() -> Self {
        Auth {
            api_key: vec![KeyPart::Header("x-api-key".into())],
            consumer_header: http::HeaderName::from_static("x-consumer"),
            plan_header: http::HeaderName::from_static("x-consumer-plan"),
            strip_headers: Vec::new(),
            hide_credentials: false,
            max_failures: None,
            jwt: Vec::new(),
        }
    }
}

/// `max_failures`: an address that presents `limit` invalid credentials within `period`
/// is refused for `ban`. Counted by the policy `AUTH_FAILURES`, appended to the policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxFailures {
    pub limit: NonZeroU64,
    pub period: Duration,
    pub ban: Duration,
}

/// The policy that counts invalid credentials per address (`max_failures`): visible in the
/// admin API, so an operator can read and reset an address's ban.
pub const AUTH_FAILURES: &str = "auth_failures";

/// The plan of a request without a verified consumer; no consumer may have it.
pub const ANONYMOUS: &str = "anonymous";

/// One `[[consumers]]` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Consumer {
    pub name: String,
    pub plan: Option<String>,
    /// SHA-256 digests of its API keys.
    pub keys: Vec<[u8; 32]>,
}

/// One `[[auth.jwt]]` issuer.
#[derive(Debug, Clone)]
pub struct JwtIssuer {
    pub issuer: String,
    pub audiences: Vec<String>,
    pub algorithms: Vec<jsonwebtoken::Algorithm>,
    pub keys: JwtKeys,
    pub jwks_refresh: Duration,
    pub unknown_kid_refetch: Duration,
    pub leeway: Duration,
    pub consumer_claim: String,
    pub plan_claim: Option<String>,
}

/// Where an issuer's verification keys come from.
#[derive(Debug, Clone)]
pub enum JwtKeys {
    /// `jwks_file`, read and checked at load (and on every reload).
    Jwks(crate::auth::jwks::KeySet),
    /// `jwks_url`, fetched by the running process.
    Url(String),
    /// `secret_file`'s bytes (HMAC).
    Secret(Vec<u8>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostMatch {
    /// Lower-case host name.
    Exact(String),
    /// `*.example.org`, stored as `.example.org`.
    Suffix(String),
}

#[derive(Debug, Clone)]
pub enum PathMatch {
    Any,
    Exact(String),
    Prefix(String),
    Regex(Regex),
}

#[derive(Debug, Clone)]
pub enum Target {
    /// Index into `Config::upstreams`.
    Upstream(usize),
    Respond {
        status: u16,
        body: String,
        content_type: String,
    },
    Redirect {
        to: RedirectTo,
        status: u16,
    },
}

/// One problem in a config file, already located.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: String,
    pub line: usize,
    pub col: usize,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}",
            self.file, self.line, self.col, self.message
        )
    }
}

/// Every problem found in a config file, in file order.
#[derive(Debug, Clone, thiserror::Error)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let lines: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        f.write_str(&lines.join("\n"))
    }
}

/// Reads and validates the config at `path`; errors name the file as given.
pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
    let file = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => parse(&file, &text),
        Err(e) => Err(ConfigErrors(vec![ConfigError {
            file,
            line: 1,
            col: 1,
            message: format!("cannot read config: {e}"),
        }])),
    }
}

/// Validates config text from `file`: it names the file in messages, and relative paths in
/// the config (certificates, keys, CAs) are read from its directory, as nginx does.
pub fn parse(file: &str, text: &str) -> Result<Config, ConfigErrors> {
    let located = |problems| ConfigErrors(located_in(file, text, problems));
    let root = tree::parse(text).map_err(|problem| located(vec![problem]))?;
    let dir = Path::new(file)
        .parent()
        .map(PathBuf::from)
        .unwrap_or_default();
    let (mut config, warnings) =
        validate::config(&root, &dir).map_err(|(problems, elsewhere)| {
            let mut errors = located(problems);
            errors.0.extend(elsewhere);
            errors
        })?;
    config.warnings = located(warnings).0;
    Ok(config)
}

/// Locates byte-offset problems of `file` (the config, or a file it names), in file order.
fn located_in(file: &str, text: &str, problems: Vec<(usize, String)>) -> Vec<ConfigError> {
    let mut errors: Vec<ConfigError> = problems
        .into_iter()
        .map(|(at, message)| {
            let (line, col) = line_col(text, at);
            ConfigError {
                file: file.to_owned(),
                line,
                col,
                message,
            }
        })
        .collect();
    errors.sort_by_key(|e| (e.line, e.col));
    errors.dedup();
    errors
}

/// 1-based line and column (in characters) of a byte offset.
fn line_col(text: &str, at: usize) -> (usize, usize) {
    let at = at.min(text.len());
    let before = text.get(..at).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let col = before[line_start..].chars().count() + 1;
    (line, col)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_are_completed_from_their_policy() {
        let text = r#"
[server]
listen = ["127.0.0.1:8080"]
[policies.plain]
algorithm = "gcra"
limit = 3
period = "1m"
key = ["client_ip"]
ban = "30s"
[[policies.plain.overrides]]
when = { "header:X-Plan" = "gold", "host" = ["API.example.com"] }
limit = 10
[[policies.plain.overrides]]
when = { "client_ip/24" = ["10.0.0.0/8", "2001:db8::/32"] }
period = "1s"
burst = 7
[policies.written]
algorithm = "token_bucket"
limit = 3
burst = 5
period = "1m"
key = []
[[policies.written.overrides]]
when = { "method" = "post" }
limit = 100
[[routes]]
name = "r"
respond = { status = 200 }
policies = ["plain", "written"]
"#;
        let config = parse("t.toml", text).expect("valid config");
        let plain = &config.policies[0];
        assert_eq!(plain.ban, Duration::from_secs(30));
        let n = |o: &Override| {
            (
                o.numbers.limit.get(),
                o.numbers.period,
                o.numbers.burst.get(),
            )
        };
        // No burst written anywhere: the override's limit is its burst, as for a policy.
        assert_eq!(n(&plain.overrides[0]), (10, Duration::from_secs(60), 10));
        assert_eq!(n(&plain.overrides[1]), (3, Duration::from_secs(1), 7));
        assert_eq!(
            plain.overrides[0].when,
            [
                Condition {
                    part: KeyPart::Header("x-plan".into()),
                    values: Values::Exact(vec!["gold".into()]),
                },
                Condition {
                    part: KeyPart::Host,
                    values: Values::Caseless(vec!["api.example.com".into()]),
                },
            ]
        );
        // The policy's written burst is inherited.
        assert_eq!(
            n(&config.policies[1].overrides[0]),
            (100, Duration::from_secs(60), 5)
        );
        assert_eq!(config.policies[1].ban, Duration::ZERO);
    }

    #[test]
    fn line_col_counts_from_one() {
        let text = "a = 1\nbé = 2\n";
        assert_eq!(line_col(text, 0), (1, 1));
        assert_eq!(line_col(text, 6), (2, 1));
        assert_eq!(line_col(text, text.find('=').unwrap_or(0)), (1, 3));
        assert_eq!(line_col(text, 10), (2, 4));
    }
}

//! `[auth]`, `[[auth.jwt]]`, `[[consumers]]` and `consumer_files` (DESIGN §11): their types
//! and readers, with every problem located (a consumer file's in its own file).

use std::collections::HashSet;
use std::num::NonZeroU64;
use std::path::Path;
use std::time::Duration;

use super::jwks::KeySet;
use super::limiter::OnError;
use super::policies::{key_part, Algorithm, KeyPart, Mode, OnMissing, Policy};
use super::read::{check_name, glob, header_name, located_in, Problems, Table};
use super::tree::{self, Node, Spanned};

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
    /// Put before the claim to make the token's consumer (DESIGN §17): with two or more
    /// issuers each has its own, none the start of another's.
    pub consumer_prefix: String,
    pub consumers: JwtConsumers,
}

/// `consumers`: whom an issuer's tokens may name (DESIGN §17).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JwtConsumers {
    /// Consumers of their own: a token naming a consumer of API keys is refused.
    Separate,
    /// Consumers of API keys only (config or runtime): the token is that consumer, with
    /// its plan.
    Match,
}

/// Where an issuer's verification keys come from.
#[derive(Debug, Clone)]
pub enum JwtKeys {
    /// `jwks_file`, read and checked at load (and on every reload).
    Jwks(KeySet),
    /// `jwks_url`, fetched by the running process.
    Url(String),
    /// `secret_file`'s bytes (HMAC).
    Secret(Vec<u8>),
}

/// Consumer names and key digests seen so far, across the config and its consumer files.
#[derive(Default)]
pub(super) struct Seen {
    names: HashSet<String>,
    digests: HashSet<[u8; 32]>,
}

pub(super) fn auth(p: &Problems, node: &Spanned<Node>, dir: &Path) -> Option<Auth> {
    let t = Table::new(p, "[auth]", node)?;
    let defaults = Auth::default();
    let api_key = match t.strings("api_key") {
        None => defaults.api_key,
        Some(list) => list
            .iter()
            .filter_map(|s| match key_part(p, s, "api_key") {
                Some(part @ (KeyPart::Header(_) | KeyPart::Query(_))) => Some(part),
                Some(_) => {
                    p.at(
                        &s.span,
                        format!(
                            "`api_key`: \"{}\" is not a header:NAME or query:NAME source",
                            s.value
                        ),
                    );
                    None
                }
                None => None,
            })
            .collect(),
    };
    // Read with the config by `consumer_files`, below; only its type is checked here.
    let _ = t.strings("consumer_files");
    let header = |key: &str, default: http::HeaderName| {
        t.string(key)
            .and_then(|s| header_name(p, &s, key))
            .unwrap_or(default)
    };
    let consumer_header = header("consumer_header", defaults.consumer_header);
    let plan_header = header("plan_header", defaults.plan_header);
    let strip_headers = t
        .strings("strip_headers")
        .unwrap_or_default()
        .iter()
        .filter_map(|s| header_name(p, s, "strip_headers"))
        .collect();
    let hide_credentials = t.bool("hide_credentials").unwrap_or(false);
    let max_failures = t.get("max_failures").and_then(|n| max_failures(p, n));
    let jwt = match t.get("jwt") {
        None => Vec::new(),
        Some(node) => match &node.value {
            Node::Array(items) => {
                let mut seen = HashSet::new();
                for item in items {
                    let named = match &item.value {
                        Node::Table(entries) => entries.iter().find(|(k, _)| k.value == "issuer"),
                        _ => None,
                    };
                    if let Some((
                        _,
                        Spanned {
                            value: Node::Str(name),
                            span,
                        },
                    )) = named
                    {
                        if !seen.insert(name.clone()) {
                            p.at(span, format!("duplicate issuer \"{name}\""));
                        }
                    }
                }
                distinct_prefixes(p, items);
                items.iter().filter_map(|i| issuer(p, i, dir)).collect()
            }
            other => {
                p.at(
                    &node.span,
                    format!(
                        "`jwt` must be an array of tables ([[auth.jwt]]), found {}",
                        other.kind()
                    ),
                );
                Vec::new()
            }
        },
    };
    t.finish();
    Some(Auth {
        api_key,
        consumer_header,
        plan_header,
        strip_headers,
        hide_credentials,
        max_failures,
        jwt,
    })
}

fn max_failures(p: &Problems, node: &Spanned<Node>) -> Option<MaxFailures> {
    let t = Table::new(p, "`max_failures`", node)?;
    let limit = t
        .required("limit")
        .and_then(|_| t.int("limit", 1..=1_000_000));
    let period = t
        .required("period")
        .map(|_| t.positive_duration("period", Duration::from_secs(60)));
    let ban = t
        .required("ban")
        .map(|_| t.positive_duration("ban", Duration::from_secs(60)));
    t.finish();
    Some(MaxFailures {
        limit: NonZeroU64::new(limit?.value as u64)?,
        period: period?,
        ban: ban?,
    })
}

/// The policy `max_failures` counts with: invalid credentials per address in fixed
/// windows, with a ban once the window is full.
pub(super) fn failures_policy(max: MaxFailures) -> Policy {
    Policy {
        name: AUTH_FAILURES.into(),
        algorithm: Algorithm::FixedWindow,
        limit: max.limit,
        period: max.period,
        burst: max.limit,
        key: vec![KeyPart::ClientIp],
        cost: 1,
        mode: Mode::Enforce,
        delay: None,
        status: 429,
        on_missing: OnMissing::Skip,
        exempt: Vec::new(),
        on_error: Some(OnError::Allow),
        lease: Duration::from_secs(60),
        overrides: Vec::new(),
        ban: max.ban,
        metering: None,
        reserve_request: None,
        prefetch: None,
        calendar: None,
        reject: None,
    }
}

const ALGORITHMS: &str =
    "RS256, RS384, RS512, PS256, PS384, PS512, ES256, ES384, EdDSA, HS256, HS384, HS512";

fn issuer(p: &Problems, node: &Spanned<Node>, dir: &Path) -> Option<JwtIssuer> {
    use jsonwebtoken::Algorithm as A;
    let t = Table::new(p, "[[auth.jwt]]", node)?;
    let issuer = t.required("issuer").and_then(|_| t.string("issuer"));
    if issuer.as_ref().is_some_and(|s| s.value.is_empty()) {
        p.at(&t.key_span("issuer"), "`issuer` must not be empty");
    }
    let audiences = t.required("audiences").and_then(|_| t.strings("audiences"));
    if audiences.as_ref().is_some_and(Vec::is_empty) {
        p.at(
            &t.key_span("audiences"),
            "`audiences` needs at least one audience",
        );
    }
    let algorithms: Vec<(Spanned<String>, A)> = t
        .required("algorithms")
        .and_then(|_| t.strings("algorithms"))
        .unwrap_or_default()
        .into_iter()
        .filter_map(|s| match s.value.parse::<A>() {
            Ok(a) => Some((s, a)),
            Err(_) => {
                let why = if s.value.eq_ignore_ascii_case("none") {
                    "unsigned tokens are never accepted"
                } else {
                    "unknown algorithm"
                };
                p.at(
                    &s.span,
                    format!(
                        "`algorithms`: \"{}\": {why} (expected {ALGORITHMS})",
                        s.value
                    ),
                );
                None
            }
        })
        .collect();
    if t.get("algorithms")
        .is_some_and(|n| matches!(&n.value, Node::Array(a) if a.is_empty()))
    {
        p.at(
            &t.key_span("algorithms"),
            "`algorithms` needs at least one algorithm",
        );
    }
    let hmac = |a: &A| matches!(a, A::HS256 | A::HS384 | A::HS512);
    let sources: Vec<&str> = ["jwks_file", "jwks_url", "secret_file"]
        .into_iter()
        .filter(|k| t.get(k).is_some())
        .collect();
    if sources.len() != 1 {
        let at = sources.get(1).map_or(t.span.clone(), |k| t.key_span(k));
        p.at(
            &at,
            "an issuer takes exactly one of `jwks_file`, `jwks_url` and `secret_file`",
        );
    }
    let allowed: Vec<A> = algorithms.iter().map(|(_, a)| *a).collect();
    let keys = match sources.first().copied() {
        Some("secret_file") => {
            for (s, _) in algorithms.iter().filter(|(_, a)| !hmac(a)) {
                p.at(&s.span, format!("`algorithms`: {} needs a public key (jwks_file or jwks_url), not `secret_file`", s.value));
            }
            t.string("secret_file")
                .and_then(|s| match std::fs::read(dir.join(&s.value)) {
                    Ok(mut bytes) => {
                        while bytes.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                            bytes.pop();
                        }
                        if bytes.len() < 32 {
                            p.at(
                                &s.span,
                                "`secret_file`: an HMAC secret needs at least 32 bytes",
                            );
                        }
                        Some(JwtKeys::Secret(bytes))
                    }
                    Err(e) => {
                        p.at(
                            &s.span,
                            format!("`secret_file`: cannot read {}: {e}", s.value),
                        );
                        None
                    }
                })
        }
        Some(source) => {
            for (s, _) in algorithms.iter().filter(|(_, a)| hmac(a)) {
                p.at(&s.span, format!("`algorithms`: {} needs `secret_file`; HMAC keys are never taken from a JWKS", s.value));
            }
            if source == "jwks_file" {
                t.string("jwks_file").and_then(|s| {
                    let read = std::fs::read(dir.join(&s.value))
                        .map_err(|e| format!("cannot read {}: {e}", s.value))
                        .and_then(|text| KeySet::parse(&text, &allowed));
                    match read {
                        Ok(set) => Some(JwtKeys::Jwks(set)),
                        Err(e) => {
                            p.at(&s.span, format!("`jwks_file`: {e}"));
                            None
                        }
                    }
                })
            } else {
                t.string("jwks_url").and_then(|s| jwks_url(p, &s))
            }
        }
        None => None,
    };
    let duration = |key: &str, default: u64| t.positive_duration(key, Duration::from_secs(default));
    let jwks_refresh = duration("jwks_refresh", 600);
    let unknown_kid_refetch = duration("unknown_kid_refetch", 30);
    let leeway = t
        .duration("leeway")
        .map_or(Duration::from_secs(60), |d| d.value);
    let consumer_claim = t.string("consumer_claim").map_or("sub".into(), |s| s.value);
    let plan_claim = t.string("plan_claim").map(|s| s.value);
    let prefix = t.string("consumer_prefix");
    let consumers = t
        .choice(
            "consumers",
            &[
                ("separate", JwtConsumers::Separate),
                ("match", JwtConsumers::Match),
            ],
        )
        .unwrap_or(JwtConsumers::Separate);
    let consumer_prefix = prefix.map_or(String::new(), |s| {
        if consumers == JwtConsumers::Match {
            p.at(&s.span, MATCH_TAKES_NO_PREFIX);
        } else if s.value.chars().any(char::is_control) {
            p.at(
                &s.span,
                "`consumer_prefix` must not hold a control character",
            );
        }
        s.value
    });
    t.finish();
    Some(JwtIssuer {
        issuer: issuer?.value,
        audiences: audiences?.into_iter().map(|s| s.value).collect(),
        algorithms: allowed,
        keys: keys?,
        jwks_refresh,
        unknown_kid_refetch,
        leeway,
        consumer_claim,
        plan_claim,
        consumer_prefix,
        consumers,
    })
}

const MATCH_TAKES_NO_PREFIX: &str = "`consumer_prefix` is for consumers = \"separate\" only: a \"match\" issuer's claim names a consumer of API keys as written";

/// With two or more `separate` issuers no `consumer_prefix` may equal or start another's
/// (absent is ""), so that no issuer's claim can name another issuer's consumer (DESIGN
/// §17); a `match` issuer's claims name the consumers of API keys as written, and take no
/// prefix. Each issuer is reported once, at its prefix (or its table), against the first
/// earlier one.
fn distinct_prefixes(p: &Problems, items: &[Spanned<Node>]) {
    const WHY: &str = "with two or more issuers of consumers = \"separate\" each needs a prefix of its own, none the start of another, so that no issuer can name another's consumers";
    let mut earlier: Vec<(String, String)> = Vec::new();
    for item in items {
        let Node::Table(entries) = &item.value else {
            continue;
        };
        let matching = entries.iter().any(|(k, v)| {
            k.value == "consumers" && matches!(&v.value, Node::Str(s) if s == "match")
        });
        if matching {
            continue;
        }
        let issuer = entries
            .iter()
            .find_map(|(k, v)| match &v.value {
                Node::Str(s) if k.value == "issuer" => Some(s.clone()),
                _ => None,
            })
            .unwrap_or_default();
        let (prefix, span, shown) = match entries.iter().find(|(k, _)| k.value == "consumer_prefix")
        {
            None => (
                String::new(),
                item.span.clone(),
                "\"\" (the default)".to_owned(),
            ),
            Some((
                _,
                Spanned {
                    value: Node::Str(s),
                    span,
                },
            )) => (s.clone(), span.clone(), format!("{s:?}")),
            // Not a string: the issuer's reader says so.
            Some(_) => continue,
        };
        let clash = earlier.iter().find_map(|(other, theirs)| {
            if theirs == &prefix {
                Some(format!("is also that of issuer {other:?}"))
            } else if prefix.starts_with(theirs.as_str()) {
                Some(format!("starts with that of issuer {other:?} ({theirs:?})"))
            } else if theirs.starts_with(prefix.as_str()) {
                Some(format!(
                    "is the start of that of issuer {other:?} ({theirs:?})"
                ))
            } else {
                None
            }
        });
        if let Some(clash) = clash {
            p.at(&span, format!("`consumer_prefix` {shown} {clash}: {WHY}"));
        }
        earlier.push((issuer, prefix));
    }
}

fn jwks_url(p: &Problems, s: &Spanned<String>) -> Option<JwtKeys> {
    let Ok(uri) = s.value.parse::<http::Uri>() else {
        p.at(&s.span, format!("`jwks_url`: bad URL \"{}\"", s.value));
        return None;
    };
    match (uri.scheme_str(), uri.host()) {
        (Some("https"), Some(_)) => {}
        (Some("http"), Some(host)) => {
            let loopback = host == "localhost"
                || host
                    .trim_matches(['[', ']'])
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback());
            if !loopback {
                p.warn(&s.span, "`jwks_url` is plain http:// to a host that is not loopback: anyone on the path can swap the keys");
            }
        }
        _ => {
            p.at(
                &s.span,
                format!(
                    "`jwks_url`: \"{}\" must be an http:// or https:// URL",
                    s.value
                ),
            );
            return None;
        }
    }
    Some(JwtKeys::Url(s.value.clone()))
}

/// `[[consumers]]` entries (of the config, or of a consumer file).
pub(super) fn consumers(p: &Problems, node: &Spanned<Node>, seen: &mut Seen) -> Vec<Consumer> {
    let Node::Array(items) = &node.value else {
        p.at(
            &node.span,
            format!(
                "`consumers` must be an array of tables ([[consumers]]), found {}",
                node.value.kind()
            ),
        );
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|item| consumer(p, item, seen))
        .collect()
}

fn consumer(p: &Problems, node: &Spanned<Node>, seen: &mut Seen) -> Option<Consumer> {
    let t = Table::new(p, "[[consumers]]", node)?;
    let name = t.required("name").and_then(|_| t.string("name"));
    if let Some(n) = &name {
        check_name(p, n, "consumer");
        if n.value == ANONYMOUS {
            p.at(&n.span, format!("\"{ANONYMOUS}\" is the plan of requests without a consumer; no consumer may be named so"));
        } else if n.value.parse::<std::net::IpAddr>().is_ok() {
            p.at(
                &n.span,
                "a consumer name must not be an IP address (anonymous clients are keyed by theirs)",
            );
        } else if !seen.names.insert(n.value.clone()) {
            p.at(&n.span, format!("duplicate consumer name \"{}\"", n.value));
        }
    }
    let plan = t.string("plan");
    if let Some(s) = &plan {
        if s.value.is_empty() || s.value == ANONYMOUS {
            p.at(
                &s.span,
                format!("`plan` must be a name other than \"{ANONYMOUS}\""),
            );
        }
    }
    let mut keys = Vec::new();
    for s in t.strings("keys").unwrap_or_default() {
        let digest = s.value.strip_prefix("sha256:").and_then(parse_hex);
        match digest {
            Some(d) if !seen.digests.insert(d) => {
                p.at(&s.span, "duplicate key digest (each key belongs to one consumer)")
            }
            Some(d) => keys.push(d),
            None => p.at(
                &s.span,
                "`keys`: expected \"sha256:\" and 64 lowercase hex digits (the SHA-256 of the key, never the key itself)",
            ),
        }
    }
    t.finish();
    Some(Consumer {
        name: name?.value,
        plan: plan.map(|s| s.value),
        keys,
    })
}

/// Reads the `[[consumers]]` of every file matching `consumer_files` (a `*` in a file name
/// matches any characters), from the config's directory; their problems are located in
/// their own files.
pub(super) fn consumer_files(
    p: &Problems,
    node: &Spanned<Node>,
    dir: &Path,
    seen: &mut Seen,
) -> Vec<Consumer> {
    let Node::Array(patterns) = &node.value else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for pattern in patterns {
        let Node::Str(text) = &pattern.value else {
            continue;
        };
        let files = match glob(&dir.join(text)) {
            Ok(files) => files,
            Err(e) => {
                p.at(&pattern.span, format!("`consumer_files`: {text}: {e}"));
                continue;
            }
        };
        for file in files {
            let name = file.display().to_string();
            let body = match std::fs::read_to_string(&file) {
                Ok(b) => b,
                Err(e) => {
                    p.at(
                        &pattern.span,
                        format!("`consumer_files`: cannot read {name}: {e}"),
                    );
                    continue;
                }
            };
            let inner = Problems::default();
            match tree::parse(&body) {
                Err(problem) => inner.at(&(problem.0..problem.0), problem.1),
                Ok(root) => {
                    if let Some(t) = Table::new(&inner, "a consumer file", &root) {
                        if let Some(n) = t.required("consumers") {
                            out.extend(consumers(&inner, n, seen));
                        }
                        t.finish();
                    }
                }
            }
            p.2.borrow_mut()
                .extend(located_in(&name, &body, inner.0.into_inner()));
        }
    }
    out
}

/// 64 lowercase hex digits (a consumer key's `sha256`) into a digest.
pub fn parse_hex(text: &str) -> Option<[u8; 32]> {
    let bytes = text.as_bytes();
    if bytes.len() != 64 {
        return None;
    }
    let nibble = |b: u8| match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; 32];
    for (i, pair) in bytes.chunks(2).enumerate() {
        out[i] = nibble(pair[0])? << 4 | nibble(pair[1])?;
    }
    Some(out)
}

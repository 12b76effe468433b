//! `[rls]` (DESIGN §13): the listener, and envoyproxy/ratelimit's YAML files turned into
//! policies (one per rule) and routes (one per domain, `rls:<domain>`) of the one model.

use std::net::SocketAddr;
use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::tree::{Node, Spanned};
use super::validate::{Problems, Table};
use super::*;
use crate::rls::rules::{self, Shape};

pub(super) fn rls(
    p: &Problems,
    node: &Spanned<Node>,
    dir: &Path,
    policies: &mut Vec<Policy>,
    routes: &mut Vec<Route>,
) -> Option<Rls> {
    let t = Table::new(p, "[rls]", node)?;
    let listen = t.required("listen").and_then(|_| t.string("listen"));
    let listen = listen.and_then(|s| match s.value.parse::<SocketAddr>() {
        Ok(addr) => Some(addr),
        Err(_) => {
            p.at(
                &s.span,
                format!(
                    "`listen`: bad address \"{}\" (expected IP:PORT, e.g. \"127.0.0.1:8081\")",
                    s.value
                ),
            );
            None
        }
    });
    let globs = t
        .required("config")
        .and_then(|_| t.strings("config"))
        .unwrap_or_default();
    t.finish();
    let mut files = Vec::new();
    for glob in &globs {
        match expand(&dir.join(&glob.value)) {
            Ok(found) if found.is_empty() => p.at(
                &glob.span,
                format!("`config`: no file matches \"{}\"", glob.value),
            ),
            Ok(found) => files.extend(found),
            Err(e) => p.at(&glob.span, format!("`config`: \"{}\": {e}", glob.value)),
        }
    }
    files.sort();
    files.dedup();
    let first_route = routes.len();
    let mut domains: Vec<rules::Domain> = Vec::new();
    for file in files {
        let shown = file.display().to_string();
        let domain = match std::fs::read_to_string(&file) {
            Ok(text) => rules::parse(&shown, &text),
            Err(e) => Err(vec![ConfigError {
                file: shown.clone(),
                line: 1,
                col: 1,
                message: format!("cannot read: {e}"),
            }]),
        };
        match domain {
            Ok(d) if domains.iter().any(|o| o.name == d.name) => {
                p.2.borrow_mut().push(ConfigError {
                    file: shown,
                    line: 1,
                    col: 1,
                    message: format!("domain \"{}\" is already defined by another file", d.name),
                })
            }
            Ok(d) => domains.push(d),
            Err(errors) => p.2.borrow_mut().extend(errors),
        }
    }
    for domain in &mut domains {
        let mut route = route_for(&domain.name);
        let keys: Vec<Vec<String>> = rules::rules(domain).into_iter().map(|(k, _)| k).collect();
        for (limit, keys) in rules::limits_mut(domain).into_iter().zip(keys) {
            let Some(policy) = policy(limit, keys) else {
                continue;
            };
            if policies.iter().any(|o| o.name == policy.name) {
                let mut at = limit.at.clone();
                at.message = format!(
                    "policy name \"{}\" is already used (by a [policies] table or another rule): give this rule a distinct `name`",
                    policy.name
                );
                p.2.borrow_mut().push(at);
                continue;
            }
            limit.policy = Some(policies.len());
            route.policies.push(policies.len());
            policies.push(policy);
        }
        routes.push(route);
    }
    Some(Rls {
        listen: listen?,
        domains,
        first_route,
    })
}

/// The policy a limited rule is counted as: keyed on its descriptor's entries, in order.
#[allow(clippy::needless_update)]
fn policy(limit: &rules::Limit, keys: Vec<String>) -> Option<Policy> {
    let Shape::Limited {
        requests_per_unit,
        unit,
        algorithm,
        burst,
        ban,
    } = limit.shape
    else {
        return None;
    };
    let limit_n = NonZeroU64::new(requests_per_unit)?;
    Some(Policy {
        name: limit.name.clone(),
        algorithm,
        limit: limit_n,
        period: unit,
        burst: burst.and_then(NonZeroU64::new).unwrap_or(limit_n),
        key: keys.into_iter().map(KeyPart::Header).collect(),
        cost: 1,
        mode: if limit.shadow {
            Mode::Shadow
        } else {
            Mode::Enforce
        },
        delay: None,
        status: 429,
        // Descriptors always carry their entries: nothing is ever missing or skipped.
        on_missing: OnMissing::Shared,
        exempt: Vec::new(),
        on_error: None,
        lease: Duration::from_secs(60),
        overrides: Vec::new(),
        ban,
        metering: None,
        // Fields not named here (none today; those a merge adds) take the plain defaults of
        // the built-in `max_failures` policy: a rule is a plain counted policy like it.
        ..super::auth::failures_policy(MaxFailures {
            limit: limit_n,
            period: unit,
            ban,
        })
    })
}

/// The route a domain's decisions are counted under; it never matches an HTTP request
/// (the proxy's index holds only the routes before `Rls::first_route`).
fn route_for(domain: &str) -> Route {
    Route {
        name: format!("rls:{domain}"),
        hosts: Vec::new(),
        path: PathMatch::Any,
        methods: Vec::new(),
        target: Target::Respond {
            status: 404,
            body: String::new(),
            content_type: "text/plain".into(),
        },
        policies: Vec::new(),
        max_request_body: None,
        auth: AuthMode::Off,
        metrics_as: None,
        scheme: None,
        strip_prefix: false,
        request_headers: HeaderRules::default(),
        response_headers: HeaderRules::default(),
    }
}

/// The files `pattern` names: `*` and `?` in its last component match within one
/// directory, as the shell's globs do (hidden files only when the pattern starts with `.`).
fn expand(pattern: &Path) -> std::io::Result<Vec<PathBuf>> {
    let name = pattern
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if !name.contains(['*', '?']) {
        return Ok(if pattern.is_file() {
            vec![pattern.to_owned()]
        } else {
            Vec::new()
        });
    }
    let dir = match pattern.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    };
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir)? {
        let entry = entry?;
        let file = entry.file_name().to_string_lossy().into_owned();
        if file.starts_with('.') && !name.starts_with('.') {
            continue;
        }
        if wildcard(name.as_bytes(), file.as_bytes()) && entry.path().is_file() {
            out.push(entry.path());
        }
    }
    Ok(out)
}

fn wildcard(pattern: &[u8], text: &[u8]) -> bool {
    match (pattern.first(), text.first()) {
        (None, None) => true,
        (Some(b'*'), _) => {
            wildcard(&pattern[1..], text) || (!text.is_empty() && wildcard(pattern, &text[1..]))
        }
        (Some(b'?'), Some(_)) => wildcard(&pattern[1..], &text[1..]),
        (Some(a), Some(b)) if a == b => wildcard(&pattern[1..], &text[1..]),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::wildcard;

    #[test]
    fn globs_match_like_the_shell() {
        assert!(wildcard(b"*.yaml", b"a.yaml"));
        assert!(wildcard(b"rl-?.yaml", b"rl-1.yaml"));
        assert!(!wildcard(b"*.yaml", b"a.yml"));
        assert!(wildcard(b"*", b""));
        assert!(!wildcard(b"a*b", b"ac"));
    }
}

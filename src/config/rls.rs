//! `[rls]` (DESIGN §13): the listener and the ratelimit YAML files it names; each limited
//! rule becomes a policy and each domain a route (`rls:<domain>`).

use std::net::SocketAddr;
use std::num::NonZeroU64;
use std::path::Path;
use std::time::Duration;

use super::auth::{failures_policy, MaxFailures};
use super::policies::{KeyPart, Mode, OnMissing, Policy};
use super::ratelimit::{self as rules, Shape};
use super::read::{self, ConfigError, Problems, Table};
use super::routes::{AuthMode, HeaderRules, PathMatch, Route, Target};
use super::tree::{Node, Spanned};

/// `[rls]`: the listener and the domains of its YAML files. Each limited rule is a policy
/// (`Limit::policy`), and domain `i` is counted as route `first_route + i` (`rls:<domain>`).
#[derive(Debug, Clone)]
pub struct Rls {
    pub listen: SocketAddr,
    pub domains: Vec<rules::Domain>,
    pub first_route: usize,
}

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
        match read::glob(&dir.join(&glob.value)).map(|mut found| {
            found.retain(|f| f.is_file());
            found
        }) {
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
        prefetch,
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
        prefetch,
        // Fields not named here (none today; those a merge adds) take the plain defaults of
        // the built-in `max_failures` policy: a rule is a plain counted policy like it.
        ..failures_policy(MaxFailures {
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
        client_ips: Default::default(),
        strip_prefix: false,
        request_headers: HeaderRules::default(),
        response_headers: HeaderRules::default(),
    }
}

//! `[[routes]]` (DESIGN §2, §14): matching, targets, policies, `auth`, header rules and
//! redirects: their types and readers.

use std::collections::HashMap;

use regex::Regex;

use super::nets::NetSet;
use super::policies::Policy;
use super::read::{check_name, header_name, Problems, Table};
use super::tree::{Node, Spanned};
use super::upstreams::Upstream;

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
    /// `client_ips`: only requests whose client address (DESIGN §2.1) is in one of these
    /// networks match (§20); empty: every address.
    pub client_ips: NetSet,
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

pub(super) fn routes(
    p: &Problems,
    node: &Spanned<Node>,
    upstreams: &[Upstream],
    policies: &[Policy],
    credentials: bool,
) -> Vec<Route> {
    let Node::Array(items) = &node.value else {
        p.at(
            &node.span,
            format!(
                "`routes` must be an array of tables ([[routes]]), found {}",
                node.value.kind()
            ),
        );
        return Vec::new();
    };
    let mut seen: HashMap<String, ()> = HashMap::new();
    let mut out = Vec::new();
    for item in items {
        let Some(t) = Table::new(p, "[[routes]]", item) else {
            continue;
        };
        if let Some(route) = route(p, &t, upstreams, policies, credentials) {
            if seen.insert(route.name.clone(), ()).is_some() || route.name == "unmatched" {
                p.at(
                    &t.key_span("name"),
                    format!("duplicate route name \"{}\"", route.name),
                );
            }
            out.push(route);
        }
        t.finish();
    }
    out
}

/// `[server] case_insensitive_paths` (DESIGN §21): each `path_regex` matches with case
/// ignored (exact paths and prefixes are lower-cased by the route index).
pub(super) fn ignore_path_case(routes: &mut [Route]) {
    for route in routes {
        if let PathMatch::Regex(re) = &route.path {
            let ignoring = regex::RegexBuilder::new(re.as_str())
                .case_insensitive(true)
                .build();
            // It compiled once; the same pattern with a flag compiles again.
            if let Ok(re) = ignoring {
                route.path = PathMatch::Regex(re);
            }
        }
    }
}

fn route(
    p: &Problems,
    t: &Table,
    upstreams: &[Upstream],
    policies: &[Policy],
    credentials: bool,
) -> Option<Route> {
    let name = t.required("name").and_then(|_| t.string("name"));
    if let Some(n) = &name {
        check_name(p, n, "route");
    }
    let hosts = t
        .strings("hosts")
        .unwrap_or_default()
        .into_iter()
        .map(|h| {
            let host = h.value.to_ascii_lowercase();
            match host.strip_prefix('*') {
                Some(suffix) if suffix.starts_with('.') && suffix.len() > 1 => {
                    HostMatch::Suffix(suffix.to_owned())
                }
                Some(_) => {
                    p.at(
                        &h.span,
                        format!(
                            "`hosts`: bad wildcard \"{}\" (expected \"*.example.org\")",
                            h.value
                        ),
                    );
                    HostMatch::Exact(host)
                }
                None => HostMatch::Exact(host),
            }
        })
        .collect();
    let matchers: Vec<(&str, Spanned<String>)> = ["path", "path_prefix", "path_regex"]
        .iter()
        .filter_map(|k| t.string(k).map(|s| (*k, s)))
        .collect();
    if matchers.len() > 1 {
        p.at(
            &t.key_span(matchers[1].0),
            "a route takes only one of `path`, `path_prefix` and `path_regex`",
        );
    }
    let path = match matchers.first() {
        None => PathMatch::Any,
        Some(("path", s)) => PathMatch::Exact(s.value.clone()),
        Some(("path_prefix", s)) => PathMatch::Prefix(s.value.clone()),
        Some((_, s)) => match Regex::new(&s.value) {
            Ok(re) => PathMatch::Regex(re),
            Err(e) => {
                let first = e
                    .to_string()
                    .lines()
                    .last()
                    .unwrap_or_default()
                    .trim()
                    .to_owned();
                p.at(&s.span, format!("`path_regex`: bad regex: {first}"));
                PathMatch::Any
            }
        },
    };
    if let PathMatch::Exact(s) | PathMatch::Prefix(s) = &path {
        if !s.starts_with('/') {
            let key = matchers.first().map_or("path", |m| m.0);
            p.at(&matchers[0].1.span, format!("`{key}` must start with '/'"));
        }
    }
    let methods = t
        .strings("methods")
        .unwrap_or_default()
        .into_iter()
        .filter_map(|m| {
            let ok = !m.value.is_empty() && m.value.bytes().all(|b| b.is_ascii_uppercase());
            if !ok {
                p.at(
                    &m.span,
                    format!(
                        "`methods`: bad method \"{}\" (expected upper case, e.g. \"GET\")",
                        m.value
                    ),
                );
            }
            ok.then_some(m.value)
        })
        .collect();
    let upstream = t.string("upstream");
    let respond = t.get("respond");
    let redirect = t.get("redirect");
    let targets = usize::from(upstream.is_some())
        + usize::from(respond.is_some())
        + usize::from(redirect.is_some());
    let target = match (upstream, respond, redirect) {
        _ if targets > 1 => {
            let second = ["respond", "redirect"]
                .into_iter()
                .rev()
                .find(|k| t.get(k).is_some())
                .unwrap_or("respond");
            p.at(
                &t.key_span(second),
                "a route takes exactly one of `upstream`, `respond` and `redirect`",
            );
            None
        }
        (Some(u), _, _) => match upstreams.iter().position(|x| x.name == u.value) {
            Some(i) => Some(Target::Upstream(i)),
            None => {
                p.at(&u.span, format!("unknown upstream \"{}\"", u.value));
                None
            }
        },
        (_, Some(node), _) => respond_target(p, node),
        (_, _, Some(node)) => redirect_target(p, node),
        (None, None, None) => {
            p.at(
                &t.span,
                "a route needs exactly one of `upstream`, `respond` and `redirect`",
            );
            None
        }
    };
    let policy_refs: Vec<usize> = t
        .strings("policies")
        .unwrap_or_default()
        .iter()
        .filter_map(|s| {
            let found = policies.iter().position(|x| x.name == s.value);
            if found.is_none() {
                p.at(&s.span, format!("unknown policy \"{}\"", s.value));
            }
            found
        })
        .collect();
    let max_request_body = t.size("max_request_body");
    let auth = t
        .choice(
            "auth",
            &[
                ("off", AuthMode::Off),
                ("optional", AuthMode::Optional),
                ("required", AuthMode::Required),
            ],
        )
        .unwrap_or(AuthMode::Off);
    if let (false, AuthMode::Optional | AuthMode::Required, Some(at)) =
        (credentials, auth, t.get("auth"))
    {
        p.at(
            &at.span,
            format!(
                "route \"{}\" has `auth` but [auth] accepts no credentials (no `api_key` sources and no [[auth.jwt]])",
                name.as_ref().map_or("", |n| n.value.as_str())
            ),
        );
    }
    let scheme = t.choice(
        "scheme",
        &[("http", Scheme::Http), ("https", Scheme::Https)],
    );
    let client_ips = t.cidrs("client_ips");
    if matches!(t.get("client_ips").map(|n| &n.value), Some(Node::Array(a)) if a.is_empty()) {
        p.at(
            &t.key_span("client_ips"),
            "`client_ips` needs at least one network (leave it out to match every address)",
        );
    }
    let client_ips = NetSet::new(client_ips);
    let strip_prefix = t.bool("strip_prefix").unwrap_or(false);
    if strip_prefix && !matches!(path, PathMatch::Prefix(_)) {
        p.at(
            &t.key_span("strip_prefix"),
            "`strip_prefix` needs a `path_prefix`",
        );
    }
    let request_headers = t
        .get("request_headers")
        .map(|n| header_rules(p, n, "request_headers"))
        .unwrap_or_default();
    let response_headers = t
        .get("response_headers")
        .map(|n| header_rules(p, n, "response_headers"))
        .unwrap_or_default();
    let metrics_as = t.string("metrics_as").map(|s| {
        check_name(p, &s, "metrics_as");
        s.value
    });
    Some(Route {
        metrics_as,
        scheme,
        client_ips,
        strip_prefix,
        request_headers,
        response_headers,
        name: name?.value,
        hosts,
        path,
        methods,
        target: target?,
        policies: policy_refs,
        max_request_body,
        auth,
    })
}

fn respond_target(p: &Problems, node: &Spanned<Node>) -> Option<Target> {
    let r = Table::new(p, "`respond`", node)?;
    let status = r.int("status", 100..=599).map_or(200, |n| n.value as u16);
    let body = r.string("body").map(|s| s.value).unwrap_or_default();
    let content_type = r
        .string("content_type")
        .map_or_else(|| "text/plain".to_owned(), |s| s.value);
    r.finish();
    Some(Target::Respond {
        status,
        body,
        content_type,
    })
}

/// `request_headers` / `response_headers`: `{ set = { NAME = "VALUE" }, remove = [NAME] }`.
pub(super) fn header_rules(p: &Problems, node: &Spanned<Node>, key: &str) -> HeaderRules {
    let Some(t) = Table::new(p, &format!("`{key}`"), node) else {
        return HeaderRules::default();
    };
    let mut rules = HeaderRules::default();
    for s in t.strings("remove").unwrap_or_default() {
        rules.remove.extend(header_name(p, &s, key));
    }
    if let Some(set) = t.get("set") {
        match &set.value {
            Node::Table(entries) => {
                for (name, value) in entries {
                    let name = header_name(p, name, key);
                    let value = match &value.value {
                        Node::Str(v) => match http::HeaderValue::from_str(v) {
                            Ok(v) => Some(v),
                            Err(_) => {
                                p.at(
                                    &value.span,
                                    format!("`{key}`: {v:?} is not a valid header value"),
                                );
                                None
                            }
                        },
                        other => {
                            p.at(
                                &value.span,
                                format!(
                                    "`{key}`: header values must be strings, found {}",
                                    other.kind()
                                ),
                            );
                            None
                        }
                    };
                    if let (Some(name), Some(value)) = (name, value) {
                        rules.set.push((name, value));
                    }
                }
            }
            other => p.at(
                &set.span,
                format!(
                    "`set` must be a table of header names and values, found {}",
                    other.kind()
                ),
            ),
        }
    }
    t.finish();
    rules
}

/// `redirect = { scheme = "https", status = 308 }` or `{ location = "…", status = 301 }`.
pub(super) fn redirect_target(p: &Problems, node: &Spanned<Node>) -> Option<Target> {
    let r = Table::new(p, "`redirect`", node)?;
    let status = match r.int("status", 300..=399) {
        None => 308,
        Some(n) if [301, 302, 303, 307, 308].contains(&n.value) => n.value as u16,
        Some(n) => {
            p.at(
                &n.span,
                format!(
                    "`status` of a redirect must be 301, 302, 303, 307 or 308, found {}",
                    n.value
                ),
            );
            308
        }
    };
    let scheme = r.choice(
        "scheme",
        &[("http", Scheme::Http), ("https", Scheme::Https)],
    );
    let location = r.string("location");
    let to = match (scheme, location) {
        (Some(s), None) => Some(RedirectTo::Scheme(s)),
        (None, Some(l)) => {
            if l.value.parse::<http::Uri>().is_err()
                || http::HeaderValue::from_str(&l.value).is_err()
            {
                p.at(
                    &l.span,
                    format!("`location`: {:?} is not a valid URL", l.value),
                );
                None
            } else {
                Some(RedirectTo::Location(l.value))
            }
        }
        _ => {
            p.at(
                &r.span,
                "a redirect takes exactly one of `scheme` and `location`",
            );
            None
        }
    };
    r.finish();
    Some(Target::Redirect { to: to?, status })
}

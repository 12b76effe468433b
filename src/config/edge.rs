//! Edge essentials of a route and `[server]` (DESIGN §14): header rules, redirects, the
//! request id header, checked with every problem located.

use super::tree::{Node, Spanned};
use super::validate::{Problems, Table};
use super::*;

/// A header name as written for `key`, or the problem with it.
pub(super) fn header_name(
    p: &Problems,
    s: &Spanned<String>,
    key: &str,
) -> Option<http::HeaderName> {
    match http::HeaderName::from_bytes(s.value.as_bytes()) {
        Ok(name) => Some(name),
        Err(_) => {
            p.at(
                &s.span,
                format!("`{key}`: \"{}\" is not a valid header name", s.value),
            );
            None
        }
    }
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

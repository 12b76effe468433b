//! Matching a request to the first route whose hosts, path, methods, scheme and client
//! addresses all fit: the plain scan states the rule, `index` answers it at a cost that does
//! not grow with the config; `path` gives the one spelling of a path (DESIGN §17) and the
//! form routes match it in (§21: without `;parameters`, optionally case-insensitive).

mod index;
mod path;
pub use index::RouteIndex;
pub use path::{match_form, normalize_path, PathError};

use std::net::IpAddr;

use crate::config::{HostMatch, PathMatch, Route, Scheme};

/// The route label for requests that match no route.
pub const UNMATCHED: &str = "unmatched";

/// Index of the first matching route, by scanning them all: the meaning of routing, which
/// `RouteIndex` must answer exactly (case-sensitive). `host` is lower-case without port;
/// `path` is normal (DESIGN §17) and matched in its `match_form`; `client` is the client
/// address of DESIGN §2.1.
pub fn match_route(
    routes: &[Route],
    host: &str,
    path: &str,
    method: &str,
    scheme: Scheme,
    client: IpAddr,
) -> Option<usize> {
    let path = &*match_form(path, false);
    routes.iter().position(|r| {
        (r.hosts.is_empty() || r.hosts.iter().any(|h| host_matches(h, host)))
            && path_matches(&r.path, path)
            && fits(r, method, scheme, client)
    })
}

/// The route's `methods`, `scheme` and `client_ips` allow this request: the conditions
/// checked on each candidate the index finds by host and path.
pub fn fits(route: &Route, method: &str, scheme: Scheme, client: IpAddr) -> bool {
    (route.methods.is_empty() || route.methods.iter().any(|m| m == method))
        && route.scheme.is_none_or(|s| s == scheme)
        && (route.client_ips.is_empty() || route.client_ips.contains(client))
}

fn host_matches(pattern: &HostMatch, host: &str) -> bool {
    match pattern {
        HostMatch::Exact(h) => h == host,
        // "*.example.org" matches "a.example.org" and "a.b.example.org", not "example.org".
        HostMatch::Suffix(suffix) => host.len() > suffix.len() && host.ends_with(suffix.as_str()),
    }
}

fn path_matches(pattern: &PathMatch, path: &str) -> bool {
    match pattern {
        PathMatch::Any => true,
        // An exact path also matches with one trailing slash (DESIGN §21): `/login/` is `/login`.
        PathMatch::Exact(p) => p == path || path.strip_suffix('/') == Some(p.as_str()),
        PathMatch::Prefix(p) => path.starts_with(p.as_str()),
        PathMatch::Regex(re) => re.is_match(path),
    }
}

/// The Host header (or URI authority) without port, lower-cased.
pub fn normalize_host(raw: &str) -> String {
    let raw = raw.trim();
    let host = if let Some(rest) = raw.strip_prefix('[') {
        // [v6]:port
        rest.split(']').next().unwrap_or(rest)
    } else {
        raw.rsplit_once(':')
            .filter(|(_, port)| port.bytes().all(|b| b.is_ascii_digit()))
            .map_or(raw, |(h, _)| h)
    };
    host.trim_end_matches('.').to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;

    fn routes() -> Vec<Route> {
        let text = r#"
[server]
listen = ["127.0.0.1:1"]
[[routes]]
name = "api"
hosts = ["api.example.com", "*.example.org"]
path_prefix = "/v1/"
methods = ["GET"]
respond = { status = 200 }
[[routes]]
name = "user"
path_regex = "^/users/[0-9]+$"
respond = { status = 200 }
[[routes]]
name = "exact"
path = "/hello"
respond = { status = 200 }
"#;
        config::parse("t.toml", text)
            .expect("valid test config")
            .routes
    }

    #[test]
    fn first_match_wins_by_host_path_and_method() {
        let r = routes();
        let client = "192.0.2.1".parse().expect("test address");
        let match_route =
            |r: &[Route], h: &str, p: &str, m: &str| match_route(r, h, p, m, Scheme::Http, client);
        assert_eq!(match_route(&r, "api.example.com", "/v1/x", "GET"), Some(0));
        assert_eq!(match_route(&r, "a.b.example.org", "/v1/x", "GET"), Some(0));
        assert_eq!(match_route(&r, "example.org", "/v1/x", "GET"), None);
        assert_eq!(match_route(&r, "api.example.com", "/v1/x", "POST"), None);
        assert_eq!(match_route(&r, "x", "/users/42", "POST"), Some(1));
        assert_eq!(match_route(&r, "x", "/users/4a", "GET"), None);
        assert_eq!(match_route(&r, "x", "/hello", "GET"), Some(2));
        assert_eq!(match_route(&r, "x", "/hello/", "GET"), Some(2));
        assert_eq!(match_route(&r, "x", "/hello//", "GET"), None);
        assert_eq!(match_route(&r, "x", "/hello;jsessionid=1", "GET"), Some(2));
    }

    #[test]
    fn client_ips_let_only_their_addresses_take_a_route() {
        let text = r#"
[server]
listen = ["127.0.0.1:1"]
[[routes]]
name = "office"
path_prefix = "/admin/"
client_ips = ["10.0.0.0/8", "2001:db8::/32", "192.0.2.7"]
respond = { status = 200 }
[[routes]]
name = "others"
path_prefix = "/"
respond = { status = 200 }
"#;
        let routes = config::parse("t.toml", text).expect("valid").routes;
        let index = RouteIndex::new(&routes, false);
        for (client, expected) in [
            ("10.20.30.40", Some(0)),
            ("2001:db8::5", Some(0)),
            ("192.0.2.7", Some(0)),
            ("192.0.2.8", Some(1)),
            ("11.0.0.1", Some(1)),
        ] {
            let ip: IpAddr = client.parse().expect("test address");
            let scan = match_route(&routes, "h", "/admin/x", "GET", Scheme::Http, ip);
            assert_eq!(scan, expected, "{client}");
            let found = index.find(&routes, "h", "/admin/x", "GET", Scheme::Http, ip);
            assert_eq!(found, expected, "{client}");
        }
    }

    #[test]
    fn hosts_are_normalized() {
        assert_eq!(normalize_host("API.Example.com:8080"), "api.example.com");
        assert_eq!(normalize_host("[::1]:80"), "::1");
        assert_eq!(normalize_host("example.com."), "example.com");
    }
}

//! The route index (DESIGN §16): the answer of the first-match scan, at a cost that does not
//! grow with the number of routes. Exact hosts and paths by hash; wildcard hosts and path
//! prefixes by one hash lookup per distinct suffix or prefix length; regexes only when no
//! earlier route can match.

use std::collections::HashMap;
use std::net::IpAddr;

use crate::config::{HostMatch, PathMatch, Route, Scheme};

/// Route ids (positions in the config), ascending: the first that fits is the answer.
type Ids = Vec<u32>;

/// Routes sharing one host matcher, by their path matcher.
#[derive(Default)]
struct PathIndex {
    exact: HashMap<Box<str>, Ids>,
    prefixes: HashMap<Box<str>, Ids>,
    /// The distinct lengths of `prefixes`, ascending.
    prefix_lengths: Vec<usize>,
    any: Ids,
    regex: Ids,
}

impl PathIndex {
    fn add(&mut self, id: u32, path: &PathMatch) {
        match path {
            PathMatch::Any => self.any.push(id),
            PathMatch::Exact(p) => push(self.exact.entry(p.as_str().into()).or_default(), id),
            PathMatch::Prefix(p) => {
                push(self.prefixes.entry(p.as_str().into()).or_default(), id);
                if let Err(at) = self.prefix_lengths.binary_search(&p.len()) {
                    self.prefix_lengths.insert(at, p.len());
                }
            }
            PathMatch::Regex(_) => self.regex.push(id),
        }
    }

    /// Lowers `best` to the first route of this index that fits `path`, `method`, `scheme`
    /// and `client`.
    fn find(&self, routes: &[Route], path: &str, req: Fits, best: &mut u32) {
        let (method, scheme, client) = req;
        let fits = |id: &u32| super::fits(&routes[*id as usize], method, scheme, client);
        let mut first_of = |ids: &Ids| {
            if let Some(&id) = ids.iter().take_while(|id| **id < *best).find(|id| fits(id)) {
                *best = id;
            }
        };
        if let Some(ids) = self.exact.get(path) {
            first_of(ids);
        }
        // An exact path also matches with one trailing slash (DESIGN §21).
        let trimmed = path.strip_suffix('/').filter(|p| !p.is_empty());
        if let Some(ids) = trimmed.and_then(|p| self.exact.get(p)) {
            first_of(ids);
        }
        for &len in &self.prefix_lengths {
            let Some(prefix) = path.get(..len) else { break };
            if let Some(ids) = self.prefixes.get(prefix) {
                first_of(ids);
            }
        }
        first_of(&self.any);
        // Only the regexes of routes before the best so far can change the answer.
        for &id in self.regex.iter().take_while(|id| **id < *best) {
            if let PathMatch::Regex(re) = &routes[id as usize].path {
                if fits(&id) && re.is_match(path) {
                    *best = id;
                    break;
                }
            }
        }
    }
}

/// What a candidate route is checked against besides host and path: method, scheme and
/// client address.
type Fits<'a> = (&'a str, Scheme, IpAddr);

/// A route with several matchers of one kind is listed once under each.
fn push(ids: &mut Ids, id: u32) {
    if ids.last() != Some(&id) {
        ids.push(id);
    }
}

/// Every route of a config, indexed; built once per config.
#[derive(Default)]
pub struct RouteIndex {
    /// `[server] case_insensitive_paths`: exact paths and prefixes are kept, and paths
    /// matched, in ASCII lower case (regexes were built case-insensitive by the config).
    case_insensitive: bool,
    exact_hosts: HashMap<Box<str>, PathIndex>,
    /// `*.example.org` routes by ".example.org".
    suffix_hosts: HashMap<Box<str>, PathIndex>,
    /// The distinct lengths of `suffix_hosts`, ascending.
    suffix_lengths: Vec<usize>,
    any_host: PathIndex,
}

impl RouteIndex {
    pub fn new(routes: &[Route], case_insensitive: bool) -> RouteIndex {
        let mut index = RouteIndex {
            case_insensitive,
            ..RouteIndex::default()
        };
        for (id, route) in routes.iter().enumerate() {
            let id = id as u32;
            let lowered;
            let path = match &route.path {
                PathMatch::Exact(p) if case_insensitive => {
                    lowered = PathMatch::Exact(p.to_ascii_lowercase());
                    &lowered
                }
                PathMatch::Prefix(p) if case_insensitive => {
                    lowered = PathMatch::Prefix(p.to_ascii_lowercase());
                    &lowered
                }
                path => path,
            };
            if route.hosts.is_empty() {
                index.any_host.add(id, path);
            }
            for host in &route.hosts {
                match host {
                    HostMatch::Exact(h) => index
                        .exact_hosts
                        .entry(h.as_str().into())
                        .or_default()
                        .add(id, path),
                    HostMatch::Suffix(s) => {
                        index
                            .suffix_hosts
                            .entry(s.as_str().into())
                            .or_default()
                            .add(id, path);
                        if let Err(at) = index.suffix_lengths.binary_search(&s.len()) {
                            index.suffix_lengths.insert(at, s.len());
                        }
                    }
                }
            }
        }
        index
    }

    /// The first route (in config order) whose hosts, path, methods, scheme and
    /// `client_ips` fit: what `super::match_route` answers. `host` is lower-case without
    /// port; `path` is normal (DESIGN §17), matched in its `match_form` (§21); `client` is
    /// the client address of DESIGN §2.1. A route with `client_ips` is a candidate like any
    /// other, checked by that condition: no route is scanned for it.
    pub fn find(
        &self,
        routes: &[Route],
        host: &str,
        path: &str,
        method: &str,
        scheme: Scheme,
        client: IpAddr,
    ) -> Option<usize> {
        let path = &*super::match_form(path, self.case_insensitive);
        let req = (method, scheme, client);
        let mut best = u32::MAX;
        if let Some(index) = self.exact_hosts.get(host) {
            index.find(routes, path, req, &mut best);
        }
        for &len in &self.suffix_lengths {
            // "*.example.org" matches "a.example.org", never "example.org" itself.
            if host.len() <= len {
                break;
            }
            let Some(suffix) = host.get(host.len() - len..) else {
                continue;
            };
            if let Some(index) = self.suffix_hosts.get(suffix) {
                index.find(routes, path, req, &mut best);
            }
        }
        self.any_host.find(routes, path, req, &mut best);
        (best != u32::MAX).then_some(best as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;
    use crate::routing::match_route;

    /// A small deterministic generator (xorshift), so a failure names its seed.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
            items[(self.next() % items.len() as u64) as usize]
        }
    }

    const HOSTS: &[&str] = &[
        "a.test",
        "b.test",
        "x.a.test",
        "y.x.a.test",
        "test",
        "c.example",
    ];
    const WILDCARDS: &[&str] = &["*.a.test", "*.test", "*.x.a.test", "*.example"];
    const PATHS: &[&str] = &[
        "/",
        "/v1",
        "/v1/",
        "/v1/users",
        "/v1/users/42",
        "/v2/x",
        "/hello",
        "/users/7",
        "",
    ];
    const METHODS: &[&str] = &["GET", "POST", "PUT"];
    const CLIENT_IPS: &[&str] = &["10.0.0.0/8", "10.1.2.3", "2001:db8::/32", "192.0.2.0/24"];
    const CLIENTS: &[&str] = &["10.1.2.3", "10.9.9.9", "192.0.2.7", "2001:db8::1", "::1"];

    fn random_config(rng: &mut Rng, routes: usize) -> Vec<Route> {
        let mut text = String::from("[server]\nlisten = [\"127.0.0.1:1\"]\n");
        for i in 0..routes {
            text.push_str(&format!(
                "[[routes]]\nname = \"r{i}\"\nrespond = {{ status = 200 }}\n"
            ));
            let hosts: Vec<String> = (0..rng.next() % 3)
                .map(|_| {
                    let h = if rng.next().is_multiple_of(2) {
                        rng.pick(HOSTS)
                    } else {
                        rng.pick(WILDCARDS)
                    };
                    format!("\"{h}\"")
                })
                .collect();
            if !hosts.is_empty() {
                text.push_str(&format!("hosts = [{}]\n", hosts.join(", ")));
            }
            match rng.next() % 5 {
                0 => {}
                1 => text.push_str(&format!("path = \"{}\"\n", rng.pick(&PATHS[..8]))),
                2 | 3 => text.push_str(&format!("path_prefix = \"{}\"\n", rng.pick(&PATHS[..8]))),
                _ => text.push_str(&format!(
                    "path_regex = \"{}\"\n",
                    rng.pick(&["^/users/[0-9]+$", "^/v1/", "x$", "^/$"])
                )),
            }
            if rng.next().is_multiple_of(3) {
                text.push_str(&format!("methods = [\"{}\"]\n", rng.pick(METHODS)));
            }
            if rng.next().is_multiple_of(4) {
                text.push_str(&format!("scheme = \"{}\"\n", rng.pick(&["http", "https"])));
            }
            if rng.next().is_multiple_of(3) {
                let nets: Vec<String> = (0..1 + rng.next() % 2)
                    .map(|_| format!("\"{}\"", rng.pick(CLIENT_IPS)))
                    .collect();
                text.push_str(&format!("client_ips = [{}]\n", nets.join(", ")));
            }
        }
        config::parse("t.toml", &text)
            .expect("generated config")
            .routes
    }

    #[test]
    fn the_index_answers_what_the_scan_answers() {
        for seed in 1..=300u64 {
            let mut rng = Rng(seed * 0x9E37_79B9_7F4A_7C15);
            let n = 1 + (rng.next() % 40) as usize;
            let routes = random_config(&mut rng, n);
            let index = RouteIndex::new(&routes, false);
            for host in HOSTS.iter().chain(&["q.c.example", "other", "a.test.evil"]) {
                for path in PATHS.iter().chain(&["/v1/users/42/x", "/hellox"]) {
                    for method in METHODS {
                        for scheme in [Scheme::Http, Scheme::Https] {
                            for client in CLIENTS {
                                let ip: IpAddr = client.parse().expect("test address");
                                assert_eq!(
                                    index.find(&routes, host, path, method, scheme, ip),
                                    match_route(&routes, host, path, method, scheme, ip),
                                    "seed {seed}: {method} {scheme:?} {host}{path} from {client}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

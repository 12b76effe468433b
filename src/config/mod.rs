//! The validated configuration model: every other module reads this, never raw TOML. It is
//! plain data and imports nothing else of the crate (DESIGN §6b).
//!
//! `load` parses a file, checks all of it, and returns either a `Config` or every problem
//! found, each located at FILE:LINE:COL. Each section has its own file with its types and
//! its reader, over `read` (shared helpers) and `tree` (the TOML with positions); `build`
//! below reads the sections in order and checks what spans them.

mod adaptive;
mod auth;
mod calendar;
mod certs;
pub mod jwks;
mod limiter;
mod metering;
mod nets;
mod policies;
pub mod ratelimit;
mod read;
mod reject;
mod retries;
mod rls;
mod routes;
mod server;
mod tls;
mod tree;
mod upstream_tls;
mod upstreams;

pub use self::rls::Rls;
pub use adaptive::Adaptive;
pub use auth::{
    parse_hex, Auth, Consumer, JwtConsumers, JwtIssuer, JwtKeys, MaxFailures, ANONYMOUS,
    AUTH_FAILURES,
};
pub use calendar::{zone as calendar_zone, Calendar, CalendarUnit, Zone};
pub use jwks::KeySet;
pub use limiter::{Backend, ClockSource, Limiter, OnError};
pub use metering::{CacheWeights, Metering, Reserve, StatusRange, UsageFormat};
pub use nets::NetSet;
pub use policies::{
    exact_in_redis, Algorithm, Condition, KeyPart, Mode, Numbers, OnMissing, Override, Policy,
    Values,
};
pub use read::{parse_duration, parse_size, ConfigError, ConfigErrors};
pub use reject::{Part, Placeholder, Reject, Template};
pub use retries::{Retries, RetryOn};
pub use routes::{AuthMode, HeaderRules, HostMatch, PathMatch, RedirectTo, Route, Scheme, Target};
pub use server::{AccessLog, Admin, EscapedSlashes, HeaderStyle, Server, Token};
pub use tls::{Certificate, ClientAuth, Tls, TlsVersion};
pub use upstream_tls::{ClientCert, UpstreamTls};
pub use upstreams::{Balance, HealthCheck, Upstream, UpstreamProtocol, DEFAULT_KEEPALIVE};

use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};

use read::{located_in, named_tables, Problems, Table};
use tree::{Node, Spanned};

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

    /// The idle upstream connections one worker's pool keeps: every upstream's `keepalive`.
    pub fn keepalive_pool_size(&self) -> usize {
        self.upstreams
            .iter()
            .map(|u| u.keepalive)
            .sum::<usize>()
            .max(1)
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
    let (mut config, warnings) = read_sections(&root, &dir).map_err(|(problems, elsewhere)| {
        let mut errors = located(problems);
        errors.0.extend(elsewhere);
        errors
    })?;
    config.warnings = located(warnings).0;
    Ok(config)
}

/// The config and its warnings, or every problem; relative paths are read from `dir`.
#[allow(clippy::type_complexity)]
fn read_sections(
    root: &Spanned<Node>,
    dir: &Path,
) -> Result<(Config, Vec<(usize, String)>), (Vec<(usize, String)>, Vec<ConfigError>)> {
    let p = Problems::default();
    let config = build(&p, root, dir);
    let problems = p.0.into_inner();
    let elsewhere = p.2.into_inner();
    match config {
        Some(config) if problems.is_empty() && elsewhere.is_empty() => {
            Ok((config, p.1.into_inner()))
        }
        _ => Err((problems, elsewhere)),
    }
}

fn build(p: &Problems, root: &Spanned<Node>, dir: &Path) -> Option<Config> {
    let top = Table::new(p, "the config", root)?;
    let server = top.required("server").and_then(|n| server::server(p, n));
    let admin = match top.get("admin") {
        Some(n) => server::admin(p, n, dir),
        None => Some(Admin {
            listen: SocketAddr::from(([127, 0, 0, 1], 9091)),
            token: None,
            top_keys: Admin::DEFAULT_TOP_KEYS,
        }),
    };
    let limiter = match top.get("limiter") {
        Some(n) => limiter::limiter(p, n),
        None => Some(Limiter::default()),
    };
    let upstreams = named_tables(p, &top, "upstreams", |p, name, node| {
        upstreams::upstream(p, name, node, dir)
    });
    let mut policies = named_tables(p, &top, "policies", policies::policy);
    reject::read_bodies(
        p,
        policies.iter_mut().filter_map(|x| x.reject.as_mut()),
        dir,
    );
    let auth = match top.get("auth") {
        Some(n) => auth::auth(p, n, dir),
        None => Some(Auth::default()),
    };
    let mut seen = auth::Seen::default();
    let mut consumers = match top.get("consumers") {
        Some(n) => auth::consumers(p, n, &mut seen),
        None => Vec::new(),
    };
    if let Some(files) = top_key(&top, "auth", "consumer_files") {
        consumers.extend(auth::consumer_files(p, files, dir, &mut seen));
    }
    if let Some(max) = auth.as_ref().and_then(|a| a.max_failures) {
        if policies.iter().any(|x| x.name == AUTH_FAILURES) {
            p.at(
                &top_key_span(&top, "auth", "max_failures"),
                format!("`max_failures` counts with a policy named \"{AUTH_FAILURES}\"; rename the policy of that name"),
            );
        }
        policies.push(auth::failures_policy(max));
    }
    let mut routes = match top.required("routes") {
        Some(node) => {
            // A route with `auth` needs somewhere for credentials to come from.
            let credentials = auth
                .as_ref()
                .is_none_or(|a| !a.api_key.is_empty() || !a.jwt.is_empty());
            routes::routes(p, node, &upstreams, &policies, credentials)
        }
        None => Vec::new(),
    };
    let tls = match top.get("tls") {
        Some(n) => tls::tls(p, n, dir),
        None => Some(Tls::default()),
    };
    let rls = top
        .get("rls")
        .and_then(|n| rls::rls(p, n, dir, &mut policies, &mut routes));
    let certificates_node = top.get("certificates");
    let certificates = match certificates_node {
        Some(n) => tls::certificates(p, n, dir),
        None => Vec::new(),
    };
    let server = server?;
    if server.case_insensitive_paths {
        routes::ignore_path_case(&mut routes);
    }
    // Entries that failed their checks were reported already.
    let no_entries = match certificates_node.map(|n| &n.value) {
        Some(Node::Array(items)) => items.is_empty(),
        Some(_) => false,
        None => true,
    };
    if !server.tls_listen.is_empty() && no_entries {
        p.at(
            &top_key_span(&top, "server", "tls_listen"),
            "`tls_listen` needs at least one [[certificates]] entry",
        );
    }
    top.finish();
    Some(Config {
        server,
        admin: admin?,
        limiter: limiter?,
        upstreams,
        policies,
        routes,
        tls: tls?,
        certificates,
        auth: auth?,
        consumers,
        warnings: Vec::new(),
        rls,
    })
}

/// The node of `key` inside the top-level table `table`, if both are there.
fn top_key<'a>(top: &Table<'a>, table: &str, key: &str) -> Option<&'a Spanned<Node>> {
    let (_, node) = top.entries.iter().find(|(k, _)| k.value == table)?;
    let Node::Table(entries) = &node.value else {
        return None;
    };
    entries.iter().find(|(k, _)| k.value == key).map(|(_, v)| v)
}

/// The span of `key` inside the top-level table `table` (or of the table when absent).
fn top_key_span(top: &Table, table: &str, key: &str) -> Range<usize> {
    let Some(node) = top.entries.iter().find(|(k, _)| k.value == table) else {
        return top.span.clone();
    };
    match &node.1.value {
        Node::Table(entries) => entries
            .iter()
            .find(|(k, _)| k.value == key)
            .map_or(node.1.span.clone(), |(k, _)| k.span.clone()),
        _ => node.1.span.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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
}

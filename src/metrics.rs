//! Every metric family of DESIGN §5, registered once in one registry.

use prometheus::{
    exponential_buckets, Encoder, Gauge, GaugeVec, HistogramOpts, HistogramVec, IntCounter,
    IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

use std::collections::{HashMap, HashSet};

use crate::config::{AuthMode, Config, JwtKeys, Mode, Policy};

/// Every `decision` label value of `sluice_decisions_total` (`Decision::label`).
pub const DECISIONS: [&str; 9] = [
    "allowed",
    "rejected",
    "delayed",
    "shadow_rejected",
    "skipped",
    "exempt",
    "error_allowed",
    "error_denied",
    "banned",
];

/// Every `kind` label value of `sluice_backend_errors_total` (`BackendError::kind`).
pub const BACKEND_ERROR_KINDS: [&str; 4] = ["timeout", "connection", "script", "circuit_open"];

/// The admin API's endpoints (the `endpoint` label) and the status each answers on success.
pub const ADMIN_ENDPOINTS: [(&str, &str); 13] = [
    ("policies", "200"),
    ("summary", "200"),
    ("quota", "200"),
    ("reset", "204"),
    ("override_put", "200"),
    ("override_delete", "204"),
    ("overrides", "200"),
    ("top", "200"),
    ("consumers", "200"),
    ("consumer_put", "200"),
    ("consumer_delete", "204"),
    ("key_create", "201"),
    ("key_revoke", "204"),
];

pub struct Metrics {
    registry: Registry,
    pub http_requests: IntCounterVec,
    pub http_duration: HistogramVec,
    pub decisions: IntCounterVec,
    pub deny_cache_hits: IntCounterVec,
    /// `sluice_policy_units_total{route, policy, kind}`: units reserved at admission,
    /// charged and refunded once responses settle them (DESIGN §12).
    pub policy_units: IntCounterVec,
    /// `sluice_response_cost_missing_total{route, policy}`.
    pub response_cost_missing: IntCounterVec,
    pub limiter_duration: HistogramVec,
    pub backend_errors: IntCounterVec,
    pub backend_up: IntGaugeVec,
    pub upstream_duration: HistogramVec,
    pub config_reloads: IntCounterVec,
    /// `sluice_admin_requests_total{endpoint, status}` (DESIGN §9.2).
    pub admin_requests: IntCounterVec,
    pub build_info: GaugeVec,
    pub connections: IntGaugeVec,
    pub connections_rejected: IntCounterVec,
    pub tls_certificate_expiry: IntGaugeVec,
    pub requests_in_flight: IntGauge,
    pub near_limit: IntCounterVec,
    pub config_last_reload_successful: IntGauge,
    pub config_last_reload_timestamp: Gauge,
    pub memory_keys: IntGauge,
    pub memory_evictions: IntCounter,
    pub deny_cache_entries: IntGauge,
    pub policy_info: IntGaugeVec,
    pub upstream_health: IntGaugeVec,
    /// `sluice_auth_total{route, result}` (DESIGN §11).
    pub auth: IntCounterVec,
    pub jwks_up: IntGaugeVec,
    pub jwks_refresh_timestamp: GaugeVec,
    pub consumers: IntGaugeVec,
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

fn register<C: prometheus::core::Collector + Clone + 'static>(registry: &Registry, c: C) -> C {
    registry
        .register(Box::new(c.clone()))
        .expect("unique metric name");
    c
}

fn counter(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid counter definition");
    registry
        .register(Box::new(c.clone()))
        .expect("unique metric name");
    c
}

fn histogram(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
    buckets: Vec<f64>,
) -> HistogramVec {
    let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels)
        .expect("valid histogram");
    registry
        .register(Box::new(h.clone()))
        .expect("unique metric name");
    h
}

impl Metrics {
    pub fn new() -> Metrics {
        let r = Registry::new();
        // 100µs .. ~13s for requests; 50µs .. ~100ms for limiter decisions.
        let request_buckets = exponential_buckets(0.0001, 2.5, 14).expect("valid buckets");
        let limiter_buckets = exponential_buckets(0.00005, 2.0, 12).expect("valid buckets");
        let up = IntGaugeVec::new(
            Opts::new(
                "sluice_backend_up",
                "1 when the limiter backend answered its last call",
            ),
            &["backend"],
        )
        .expect("valid gauge");
        r.register(Box::new(up.clone()))
            .expect("unique metric name");
        let build = GaugeVec::new(
            Opts::new("sluice_build_info", "sluice version"),
            &["version"],
        )
        .expect("valid gauge");
        r.register(Box::new(build.clone()))
            .expect("unique metric name");
        build
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1.0);
        let connections = IntGaugeVec::new(
            Opts::new("sluice_connections", "Open client connections"),
            &["protocol"],
        )
        .expect("valid gauge");
        r.register(Box::new(connections.clone()))
            .expect("unique metric name");
        let connections_rejected = counter(
            &r,
            "sluice_connections_rejected_total",
            "Client connections closed by a bound: per_ip cap, header_timeout, body_timeout",
            &["reason"],
        );
        // Every series exists at 0 from start-up, so rate() sees the first event.
        for protocol in ["http1", "h2"] {
            connections.with_label_values(&[protocol]).set(0);
        }
        for reason in ["per_ip", "header_timeout", "body_timeout"] {
            connections_rejected.with_label_values(&[reason]).reset();
        }
        let expiry = IntGaugeVec::new(
            Opts::new(
                "sluice_tls_certificate_expiry_timestamp_seconds",
                "Unix time of the notAfter of each [[certificates]] entry, named by its first host",
            ),
            &["certificate"],
        )
        .expect("valid gauge");
        r.register(Box::new(expiry.clone()))
            .expect("unique metric name");
        let gauge =
            |name: &str, help: &str| register(&r, IntGauge::new(name, help).expect("valid gauge"));
        let requests_in_flight = gauge(
            "sluice_requests_in_flight",
            "Requests being handled now, from the request header to the end of logging",
        );
        let config_last_reload_successful = gauge(
            "sluice_config_last_reload_successful",
            "1 when the last config load (start-up or SIGHUP) succeeded, 0 when it was rejected",
        );
        config_last_reload_successful.set(1);
        let config_last_reload_timestamp = register(
            &r,
            Gauge::new(
                "sluice_config_last_reload_timestamp_seconds",
                "Unix time of the last successful config load (start-up or SIGHUP)",
            )
            .expect("valid gauge"),
        );
        config_last_reload_timestamp.set(unix_now());
        let memory_keys = gauge(
            "sluice_memory_keys",
            "Keys the memory backend tracks now (the store, or the on_error = local fallback)",
        );
        let memory_evictions = register(
            &r,
            IntCounter::new(
                "sluice_memory_evictions_total",
                "Keys the memory backend dropped before they expired because it held max_keys",
            )
            .expect("valid counter"),
        );
        let deny_cache_entries = gauge(
            "sluice_deny_cache_entries",
            "Over-limit keys in the local deny cache now",
        );
        // CPU, resident memory, open and max fds, threads, start time (Linux only).
        #[cfg(target_os = "linux")]
        r.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))
        .expect("unique metric name");
        let config_reloads = counter(
            &r,
            "sluice_config_reloads_total",
            "Config reloads",
            &["result"],
        );
        for result in ["success", "failure"] {
            config_reloads.with_label_values(&[result]).reset();
        }
        let admin_requests = counter(
            &r,
            "sluice_admin_requests_total",
            "Calls of the admin API (/v1/), by endpoint and status",
            &["endpoint", "status"],
        );
        // What a dashboard plots from the start: every endpoint's success and refusals.
        for (endpoint, ok) in ADMIN_ENDPOINTS {
            for status in [ok, "400", "401", "403", "404"] {
                admin_requests
                    .with_label_values(&[endpoint, status])
                    .reset();
            }
        }
        let upstream_health = IntGaugeVec::new(
            Opts::new(
                "sluice_upstream_health",
                "1 when an upstream server is healthy (active and passive checks), 0 when it is down",
            ),
            &["upstream", "server"],
        )
        .expect("valid gauge");
        r.register(Box::new(upstream_health.clone()))
            .expect("unique metric name");
        let gauges = |name: &str, help: &str, label: &str| {
            register(
                &r,
                IntGaugeVec::new(Opts::new(name, help), &[label]).expect("valid gauge"),
            )
        };
        let jwks_up = gauges(
            "sluice_jwks_up",
            "1 when an issuer's key set is in force (a jwks_url fetched at least once and the last fetch succeeded), else 0",
            "issuer",
        );
        let consumers = gauges(
            "sluice_consumers",
            "Consumers known now, from the config (and its consumer_files) or the admin API (runtime)",
            "source",
        );
        let jwks_refresh_timestamp = register(
            &r,
            GaugeVec::new(
                Opts::new(
                    "sluice_jwks_refresh_timestamp_seconds",
                    "Unix time of the last successful fetch of an issuer's jwks_url",
                ),
                &["issuer"],
            )
            .expect("valid gauge"),
        );
        Metrics {
            auth: counter(
                &r,
                "sluice_auth_total",
                "Requests on routes with auth, by outcome: ok, anonymous, missing, invalid, banned (max_failures), unavailable (no key set)",
                &["route", "result"],
            ),
            jwks_up,
            jwks_refresh_timestamp,
            consumers,
            http_requests: counter(
                &r,
                "sluice_http_requests_total",
                "HTTP requests answered, by client protocol (http1 | h2)",
                &["protocol", "route", "status"],
            ),
            http_duration: histogram(
                &r,
                "sluice_http_request_duration_seconds",
                "Time from request to response end",
                &["route"],
                request_buckets.clone(),
            ),
            decisions: counter(
                &r,
                "sluice_decisions_total",
                "Rate-limit decisions per policy",
                &["route", "policy", "decision"],
            ),
            deny_cache_hits: counter(
                &r,
                "sluice_deny_cache_hits_total",
                "Requests rejected from the local cache of over-limit keys",
                &["policy"],
            ),
            policy_units: counter(
                &r,
                "sluice_policy_units_total",
                "Units of policies charged from responses: reserved at admission, then charged or refunded",
                &["route", "policy", "kind"],
            ),
            response_cost_missing: counter(
                &r,
                "sluice_response_cost_missing_total",
                "Responses of metered policies without a usable cost",
                &["route", "policy"],
            ),
            limiter_duration: histogram(
                &r,
                "sluice_limiter_duration_seconds",
                "Time to decide one request's policies",
                &["backend"],
                limiter_buckets,
            ),
            backend_errors: counter(
                &r,
                "sluice_backend_errors_total",
                "Limiter backend failures",
                &["backend", "kind"],
            ),
            backend_up: up,
            upstream_duration: histogram(
                &r,
                "sluice_upstream_duration_seconds",
                "Time from choosing an upstream to the end of its response",
                &["upstream"],
                request_buckets,
            ),
            config_reloads,
            admin_requests,
            near_limit: counter(
                &r,
                "sluice_near_limit_total",
                "Allowed decisions that left less than 20% of the policy's quota",
                &["route", "policy"],
            ),
            build_info: build,
            connections,
            connections_rejected,
            tls_certificate_expiry: expiry,
            requests_in_flight,
            config_last_reload_successful,
            config_last_reload_timestamp,
            memory_keys,
            memory_evictions,
            deny_cache_entries,
            policy_info: register(
                &r,
                IntGaugeVec::new(
                    Opts::new(
                        "sluice_policy_info",
                        "1 for each configured policy: its algorithm and mode (enforce or shadow)",
                    ),
                    &["policy", "algorithm", "mode"],
                )
                .expect("valid gauge"),
            ),
            upstream_health,
            registry: r,
        }
    }

    /// Creates at 0 every series `config` determines, and removes those only `previous` had,
    /// so `rate()` and `increase()` see the first event of each (DESIGN §5).
    pub fn prime(&self, config: &Config, previous: Option<&Config>, backend: &str) {
        // (route label, policy) pairs and the decisions each can produce: maps, since
        // thousands of routes may share one label (`metrics_as`).
        let series = |c: &Config| -> HashMap<(String, String), Vec<&'static str>> {
            let mut out: HashMap<(String, String), Vec<&'static str>> = HashMap::new();
            for r in &c.routes {
                for &p in &r.policies {
                    let policy = &c.policies[p];
                    let decisions = out
                        .entry((r.label().to_owned(), policy.name.clone()))
                        .or_default();
                    for d in policy.possible_decisions(&c.limiter.backend, c.limiter.on_error) {
                        if !decisions.contains(&d) {
                            decisions.push(d);
                        }
                    }
                }
            }
            out
        };
        let now = series(config);
        for ((route, policy), decisions) in &now {
            for decision in decisions {
                self.decisions
                    .with_label_values(&[route.as_str(), policy.as_str(), decision])
                    .inc_by(0);
            }
            self.near_limit
                .with_label_values(&[route, policy])
                .inc_by(0);
        }
        if let Some(previous) = previous {
            for policy in &previous.policies {
                let _ = self.policy_info.remove_label_values(&policy_labels(policy));
            }
        }
        for policy in &config.policies {
            self.policy_info
                .with_label_values(&policy_labels(policy))
                .set(1);
            self.deny_cache_hits
                .with_label_values(&[&policy.name])
                .inc_by(0);
        }
        for route in config.routes.iter().filter(|r| r.auth != AuthMode::Off) {
            for result in AUTH_RESULTS {
                self.auth
                    .with_label_values(&[&route.name, result])
                    .inc_by(0);
            }
        }
        for issuer in &config.auth.jwt {
            if !matches!(issuer.keys, JwtKeys::Url(_)) {
                self.jwks_up.with_label_values(&[&issuer.issuer]).set(1);
            }
        }
        self.consumers
            .with_label_values(&["config"])
            .set(config.consumers.len() as i64);
        for kind in BACKEND_ERROR_KINDS {
            self.backend_errors
                .with_label_values(&[backend, kind])
                .inc_by(0);
        }
        let Some(previous) = previous else { return };
        let authed = |c: &Config| -> HashSet<String> {
            c.routes
                .iter()
                .filter(|r| r.auth != AuthMode::Off)
                .map(|r| r.label().to_owned())
                .collect()
        };
        let still = authed(config);
        for label in authed(previous).difference(&still) {
            for result in AUTH_RESULTS {
                let _ = self.auth.remove_label_values(&[label, result]);
            }
        }
        for issuer in &previous.auth.jwt {
            if !config.auth.jwt.iter().any(|i| i.issuer == issuer.issuer) {
                let _ = self.jwks_up.remove_label_values(&[&issuer.issuer]);
                let _ = self
                    .jwks_refresh_timestamp
                    .remove_label_values(&[&issuer.issuer]);
            }
        }
        for (route, policy) in series(previous).into_keys() {
            let kept = now.get(&(route.clone(), policy.clone()));
            for decision in DECISIONS {
                // Gone, or no longer possible: a series that moved late goes too.
                if kept.is_some_and(|d| d.contains(&decision)) {
                    continue;
                }
                let _ = self
                    .decisions
                    .remove_label_values(&[&route, &policy, decision]);
            }
            if kept.is_none() {
                let _ = self.near_limit.remove_label_values(&[&route, &policy]);
            }
        }
        for policy in &previous.policies {
            if !config.policies.iter().any(|p| p.name == policy.name) {
                let _ = self.deny_cache_hits.remove_label_values(&[&policy.name]);
            }
        }
    }

    /// Records the result of a config load attempt (start-up or SIGHUP).
    pub fn config_loaded(&self, ok: bool) {
        self.config_last_reload_successful.set(i64::from(ok));
        if ok {
            self.config_last_reload_timestamp.set(unix_now());
        }
    }

    /// The Prometheus text exposition of every family.
    pub fn render(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 * 1024);
        // Encoding into a Vec cannot fail for well-formed families.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        out
    }
}

fn policy_labels(policy: &Policy) -> [&str; 3] {
    let mode = match policy.mode {
        Mode::Enforce => "enforce",
        Mode::Shadow => "shadow",
    };
    [&policy.name, policy.algorithm.name(), mode]
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;

    fn config(extra: &str) -> Config {
        let text = format!(
            r#"
[server]
listen = ["127.0.0.1:8080"]

[policies.per_ip]
algorithm = "gcra"
limit = 10
period = "1s"
key = ["client_ip"]

[policies.watch]
algorithm = "fixed_window"
limit = 10
period = "1s"
key = []
mode = "shadow"

[[routes]]
name = "api"
path = "/api"
respond = {{ status = 200, body = "ok" }}
policies = ["per_ip", "watch"]
{extra}
"#
        );
        match config::parse("test.toml", &text) {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        }
    }

    fn scrape(m: &Metrics) -> String {
        String::from_utf8(m.render()).unwrap_or_default()
    }

    #[test]
    fn every_series_the_config_determines_starts_at_zero() {
        let m = Metrics::new();
        m.prime(&config(""), None, "redis");
        let text = scrape(&m);
        for decision in ["allowed", "shadow_rejected"] {
            let line = format!(
                "sluice_decisions_total{{decision=\"{decision}\",policy=\"watch\",route=\"api\"}} 0"
            );
            assert!(text.contains(&line), "{line} missing");
        }
        for want in [
            "sluice_near_limit_total{policy=\"per_ip\",route=\"api\"} 0",
            "sluice_config_reloads_total{result=\"failure\"} 0",
            "sluice_config_reloads_total{result=\"success\"} 0",
            "sluice_backend_errors_total{backend=\"redis\",kind=\"circuit_open\"} 0",
            "sluice_deny_cache_hits_total{policy=\"watch\"} 0",
            "sluice_policy_info{algorithm=\"fixed_window\",mode=\"shadow\",policy=\"watch\"} 1",
            "sluice_config_last_reload_successful 1",
            "sluice_requests_in_flight 0",
        ] {
            assert!(text.contains(want), "{want} missing");
        }
    }

    #[test]
    fn a_reload_adds_new_series_at_zero_and_drops_removed_ones() {
        let m = Metrics::new();
        let old = config("");
        m.prime(&old, None, "memory");
        let extra = r#"
[policies.fresh]
algorithm = "fixed_window"
limit = 5
period = "1s"
key = []

[[routes]]
name = "extra"
path = "/extra"
respond = { status = 200, body = "ok" }
policies = ["fresh"]
"#;
        let new = config(extra);
        m.prime(&new, Some(&old), "memory");
        let text = scrape(&m);
        assert!(text.contains(
            "sluice_decisions_total{decision=\"allowed\",policy=\"fresh\",route=\"extra\"} 0"
        ));
        m.prime(&old, Some(&new), "memory");
        let text = scrape(&m);
        assert!(!text.contains("route=\"extra\""), "{text}");
        assert!(!text.contains("policy=\"fresh\""), "{text}");
        assert!(text.contains("policy=\"watch\""));
    }

    /// DESIGN §16: a policy is primed for the decisions its settings can produce, and
    /// routes sharing a `metrics_as` label share its series.
    #[test]
    fn series_exist_only_where_they_can_move() {
        let text = r#"
[server]
listen = ["127.0.0.1:8080"]
[limiter]
backend = "redis"
url = "redis://127.0.0.1:6379"
on_error = "deny"
[policies.plain]
algorithm = "gcra"
limit = 10
period = "1s"
key = ["client_ip"]
on_error = "allow"
[policies.every]
algorithm = "token_bucket"
limit = 10
period = "1s"
key = ["header:x-user"]
on_exceed = "delay"
max_delay = "1s"
exempt = ["10.0.0.0/8"]
ban = "1m"
[policies.shared]
algorithm = "fixed_window"
limit = 10
period = "1s"
key = ["header:x-user"]
on_missing = "shared"
[[routes]]
name = "tenant-1"
hosts = ["one.example"]
metrics_as = "tenants"
respond = { status = 200 }
policies = ["plain", "every", "shared"]
[[routes]]
name = "tenant-2"
hosts = ["two.example"]
metrics_as = "tenants"
respond = { status = 200 }
policies = ["plain"]
"#;
        let config = config::parse("t.toml", text).unwrap_or_else(|e| panic!("{e}"));
        let m = Metrics::new();
        m.prime(&config, None, "redis");
        let scraped = scrape(&m);
        let series = |policy: &str| -> Vec<String> {
            let mut found: Vec<String> = scraped
                .lines()
                .filter(|l| l.starts_with("sluice_decisions_total{"))
                .filter(|l| l.contains(&format!("policy=\"{policy}\"")))
                .map(|l| {
                    assert!(l.contains("route=\"tenants\""), "{l}");
                    l.split("decision=\"")
                        .nth(1)
                        .and_then(|r| r.split('"').next())
                        .unwrap_or("")
                        .to_owned()
                })
                .collect();
            found.sort();
            found
        };
        assert_eq!(series("plain"), ["allowed", "error_allowed", "rejected"]);
        assert_eq!(
            series("every"),
            [
                "allowed",
                "banned",
                "delayed",
                "error_denied",
                "exempt",
                "rejected",
                "skipped"
            ]
        );
        assert_eq!(series("shared"), ["allowed", "error_denied", "rejected"]);
        assert!(!scraped.contains("tenant-1"), "{scraped}");
    }

    #[test]
    fn process_families_are_exported() {
        let text = scrape(&Metrics::new());
        for family in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
        ] {
            assert!(text.contains(&format!("# TYPE {family} ")), "{family}");
        }
    }
}

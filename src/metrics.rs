//! Every metric family of DESIGN §5, registered once in one registry, and their rendering.
//! The series a config determines are primed by their owners (`limiter::series`,
//! `auth::prime_metrics`); the ones fixed at start-up are primed here.

use prometheus::{
    exponential_buckets, Encoder, Gauge, GaugeVec, HistogramOpts, HistogramVec, IntCounter,
    IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

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
    /// `sluice_prefetch_units_total{route, policy, kind}`: units taken ahead from Redis,
    /// used, returned and dropped (DESIGN §19).
    pub prefetch_units: IntCounterVec,
    pub limiter_duration: HistogramVec,
    pub backend_errors: IntCounterVec,
    pub backend_up: IntGaugeVec,
    pub upstream_duration: HistogramVec,
    /// `sluice_upstream_retries_total{upstream, reason}` (DESIGN §20), primed by `retry`.
    pub upstream_retries: IntCounterVec,
    pub config_reloads: IntCounterVec,
    /// `sluice_admin_requests_total{endpoint, status}` (DESIGN §9.2).
    pub admin_requests: IntCounterVec,
    pub build_info: GaugeVec,
    pub connections: IntGaugeVec,
    pub connections_rejected: IntCounterVec,
    /// `sluice_requests_denied_total`: requests answered 403 by `[server] deny` (DESIGN §20).
    pub requests_denied: IntCounter,
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
    /// `sluice_upstream_resolve_total{upstream, result}`: re-resolutions of an upstream with
    /// `resolve` (DESIGN §20), `result` = changed, unchanged or error.
    pub upstream_resolves: IntCounterVec,
    /// `sluice_auth_total{route, result}` (DESIGN §11).
    pub auth: IntCounterVec,
    pub jwks_up: IntGaugeVec,
    pub jwks_refresh_timestamp: GaugeVec,
    pub consumers: IntGaugeVec,
    /// `[upstreams.NAME.adaptive]` (DESIGN §22): the learnt limit, the requests in flight
    /// against it and the best latency, read at scrape time; requests shed, by plan.
    pub upstream_concurrency_limit: IntGaugeVec,
    pub upstream_in_flight: IntGaugeVec,
    pub upstream_latency_best: GaugeVec,
    pub shed: IntCounterVec,
}

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
        config_last_reload_timestamp.set(crate::clock::unix_secs());
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
        let requests_denied = register(
            &r,
            IntCounter::new(
                "sluice_requests_denied_total",
                "Requests answered 403 because their client address is in [server] deny",
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
        let upstream_concurrency_limit = gauges(
            "sluice_upstream_concurrency_limit",
            "An adaptive upstream's concurrency limit on this instance, learnt from its latency",
            "upstream",
        );
        let upstream_in_flight = gauges(
            "sluice_upstream_in_flight",
            "Requests in flight to an adaptive upstream on this instance (WebSocket sessions while open)",
            "upstream",
        );
        let upstream_latency_best = register(
            &r,
            GaugeVec::new(
                Opts::new(
                    "sluice_upstream_latency_best_seconds",
                    "An adaptive upstream's best latency (p90 of its last probe window at min_limit), request start to response header",
                ),
                &["upstream"],
            )
            .expect("valid gauge"),
        );
        Metrics {
            upstream_concurrency_limit,
            upstream_in_flight,
            upstream_latency_best,
            shed: counter(
                &r,
                "sluice_shed_total",
                "Requests refused 503 to protect an adaptive upstream (no slot within its queue), by plan",
                &["upstream", "plan"],
            ),
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
            prefetch_units: counter(
                &r,
                "sluice_prefetch_units_total",
                "Units of prefetch policies taken ahead from the backend, then used, returned or dropped",
                &["route", "policy", "kind"],
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
            upstream_retries: counter(
                &r,
                "sluice_upstream_retries_total",
                "Requests tried again on an upstream, by reason (connect, reset, 502, 503, 504)",
                &["upstream", "reason"],
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
            requests_denied,
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
            upstream_resolves: register(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "sluice_upstream_resolve_total",
                        "Re-resolutions of an upstream's server names (resolve), by result: changed, unchanged or error",
                    ),
                    &["upstream", "result"],
                )
                .expect("valid counter"),
            ),
            registry: r,
        }
    }

    /// Records the result of a config load attempt (start-up or SIGHUP).
    pub fn config_loaded(&self, ok: bool) {
        self.config_last_reload_successful.set(i64::from(ok));
        if ok {
            self.config_last_reload_timestamp
                .set(crate::clock::unix_secs());
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

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_families_are_exported() {
        let text = String::from_utf8(Metrics::new().render()).unwrap_or_default();
        for family in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
        ] {
            assert!(text.contains(&format!("# TYPE {family} ")), "{family}");
        }
    }
}

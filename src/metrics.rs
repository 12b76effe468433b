//! Every metric family of DESIGN §5, registered once in one registry.

use prometheus::{
    exponential_buckets, Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounterVec,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

pub struct Metrics {
    registry: Registry,
    pub http_requests: IntCounterVec,
    pub http_duration: HistogramVec,
    pub decisions: IntCounterVec,
    pub deny_cache_hits: IntCounterVec,
    pub limiter_duration: HistogramVec,
    pub backend_errors: IntCounterVec,
    pub backend_up: IntGaugeVec,
    pub upstream_duration: HistogramVec,
    pub config_reloads: IntCounterVec,
    pub build_info: GaugeVec,
    pub connections: IntGaugeVec,
    pub connections_rejected: IntCounterVec,
    pub tls_certificate_expiry: IntGaugeVec,
    pub upstream_health: IntGaugeVec,
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
        Metrics {
            http_requests: counter(
                &r,
                "sluice_http_requests_total",
                "HTTP requests answered",
                &["route", "status"],
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
            config_reloads: counter(
                &r,
                "sluice_config_reloads_total",
                "Config reloads",
                &["result"],
            ),
            build_info: build,
            connections,
            connections_rejected,
            tls_certificate_expiry: expiry,
            upstream_health,
            registry: r,
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

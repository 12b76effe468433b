//! `GET /v1/summary` (DESIGN §15): what the console shows in one read, from the config and
//! the counters the proxy already keeps; nothing is counted here that the proxy does not.

use std::collections::HashMap;

use prometheus::core::Collector;
use prometheus::IntCounterVec;
use serde_json::{json, Value};

use super::Answer;
use crate::gateway::{App, Gateway};

/// Decisions a policy counts as refusing a request (DESIGN §5).
const REFUSING: [&str; 3] = ["rejected", "banned", "error_denied"];

/// Sums of `vec`'s series by the value of `label`, for the series `keep` accepts (it is given
/// each series' labels).
fn sums(
    vec: &IntCounterVec,
    label: &str,
    keep: impl Fn(&HashMap<&str, &str>) -> bool,
) -> HashMap<String, u64> {
    let mut out: HashMap<String, u64> = HashMap::new();
    for family in vec.collect() {
        for metric in family.get_metric() {
            let labels: HashMap<&str, &str> = metric
                .get_label()
                .iter()
                .map(|l| (l.name(), l.value()))
                .collect();
            if !keep(&labels) {
                continue;
            }
            if let Some(value) = labels.get(label) {
                *out.entry((*value).to_owned()).or_default() +=
                    metric.get_counter().get_value() as u64;
            }
        }
    }
    out
}

pub fn summary(app: &App, gateway: &Gateway) -> Answer {
    let m = &app.metrics;
    let config = &gateway.config;
    let requests = sums(&m.http_requests, "route", |_| true);
    let limited = sums(&m.http_requests, "route", |l| {
        l.get("status") == Some(&"429")
    });
    let errors = sums(&m.http_requests, "route", |l| {
        l.get("status").is_some_and(|s| s.starts_with('5'))
    });
    let allowed = sums(&m.decisions, "policy", |l| {
        l.get("decision") == Some(&"allowed")
    });
    let refused = sums(&m.decisions, "policy", |l| {
        l.get("decision").is_some_and(|d| REFUSING.contains(d))
    });

    // Routes counted under one label (`metrics_as`) are one row, in config order.
    let mut order: Vec<&str> = Vec::new();
    let mut rows: HashMap<&str, (usize, Vec<&str>)> = HashMap::new();
    for route in &config.routes {
        let label = route.label();
        let row = rows.entry(label).or_insert_with(|| {
            order.push(label);
            (0, Vec::new())
        });
        row.0 += 1;
        for &p in &route.policies {
            let name = config.policies[p].name.as_str();
            if !row.1.contains(&name) {
                row.1.push(name);
            }
        }
    }
    let count = |map: &HashMap<String, u64>, key: &str| map.get(key).copied().unwrap_or(0);
    let routes: Vec<Value> = order
        .iter()
        .map(|label| {
            let (n, policies) = &rows[label];
            json!({
                "route": label,
                "routes": n,
                "policies": policies,
                "requests": count(&requests, label),
                "rejected": count(&limited, label),
                "errors": count(&errors, label),
            })
        })
        .collect();

    let policies: Vec<Value> = config
        .policies
        .iter()
        .map(|p| {
            json!({
                "name": p.name,
                "allowed": count(&allowed, &p.name),
                "rejected": count(&refused, &p.name),
                "runtime_overrides": gateway.limiter.overrides(p).len(),
            })
        })
        .collect();

    let upstreams: Vec<Value> = gateway
        .upstreams
        .iter()
        .map(|upstream| {
            let pool = &upstream.pool;
            let name = pool.config.name.as_str();
            let servers: Vec<Value> = pool
                .servers
                .iter()
                .map(|s| {
                    let health = m
                        .upstream_health
                        .get_metric_with_label_values(&[name, s.name.as_str()])
                        .map(|g| g.get())
                        .unwrap_or(0);
                    json!({"server": s.name, "address": s.addr.to_string(), "healthy": health == 1})
                })
                .collect();
            // `adaptive` (DESIGN §22): the learnt limit and what is in flight against it.
            let adaptive = upstream.adaptive.as_ref().map(|gate| {
                let cfg = gate.config();
                json!({
                    "limit": gate.limit(),
                    "in_flight": gate.in_flight(),
                    "best_ms": gate.best().map(|b| b.as_secs_f64() * 1000.0),
                    "min_limit": cfg.min_limit,
                    "max_limit": cfg.max_limit,
                })
            });
            json!({
                "name": name,
                "health_check": pool.config.health_check.is_some(),
                "servers": servers,
                "adaptive": adaptive,
            })
        })
        .collect();

    let certificates: Vec<Value> = config
        .certificates
        .iter()
        .map(|c| {
            json!({
                "name": c.name,
                "hosts": c.hosts.len(),
                "not_after": c.not_after,
            })
        })
        .collect();

    let reloads = |result: &str| m.config_reloads.with_label_values(&[result]).get();
    let last = m.config_last_reload_timestamp.get();
    Answer::json(
        200,
        json!({
            "version": env!("CARGO_PKG_VERSION"),
            "now": crate::clock::unix_secs(),
            "config": app.config_path.display().to_string(),
            "backend": gateway.limiter.backend_name(),
            "reload": {
                "last_successful": m.config_last_reload_successful.get() == 1,
                "last_success_at": if last > 0.0 { json!(last) } else { Value::Null },
                "successes": reloads("success"),
                "failures": reloads("failure"),
            },
            "routes": routes,
            "policies": policies,
            "upstreams": upstreams,
            "certificates": certificates,
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::Opts;

    #[test]
    fn sums_add_the_kept_series_by_one_label() {
        let vec = IntCounterVec::new(Opts::new("t", "t"), &["route", "status"]).expect("vec");
        vec.with_label_values(&["a", "200"]).inc_by(5);
        vec.with_label_values(&["a", "429"]).inc_by(2);
        vec.with_label_values(&["b", "429"]).inc_by(7);
        vec.with_label_values(&["c", "200"]).inc_by(0);
        let all = sums(&vec, "route", |_| true);
        assert_eq!((all["a"], all["b"], all["c"]), (7, 7, 0));
        let limited = sums(&vec, "route", |l| l.get("status") == Some(&"429"));
        assert_eq!((limited["a"], limited["b"]), (2, 7));
        assert!(!limited.contains_key("c"));
        assert!(sums(&vec, "nope", |_| true).is_empty());
    }
}

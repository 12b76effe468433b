//! The limiter's metric series for one config, primed at 0 (DESIGN §5, §16): decisions and
//! near-limit per (route label, policy), `policy_info`, deny-cache hits per policy and backend
//! errors per kind; the series only a previous config had are removed.

use std::collections::HashMap;

use super::backend::BACKEND_ERROR_KINDS;
use super::DECISIONS;
use crate::config::{Algorithm, Backend, Config, KeyPart, Mode, OnError, OnMissing, Policy};
use crate::metrics::Metrics;

/// Creates at 0 every limiter series `config` determines, and removes those only `previous`
/// had, so `rate()` and `increase()` see the first event of each (DESIGN §5). `backend` is
/// the `backend` label (`Limiter::backend_name`).
pub fn prime_metrics(metrics: &Metrics, config: &Config, previous: Option<&Config>, backend: &str) {
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
                for d in possible_decisions(policy, &c.limiter.backend, c.limiter.on_error) {
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
            metrics
                .decisions
                .with_label_values(&[route.as_str(), policy.as_str(), decision])
                .inc_by(0);
        }
        metrics
            .near_limit
            .with_label_values(&[route, policy])
            .inc_by(0);
    }
    if let Some(previous) = previous {
        for policy in &previous.policies {
            let _ = metrics
                .policy_info
                .remove_label_values(&policy_labels(policy));
        }
    }
    for policy in &config.policies {
        metrics
            .policy_info
            .with_label_values(&policy_labels(policy))
            .set(1);
        metrics
            .deny_cache_hits
            .with_label_values(&[&policy.name])
            .inc_by(0);
    }
    for kind in BACKEND_ERROR_KINDS {
        metrics
            .backend_errors
            .with_label_values(&[backend, kind])
            .inc_by(0);
    }
    let Some(previous) = previous else { return };
    for (route, policy) in series(previous).into_keys() {
        let kept = now.get(&(route.clone(), policy.clone()));
        for decision in DECISIONS {
            // Gone, or no longer possible: a series that moved late goes too.
            if kept.is_some_and(|d| d.contains(&decision)) {
                continue;
            }
            let _ = metrics
                .decisions
                .remove_label_values(&[&route, &policy, decision]);
        }
        if kept.is_none() {
            let _ = metrics.near_limit.remove_label_values(&[&route, &policy]);
        }
    }
    for policy in &previous.policies {
        if !config.policies.iter().any(|p| p.name == policy.name) {
            let _ = metrics.deny_cache_hits.remove_label_values(&[&policy.name]);
        }
    }
}

/// The labels of `sluice_policy_info`: name, algorithm, mode.
fn policy_labels(policy: &Policy) -> [&str; 3] {
    let mode = match policy.mode {
        Mode::Enforce => "enforce",
        Mode::Shadow => "shadow",
    };
    [&policy.name, policy.algorithm.name(), mode]
}

/// The decisions this policy's settings can produce on `backend` (DESIGN §16): only
/// their series are primed at 0, so a config's metrics grow with what can move.
pub fn possible_decisions(
    policy: &Policy,
    backend: &Backend,
    default_on_error: OnError,
) -> Vec<&'static str> {
    let enforce = policy.mode == Mode::Enforce;
    let mut out = vec![
        "allowed",
        if enforce {
            "rejected"
        } else {
            "shadow_rejected"
        },
    ];
    if policy.delay.is_some() || policy.algorithm == Algorithm::LeakyBucket {
        out.push("delayed");
    }
    let can_miss = policy.key.iter().any(|p| {
        matches!(
            p,
            KeyPart::Header(_)
                | KeyPart::Query(_)
                | KeyPart::Cookie(_)
                | KeyPart::ClientCert
                | KeyPart::Consumer
                | KeyPart::Plan
                | KeyPart::Claim(_)
        )
    });
    if can_miss && policy.on_missing == OnMissing::Skip {
        out.push("skipped");
    }
    if !policy.exempt.is_empty() {
        out.push("exempt");
    }
    if *backend != Backend::Memory {
        match policy.on_error.unwrap_or(default_on_error) {
            OnError::Allow => out.push("error_allowed"),
            OnError::Deny => out.push("error_denied"),
            OnError::Local => {}
        }
    }
    if enforce && !policy.ban.is_zero() {
        out.push("banned");
    }
    out
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
        prime_metrics(&m, &config(""), None, "redis");
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
        prime_metrics(&m, &old, None, "memory");
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
        prime_metrics(&m, &new, Some(&old), "memory");
        let text = scrape(&m);
        assert!(text.contains(
            "sluice_decisions_total{decision=\"allowed\",policy=\"fresh\",route=\"extra\"} 0"
        ));
        prime_metrics(&m, &old, Some(&new), "memory");
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
        prime_metrics(&m, &config, None, "redis");
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
}

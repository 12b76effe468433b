//! Routing by index through the real binary (DESIGN §16): first-match order on a mixed
//! config, and ten thousand tenant routes counted under one `metrics_as` label with a small
//! scrape. (`src/routing/index.rs` compares the index with the plain scan on random configs.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::Sluice;

/// Each route answers with its own name, so a response says which route matched.
fn route(name: &str, matchers: &str) -> String {
    format!(
        "[[routes]]\nname = \"{name}\"\n{matchers}\nrespond = {{ status = 200, body = \"{name}\" }}\n"
    )
}

fn answered(s: &Sluice, host: &str, method: &str, path: &str) -> String {
    let raw = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    let r = common::http::parse(&common::http::send_raw(s.addr, raw.as_bytes()).expect("request"));
    if r.status == 404 {
        return "404".into();
    }
    r.body
}

#[test]
fn the_first_matching_route_answers_on_a_mixed_config() {
    let mut config = String::from(
        "[server]\nlisten = [\"{listen}\"]\naccess_log = \"off\"\n[admin]\nlisten = \"{admin}\"\n",
    );
    for (name, matchers) in [
        (
            "users_regex",
            "path_regex = \"^/users/[0-9]+$\"\nmethods = [\"DELETE\"]",
        ),
        (
            "api_exact_host",
            "hosts = [\"api.example.com\"]\npath_prefix = \"/v1/\"",
        ),
        (
            "wild_v1",
            "hosts = [\"*.example.com\"]\npath_prefix = \"/v1/\"",
        ),
        ("deep_wild", "hosts = [\"*.eu.example.com\"]"),
        ("health", "path = \"/healthz\""),
        ("v1_post", "path_prefix = \"/v1/\"\nmethods = [\"POST\"]"),
        ("v1_users", "path_prefix = \"/v1/users/\""),
        ("users_any", "path_regex = \"^/users/\""),
        ("catch_all", ""),
    ] {
        config.push_str(&route(name, matchers));
    }
    let s = Sluice::start(&config);
    for (host, method, path, want) in [
        ("api.example.com", "GET", "/v1/users/7", "api_exact_host"),
        ("API.Example.com:8080", "POST", "/v1/x", "api_exact_host"),
        ("a.example.com", "GET", "/v1/x", "wild_v1"),
        ("a.eu.example.com", "GET", "/v1/x", "wild_v1"),
        ("a.eu.example.com", "GET", "/v2/x", "deep_wild"),
        ("eu.example.com", "GET", "/v2/x", "catch_all"),
        ("example.com", "GET", "/v1/x", "catch_all"),
        ("other.test", "GET", "/healthz", "health"),
        ("a.eu.example.com", "GET", "/healthz", "deep_wild"),
        ("other.test", "POST", "/v1/users/7", "v1_post"),
        ("other.test", "GET", "/v1/users/7", "v1_users"),
        ("other.test", "DELETE", "/users/42", "users_regex"),
        ("other.test", "GET", "/users/42", "users_any"),
        ("other.test", "GET", "/v1", "catch_all"),
    ] {
        assert_eq!(
            answered(&s, host, method, path),
            want,
            "{method} {host}{path}"
        );
    }
}

#[test]
fn ten_thousand_tenant_routes_share_one_label_and_a_small_scrape() {
    let mut config = String::from(
        "[server]\nlisten = [\"{listen}\"]\naccess_log = \"off\"\n[admin]\nlisten = \"{admin}\"\n\
         [policies.per_ip]\nalgorithm = \"gcra\"\nlimit = 1000000\nperiod = \"1s\"\nkey = [\"client_ip\"]\n",
    );
    for i in 0..10_000 {
        config.push_str(&format!(
            "[[routes]]\nname = \"t{i}\"\nhosts = [\"tenant-{i}.example.com\"]\nmetrics_as = \"tenants\"\n\
             respond = {{ status = 200, body = \"t{i}\" }}\npolicies = [\"per_ip\"]\n"
        ));
    }
    config.push_str(&route("catch_all", "policies = [\"per_ip\"]"));
    let s = Sluice::start(&config);
    for i in [0, 1, 4_999, 9_999] {
        assert_eq!(
            answered(&s, &format!("tenant-{i}.example.com"), "GET", "/"),
            format!("t{i}")
        );
    }
    assert_eq!(
        answered(&s, "tenant-10000.example.com", "GET", "/"),
        "catch_all"
    );
    let scrape = s.metrics();
    assert!(
        scrape.len() < 256 * 1024,
        "scrape of {} bytes",
        scrape.len()
    );
    assert!(
        !scrape.contains("route=\"t0\""),
        "tenant routes have no series of their own"
    );
    assert_eq!(
        s.metric(r#"sluice_decisions_total{decision="allowed",policy="per_ip",route="tenants"}"#),
        4.0
    );
    // Only what a client_ip gcra policy on memory can produce is primed.
    assert!(scrape.contains(
        r#"sluice_decisions_total{decision="rejected",policy="per_ip",route="tenants"} 0"#
    ));
    for absent in [
        "skipped",
        "exempt",
        "delayed",
        "banned",
        "error_allowed",
        "shadow_rejected",
    ] {
        assert!(
            !scrape.contains(&format!("decision=\"{absent}\"")),
            "{absent} cannot happen here"
        );
    }
    assert_eq!(
        s.metric(r#"sluice_http_requests_total{protocol="http1",route="tenants",status="200"}"#),
        4.0
    );
}

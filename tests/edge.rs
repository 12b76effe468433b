//! Edge essentials (DESIGN §14) through the real binary: a plain-HTTP request redirected
//! with its path and query intact while the same request over TLS is proxied, header rules
//! seen by the upstream and by the client (a 429 included, RateLimit headers kept),
//! `strip_prefix`, and request ids that tie the response, the upstream request and the
//! access log together.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;

use common::echo::{upstream_saw, upstream_target, EchoUpstream};
use common::{free_port, http, Sluice, TempDir};
use serde_json::Value;

fn edge_config(upstream: std::net::SocketAddr, extra_server: &str, routes: &str) -> String {
    format!(
        "[server]\nlisten = [\"{{listen}}\"]\n{extra_server}\n[admin]\nlisten = \"{{admin}}\"\n\
         [upstreams.echo]\nservers = [\"{upstream}\"]\n\
         [policies.one]\nalgorithm = \"fixed_window\"\nlimit = 1\nperiod = \"1h\"\nkey = [\"client_ip\"]\n{routes}"
    )
}

#[test]
fn plain_http_is_redirected_with_its_path_and_query_while_tls_is_proxied() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    common::tls_files(&dir.0, "DNS:secure.test");
    let tls_port = free_port();
    let config = format!(
        "[server]\nlisten = [\"{{listen}}\"]\ntls_listen = [\"127.0.0.1:{tls_port}\"]\n[admin]\nlisten = \"{{admin}}\"\n\
         [[certificates]]\nhosts = [\"secure.test\"]\ncert = \"{d}/srv.pem\"\nkey = \"{d}/srv.key\"\n\
         [upstreams.echo]\nservers = [\"{}\"]\n\
         [[routes]]\nname = \"to-https\"\nscheme = \"http\"\nredirect = {{ scheme = \"https\", status = 308 }}\n\
         [[routes]]\nname = \"app\"\nupstream = \"echo\"\n\
         response_headers = {{ set = {{ \"strict-transport-security\" = \"max-age=63072000\" }} }}\n",
        up.addr,
        d = dir.0.display()
    );
    let s = Sluice::start(&config);
    let target = "/a%20b/c?x=1&y=%2F&z";
    let r = http::get(s.addr, target, &[("Host", "secure.test:8080")]);
    assert_eq!(r.status, 308);
    assert_eq!(
        r.header("location"),
        Some("https://secure.test/a%20b/c?x=1&y=%2F&z")
    );
    assert_eq!(up.hits(), 0, "a redirect never reaches the upstream");
    // The same request over TLS is proxied, path and query unchanged, with HSTS.
    let out = Command::new("curl")
        .args(["-s", "-i", "--cacert"])
        .arg(dir.0.join("ca.pem"))
        .args(["--resolve", &format!("secure.test:{tls_port}:127.0.0.1")])
        .arg(format!("https://secure.test:{tls_port}{target}"))
        .output()
        .expect("curl is needed: apt-get install curl");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.starts_with("HTTP/2 200") || text.starts_with("HTTP/1.1 200"),
        "{text}"
    );
    assert!(
        text.to_ascii_lowercase()
            .contains("strict-transport-security: max-age=63072000"),
        "{text}"
    );
    let body = text.split("\r\n\r\n").nth(1).unwrap_or_default();
    let echoed: Value = serde_json::from_str(body).expect("the upstream's echo");
    assert_eq!(echoed["target"], target);
    assert_eq!(up.hits(), 1);
}

#[test]
fn header_rules_reach_the_upstream_and_the_client_also_on_a_429() {
    let up = EchoUpstream::start();
    let routes = "[[routes]]\nname = \"api\"\npath_prefix = \"/\"\nupstream = \"echo\"\npolicies = [\"one\"]\n\
        request_headers = { set = { \"x-env\" = \"prod\" }, remove = [\"x-debug\"] }\n\
        response_headers = { set = { \"x-served-by\" = \"sluice\" }, remove = [\"ratelimit\", \"x-upstream\"] }\n";
    let s = Sluice::start(&edge_config(up.addr, "", routes));
    let r = http::get(s.addr, "/x", &[("X-Debug", "1"), ("X-Env", "dev")]);
    assert_eq!(r.status, 200);
    assert_eq!(upstream_saw(&r, "x-env").as_deref(), Some("prod"));
    assert_eq!(upstream_saw(&r, "x-debug"), None);
    assert_eq!(r.header("x-served-by"), Some("sluice"));
    // Header rules never remove sluice's own RateLimit headers.
    assert!(r.header("ratelimit").is_some());
    let r = http::get(s.addr, "/x", &[]);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-served-by"), Some("sluice"));
    assert!(r.header("ratelimit").is_some() && r.header("retry-after").is_some());
}

#[test]
fn strip_prefix_serves_the_api_under_a_prefix_the_upstream_does_not_know() {
    let up = EchoUpstream::start();
    let routes = "[[routes]]\nname = \"api\"\npath_prefix = \"/api/\"\nstrip_prefix = true\nupstream = \"echo\"\n";
    let s = Sluice::start(&edge_config(up.addr, "", routes));
    for (sent, seen) in [
        ("/api/", "/"),
        ("/api/v1/x", "/v1/x"),
        (
            "/api/v1/users/7?page=2&q=a%20b",
            "/v1/users/7?page=2&q=a%20b",
        ),
    ] {
        let r = http::get(s.addr, sent, &[]);
        assert_eq!(r.status, 200, "{sent}");
        assert_eq!(upstream_target(&r), seen, "{sent}");
    }
}

#[test]
fn request_ids_are_new_from_clients_kept_from_trusted_proxies_and_logged() {
    let up = EchoUpstream::start();
    let routes = "[[routes]]\nname = \"api\"\npath_prefix = \"/\"\nupstream = \"echo\"\n";
    let untrusted = Sluice::start(&edge_config(
        up.addr,
        "request_id = \"x-request-id\"",
        routes,
    ));
    let a = http::get(untrusted.addr, "/", &[("X-Request-Id", "client-made")]);
    let b = http::get(untrusted.addr, "/", &[]);
    let id_a = a
        .header("x-request-id")
        .expect("an id on the response")
        .to_owned();
    let id_b = b
        .header("x-request-id")
        .expect("an id on the response")
        .to_owned();
    assert_ne!(id_a, "client-made", "an untrusted client's id is replaced");
    assert_eq!(id_a.len(), 32);
    assert!(id_a.bytes().all(|c| c.is_ascii_hexdigit()));
    assert_ne!(id_a, id_b, "new per request");
    assert_eq!(
        upstream_saw(&a, "x-request-id").as_deref(),
        Some(id_a.as_str())
    );
    assert!(
        untrusted.wait_for(std::time::Duration::from_secs(5), || untrusted
            .stdout()
            .contains(&format!("\"request_id\":\"{id_a}\"")))
    );
    // From a trusted proxy the id is kept, end to end.
    let trusted = Sluice::start(&edge_config(
        up.addr,
        "request_id = \"x-request-id\"\ntrusted_proxies = [\"127.0.0.1/32\"]",
        routes,
    ));
    let r = http::get(trusted.addr, "/", &[("X-Request-Id", "lb-1234")]);
    assert_eq!(r.header("x-request-id"), Some("lb-1234"));
    assert_eq!(upstream_saw(&r, "x-request-id").as_deref(), Some("lb-1234"));
    // sluice's own answers carry it too.
    let r = http::get(
        trusted.addr,
        "/",
        &[("X-Request-Id", "lb-404"), ("Host", "x")],
    );
    assert_eq!(r.header("x-request-id"), Some("lb-404"));
}

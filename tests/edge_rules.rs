//! The operator's own rules (DESIGN §20) through the real binary: `[server] deny` answers a
//! client address 403 (problem+json; PERMISSION_DENIED for gRPC) before auth and policies,
//! follows the client address of §2.1 behind a trusted proxy while an untrusted client's
//! forged header neither escapes nor triggers it, changes on reload, and is counted; a
//! route's `client_ips` lets only its addresses take the route, the others falling through.
//!
//! Every client is on loopback: curl's `--interface` picks the source address among
//! 127.0.0.0/8, so one sluice sees several clients.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;
use std::time::Duration;

use common::http::{self, Response};
use common::Sluice;
use serde_json::Value;

/// HTTP/1.1, or HTTP/2 with prior knowledge (the listener has `h2c = true`).
#[derive(Clone, Copy, Debug)]
enum Proto {
    H1,
    H2,
}

/// GET `path` from source address `from`, with `headers`.
fn get_from(
    s: &Sluice,
    proto: Proto,
    from: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Response {
    let mut cmd = Command::new("curl");
    cmd.args(["-s", "-i", "--max-time", "5", "--interface", from]);
    cmd.arg(match proto {
        Proto::H1 => "--http1.1",
        Proto::H2 => "--http2-prior-knowledge",
    });
    for (k, v) in headers {
        cmd.arg("-H").arg(format!("{k}: {v}"));
    }
    let out = cmd
        .arg(format!("http://{}{path}", s.addr))
        .output()
        .expect("curl is needed: apt-get install curl");
    let r = http::parse(&out.stdout);
    let version = if matches!(proto, Proto::H2) {
        "HTTP/2 "
    } else {
        "HTTP/1.1 "
    };
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with(version),
        "{proto:?} from {from}: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    r
}

fn config(server: &str) -> String {
    format!(
        r#"
[server]
listen = ["{{listen}}"]
h2c = true
access_log = "off"
{server}
[admin]
listen = "{{admin}}"
[auth]
api_key = ["header:x-api-key"]
[policies.once]
algorithm = "fixed_window"
limit = 1
period = "1h"
key = []
[[routes]]
name = "office"
path_prefix = "/admin/"
client_ips = ["127.0.0.2", "198.51.100.0/24", "2001:db8::/32"]
respond = {{ status = 200, body = "office" }}
[[routes]]
name = "once"
path = "/once"
respond = {{ status = 200, body = "once" }}
policies = ["once"]
[[routes]]
name = "private"
path = "/private"
auth = "required"
respond = {{ status = 200, body = "private" }}
[[routes]]
name = "open"
respond = {{ status = 200, body = "open" }}
"#
    )
}

const DENIED: &str = "sluice_requests_denied_total";

fn assert_denied(r: &Response, what: &str) {
    assert_eq!(r.status, 403, "{what}: {r:?}");
    assert_eq!(
        r.header("content-type"),
        Some("application/problem+json"),
        "{what}"
    );
    let body: Value = serde_json::from_str(&r.body).expect("a JSON problem body");
    assert_eq!(body["status"], 403, "{what}");
    assert_eq!(body["title"], "Forbidden", "{what}");
    assert_eq!(body["detail"], "the client address is denied", "{what}");
}

/// A denied address gets 403 with a problem body over HTTP/1.1 and h2, gRPC's
/// PERMISSION_DENIED over gRPC, before auth (no 401) and before policies (the one unit
/// of `once` is still there for the next client); each denial is counted.
#[test]
fn a_denied_address_gets_403_before_auth_and_policies_and_is_counted() {
    let s = Sluice::start(&config(r#"deny = ["127.0.0.2", "2001:db8::/32"]"#));
    assert!(
        s.metrics().contains(&format!("{DENIED} 0")),
        "primed at 0 from start-up"
    );
    for proto in [Proto::H1, Proto::H2] {
        for path in ["/once", "/private", "/admin/x", "/anything"] {
            let r = get_from(&s, proto, "127.0.0.2", path, &[]);
            assert_denied(&r, &format!("{proto:?} {path}"));
        }
    }
    let grpc = get_from(
        &s,
        Proto::H2,
        "127.0.0.2",
        "/pkg.Svc/Call",
        &[("content-type", "application/grpc")],
    );
    assert_eq!(grpc.status, 200, "{grpc:?}");
    assert_eq!(grpc.header("grpc-status"), Some("7"), "PERMISSION_DENIED");
    assert_eq!(grpc.header("content-type"), Some("application/grpc"));

    // Another address is served as before: auth asks, the policy's unit was never spent.
    assert_eq!(
        get_from(&s, Proto::H1, "127.0.0.1", "/private", &[]).status,
        401
    );
    let r = get_from(&s, Proto::H1, "127.0.0.1", "/once", &[]);
    assert_eq!((r.status, r.body.as_str()), (200, "once"));
    assert_eq!(
        get_from(&s, Proto::H1, "127.0.0.1", "/once", &[]).status,
        429
    );

    assert_eq!(s.metric(&format!("{DENIED} ")), 9.0);
    let by_status = |protocol: &str| {
        s.metric(&format!(
            "sluice_http_requests_total{{protocol=\"{protocol}\",route=\"unmatched\",status=\"403\"}}"
        ))
    };
    assert_eq!(by_status("http1"), 4.0);
    assert_eq!(by_status("h2"), 4.0);
}

/// Behind a trusted proxy the forwarded address is the one denied; an untrusted client's
/// X-Forwarded-For changes nothing: a denied peer does not escape by naming another
/// address, and an allowed one is not denied by naming a denied address.
#[test]
fn deny_follows_the_forwarded_address_only_from_trusted_proxies() {
    let s = Sluice::start(&config(
        "trusted_proxies = [\"127.0.0.3/32\"]\ndeny = [\"203.0.113.0/24\", \"127.0.0.4\"]",
    ));
    let xff = |ip| [("X-Forwarded-For", ip)];
    for proto in [Proto::H1, Proto::H2] {
        // From the trusted proxy: the forwarded client decides.
        let r = get_from(&s, proto, "127.0.0.3", "/", &xff("203.0.113.9"));
        assert_denied(&r, "a denied client behind the trusted proxy");
        let r = get_from(&s, proto, "127.0.0.3", "/", &xff("203.0.113.9, 127.0.0.3"));
        assert_denied(&r, "the right-most untrusted address");
        let r = get_from(&s, proto, "127.0.0.3", "/", &xff("192.0.2.1"));
        assert_eq!((r.status, r.body.as_str()), (200, "open"));
        // The proxy itself is not denied: only what it forwards is.
        assert_eq!(get_from(&s, proto, "127.0.0.3", "/", &[]).status, 200);
        // Untrusted peers: the header is not believed either way.
        let r = get_from(&s, proto, "127.0.0.4", "/", &xff("192.0.2.1"));
        assert_denied(&r, "a denied peer forging an allowed address");
        let r = get_from(&s, proto, "127.0.0.1", "/", &xff("203.0.113.9"));
        assert_eq!(
            (r.status, r.body.as_str()),
            (200, "open"),
            "a forged denied address"
        );
    }
    assert_eq!(s.metric(&format!("{DENIED} ")), 6.0);
}

/// `deny` is part of the config the gateway is built from: SIGHUP adds and removes an
/// address while the process keeps running.
#[test]
fn deny_changes_on_reload_without_restart() {
    let s = Sluice::start(&config(""));
    let pid = s.pid();
    assert_eq!(get_from(&s, Proto::H1, "127.0.0.2", "/", &[]).status, 200);

    s.reload(&config("deny = [\"127.0.0.2/32\"]"));
    assert!(
        s.wait_for(Duration::from_secs(10), || {
            get_from(&s, Proto::H1, "127.0.0.2", "/", &[]).status == 403
        }),
        "the reloaded deny list is in force"
    );
    assert_denied(
        &get_from(&s, Proto::H2, "127.0.0.2", "/", &[]),
        "after reload",
    );
    assert_eq!(get_from(&s, Proto::H1, "127.0.0.1", "/", &[]).status, 200);

    s.reload(&config(""));
    assert!(
        s.wait_for(Duration::from_secs(10), || {
            get_from(&s, Proto::H1, "127.0.0.2", "/", &[]).status == 200
        }),
        "a reload without the address serves it again"
    );
    assert_eq!(s.pid(), pid);
    assert!(s.child_alive());
    assert_eq!(
        s.metric("sluice_config_reloads_total{result=\"success\"}"),
        2.0
    );
}

/// `client_ips` is a match condition: a listed address takes the route, directly or as
/// the forwarded client of a trusted proxy; every other address falls through to the next
/// route that matches, and a forged header from an untrusted peer does not get in.
#[test]
fn a_client_ips_route_is_taken_only_by_its_addresses() {
    let s = Sluice::start(&config("trusted_proxies = [\"127.0.0.3/32\"]"));
    // (source address, X-Forwarded-For, path, the route that answers)
    let cases: &[(&str, Option<&str>, &str, &str)] = &[
        ("127.0.0.2", None, "/admin/x", "office"),
        ("127.0.0.2", None, "/other", "open"),
        ("127.0.0.1", None, "/admin/x", "open"),
        ("127.0.0.3", Some("198.51.100.5"), "/admin/x", "office"),
        ("127.0.0.3", Some("2001:db8::7"), "/admin/x", "office"),
        ("127.0.0.3", Some("192.0.2.1"), "/admin/x", "open"),
        ("127.0.0.3", None, "/admin/x", "open"),
        ("127.0.0.1", Some("198.51.100.5"), "/admin/x", "open"),
        ("127.0.0.2", Some("192.0.2.1"), "/admin/x", "office"),
    ];
    for proto in [Proto::H1, Proto::H2] {
        for (from, forwarded, path, route) in cases {
            let headers: Vec<(&str, &str)> = forwarded
                .iter()
                .map(|ip| ("X-Forwarded-For", *ip))
                .collect();
            let r = get_from(&s, proto, from, path, &headers);
            assert_eq!(
                (r.status, r.body.as_str()),
                (200, *route),
                "{proto:?} {path} from {from}, forwarded {forwarded:?}"
            );
        }
    }
    let office =
        s.metric("sluice_http_requests_total{protocol=\"http1\",route=\"office\",status=\"200\"}");
    assert_eq!(office, 4.0);
    assert_eq!(s.metric(&format!("{DENIED} ")), 0.0);
}

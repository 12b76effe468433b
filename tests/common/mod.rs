//! Shared test harness: the real `sluice` binary as a child process, free ports, HTTP.
#![allow(dead_code)]

pub mod browser;
pub mod dns;
pub mod echo;
pub mod http;
pub mod jwt;
pub mod redis;
pub mod relay;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

pub const SLUICE: &str = env!("CARGO_BIN_EXE_sluice");

/// Debian's python3 (where python3-websockets installs), or else the one on PATH; a test
/// helper written in Python (`needed_by`) fails with how to install it when neither has it.
pub fn python_with_websockets(needed_by: &str) -> &'static str {
    ["/usr/bin/python3", "python3"]
        .into_iter()
        .find(|python| {
            std::process::Command::new(python)
                .args(["-c", "import websockets"])
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .unwrap_or_else(|| {
            panic!(
                "{needed_by} needs Debian's python3-websockets \
                 (`make deps`, or: sudo apt-get install -y python3-websockets)"
            )
        })
}

/// A port nobody listens on right now, and never handed out before in this test binary:
/// its tests run in parallel, and the OS may offer a port again once its probe is closed,
/// before the test that got it first has bound it.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// A scratch directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new() -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "sluice-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running `sluice run`, killed on drop.
pub struct Sluice {
    pub child: Child,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub config: PathBuf,
    _dir: TempDir,
}

/// Replaces `{listen}` and `{admin}` in a config template with free addresses.
pub fn render(template: &str, listen: SocketAddr, admin: SocketAddr) -> String {
    template
        .replace("{listen}", &listen.to_string())
        .replace("{admin}", &admin.to_string())
}

impl Sluice {
    /// Starts sluice on `template` (a config with `{listen}` and `{admin}` placeholders)
    /// and waits until both listeners answer.
    pub fn start(template: &str) -> Sluice {
        Self::start_with_env(template, &[])
    }

    /// `start`, with extra environment variables. A port picked as free can be taken by
    /// another process before sluice binds it (tests run in parallel): sluice is then
    /// started again on fresh ports, up to three times.
    pub fn start_with_env(template: &str, env: &[(&str, &str)]) -> Sluice {
        let mut last = String::new();
        for _ in 0..3 {
            match Self::try_start(template, env) {
                Ok(s) => return s,
                Err(why) => last = why,
            }
        }
        panic!("{last}");
    }

    fn try_start(template: &str, env: &[(&str, &str)]) -> Result<Sluice, String> {
        let dir = TempDir::new();
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let config = dir.0.join("sluice.toml");
        std::fs::write(&config, render(template, addr, admin)).expect("write config");
        let mut cmd = Command::new(SLUICE);
        // Logs go to files: a full pipe nobody reads would block sluice.
        let stdout = std::fs::File::create(dir.0.join("stdout.log")).expect("stdout file");
        let stderr = std::fs::File::create(dir.0.join("stderr.log")).expect("stderr file");
        cmd.arg("run")
            .arg("--config")
            .arg(&config)
            .stdout(Stdio::from(stdout))
            .stderr(Stdio::from(stderr));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("start sluice");
        let mut s = Sluice {
            child,
            addr,
            admin,
            config,
            _dir: dir,
        };
        s.wait_ready().map(|()| s)
    }

    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("sluice exited early ({status}): {}", self.stderr()));
            }
            let admin_up = http::get(self.admin, "/healthz", &[]).status == 200;
            if admin_up && TcpStream::connect(self.addr).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        Err(format!(
            "sluice did not become ready on {} / {}: {}",
            self.addr,
            self.admin,
            self.stderr()
        ))
    }

    pub fn get(&self, path: &str) -> http::Response {
        http::get(self.addr, path, &[])
    }

    pub fn get_with(&self, path: &str, headers: &[(&str, &str)]) -> http::Response {
        http::get(self.addr, path, headers)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process is still running.
    pub fn child_alive(&self) -> bool {
        Command::new("kill")
            .args(["-0", &self.pid().to_string()])
            .status()
            .is_ok_and(|s| s.success())
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid().to_string())
            .status()
            .expect("run kill")
            .success();
        assert!(ok, "kill -{sig} failed");
    }

    /// Writes a new config (same placeholders) and sends SIGHUP.
    pub fn reload(&self, template: &str) {
        std::fs::write(&self.config, render(template, self.addr, self.admin))
            .expect("write config");
        self.signal("HUP");
    }

    pub fn metrics(&self) -> String {
        http::get(self.admin, "/metrics", &[]).body
    }

    /// The value of one sample line of /metrics, e.g. `metric(r#"sluice_http_requests_total{protocol="http1",route="a",status="200"}"#)`.
    /// Label order is as the prometheus crate writes it (alphabetical).
    pub fn metric(&self, sample: &str) -> f64 {
        self.metrics()
            .lines()
            .find_map(|l| l.strip_prefix(sample).and_then(|v| v.trim().parse().ok()))
            .unwrap_or(0.0)
    }

    /// Waits up to `timeout` for `cond`.
    pub fn wait_for(&self, timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if cond() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        cond()
    }

    /// `sluice admin ARGS… --config` this instance's config: (success, stdout, stderr).
    pub fn admin_cli(&self, args: &[&str]) -> (bool, String, String) {
        let out = Command::new(SLUICE)
            .arg("admin")
            .args(args)
            .arg("--config")
            .arg(&self.config)
            .output()
            .expect("run sluice admin");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// What sluice wrote to stdout (the access log) so far.
    pub fn stdout(&self) -> String {
        std::fs::read_to_string(self._dir.0.join("stdout.log")).unwrap_or_default()
    }

    /// What sluice wrote to stderr (its own log) so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self._dir.0.join("stderr.log")).unwrap_or_default()
    }
}

impl Drop for Sluice {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `openssl` with `args` in `dir`, failing the test with its output if it fails.
pub fn openssl(dir: &std::path::Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl is needed for TLS tests: apt-get install openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Writes a private CA (`ca.pem`) and a server certificate (`srv.pem`, `srv.key`) valid only
/// for `san` (e.g. "DNS:upstream.test" or "IP:127.0.0.1") into `dir`.
pub fn tls_files(dir: &std::path::Path, san: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=sluice test CA",
        ],
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "srv.key",
            "-out",
            "srv.csr",
            "-subj",
            "/CN=sluice test server",
        ],
    );
    std::fs::write(dir.join("ext.cnf"), format!("subjectAltName={san}\n")).expect("write ext.cnf");
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "srv.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "srv.pem",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
        ],
    );
}

/// A config: `[limiter]` lines, extra `[server]` lines, policies, and one `respond` route
/// per (name, quoted policy names) at path `/NAME`.
pub fn config(
    limiter: &str,
    server_extra: &str,
    policies: &str,
    routes: &[(&str, &str)],
) -> String {
    let mut out = format!(
        "[server]\nlisten = [\"{{listen}}\"]\naccess_log = \"off\"\n{server_extra}\n[admin]\nlisten = \"{{admin}}\"\n[limiter]\n{limiter}\n{policies}\n"
    );
    for (name, policies) in routes {
        out.push_str(&format!(
            "[[routes]]\nname = \"{name}\"\npath = \"/{name}\"\nrespond = {{ status = 200, body = \"ok\\n\" }}\npolicies = [{policies}]\n"
        ));
    }
    out
}

/// One `[policies.NAME]` table; `key` is the inside of the key list, e.g. `"\"client_ip\""`.
pub fn policy(
    name: &str,
    algorithm: &str,
    limit: u64,
    period: &str,
    key: &str,
    extra: &str,
) -> String {
    format!("[policies.{name}]\nalgorithm = \"{algorithm}\"\nlimit = {limit}\nperiod = \"{period}\"\nkey = [{key}]\n{extra}\n")
}

/// A config with one global policy per algorithm (named after it) and a route `/ALGORITHM` each.
pub fn one_route_per_algorithm(
    limiter: &str,
    server_extra: &str,
    algorithms: &[&str],
    limit: u64,
    period: &str,
) -> String {
    let policies: String = algorithms
        .iter()
        .map(|a| policy(a, a, limit, period, "", ""))
        .collect();
    let names: Vec<String> = algorithms.iter().map(|a| format!("\"{a}\"")).collect();
    let routes: Vec<(&str, &str)> = algorithms
        .iter()
        .zip(&names)
        .map(|(a, n)| (*a, n.as_str()))
        .collect();
    config(limiter, server_extra, &policies, &routes)
}

/// Fires `n` GETs at once (one thread each, released together) and returns their responses.
pub fn burst(
    addr: SocketAddr,
    n: usize,
    path: &str,
    headers: &[(&str, &str)],
) -> Vec<http::Response> {
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(n));
    let headers: Vec<(String, String)> = headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let handles: Vec<_> = (0..n)
        .map(|_| {
            let (barrier, path, headers) = (barrier.clone(), path.to_owned(), headers.clone());
            std::thread::spawn(move || {
                let h: Vec<(&str, &str)> = headers
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect();
                barrier.wait();
                http::get(addr, &path, &h)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("request thread"))
        .collect()
}

/// The ban tests' policies: `strict` (fixed_window, 2 per 1s, banned for 4s once it
/// rejects) and `dry`, a shadow policy with a ban, which must ban nobody.
pub fn ban_policies() -> String {
    policy(
        "strict",
        "fixed_window",
        2,
        "1s",
        "\"client_ip\"",
        "ban = \"4s\"",
    ) + &policy(
        "dry",
        "fixed_window",
        1,
        "1s",
        "\"client_ip\"",
        "ban = \"1h\"\nmode = \"shadow\"",
    )
}

/// The ban tests' opening, on route `/a` under `ban_policies`: GETs on `first` until
/// `strict` rejects (two pass, three if a window turns between them), which bans for 4 s;
/// 1.5 s later, in a new window, `later` still rejects, with the ban's rest (1–3 s) as
/// Retry-After. Returns when the ban began.
pub fn banned_then_still_banned(first: &Sluice, later: &Sluice) -> Instant {
    let mut rejected = first.get("/a");
    for _ in 0..3 {
        if rejected.status == 429 {
            break;
        }
        rejected = first.get("/a");
    }
    let started = Instant::now();
    assert_eq!(rejected.status, 429);
    assert_eq!(rejected.header("retry-after"), Some("4"));
    std::thread::sleep(Duration::from_millis(1_500));
    let r = later.get("/a");
    assert_eq!(r.status, 429);
    let retry: u64 = r
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("Retry-After");
    assert!(
        (1..=3).contains(&retry),
        "Retry-After {retry} should count the ban down"
    );
    started
}

pub fn count_status(responses: &[http::Response], status: u16) -> usize {
    responses.iter().filter(|r| r.status == status).count()
}

/// The plans of DESIGN §9.1 in one fixed_window policy `plans` keyed on the API key:
/// anonymous clients 3 per hour, `x-plan: gold` 10, two partner keys 20, and clients from
/// 10.0.0.0/8 (none in these tests) 50; `extra` adds lines to the policy (e.g. `ban`).
pub fn plans_policy(extra: &str) -> String {
    policy("plans", "fixed_window", 3, "1h", "\"header:x-api-key\"", &format!("on_missing = \"shared\"\n{extra}"))
        + "[[policies.plans.overrides]]\nwhen = { \"header:x-plan\" = \"gold\" }\nlimit = 10\n"
        + "[[policies.plans.overrides]]\nwhen = { \"header:x-api-key\" = [\"k-partner-1\", \"k-partner-2\"] }\nlimit = 20\n"
        + "[[policies.plans.overrides]]\nwhen = { \"client_ip\" = [\"10.0.0.0/8\"] }\nlimit = 50\n"
}

/// Sends requests with `headers` to `path` until one is rejected (at most `most`), checking
/// that every admitted one shows `policy` with `q` (per hour) in `RateLimit-Policy`;
/// returns how many were admitted.
pub fn admitted_until_rejected(
    s: &Sluice,
    path: &str,
    headers: &[(&str, &str)],
    policy: &str,
    q: u64,
    most: usize,
) -> usize {
    for n in 0..most {
        let r = s.get_with(path, headers);
        if r.status != 200 {
            assert_eq!(r.status, 429, "{headers:?}: {}", r.body);
            return n;
        }
        let want = format!("\"{policy}\";q={q};w=3600");
        assert_eq!(
            r.header("ratelimit-policy"),
            Some(want.as_str()),
            "{headers:?}"
        );
    }
    most
}

/// libfaketime, preloaded directly: the `faketime` wrapper forks, so killing it would
/// leave sluice running.
pub fn libfaketime() -> String {
    let found = std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .map(|d| d.path().join("faketime/libfaketime.so.1"))
        .find(|p| p.exists());
    found
        .expect("libfaketime is missing: apt-get install faketime (or make deps)")
        .display()
        .to_string()
}

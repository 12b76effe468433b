//! Real `redis-server` processes for tests (one server, a replica, a 3-master cluster,
//! Sentinels), killed on drop.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{free_port, TempDir};

const INSTALL: &str = "install it with `apt-get install redis-server redis-tools` (or `make deps`)";

/// Fails the test, saying how to install `binary`, when it is not on PATH.
fn require(binary: &str) {
    let found = Command::new(binary)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "`{binary}` is needed by the Redis tests but was not found: {INSTALL}"
    );
}

/// Whether a Redis on `port` answers PING (with PONG, or NOAUTH when it wants a password).
fn pings(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 64];
    matches!(s.read(&mut buf), Ok(n) if buf[..n].starts_with(b"+PONG") || buf[..n].starts_with(b"-NOAUTH"))
}

/// Runs `redis-cli -p port args...` and returns its stdout, trimmed; panics if it fails.
fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run redis-cli ({e}): {INSTALL}"));
    assert!(
        out.status.success(),
        "redis-cli {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// One `redis-server` on 127.0.0.1, without persistence.
pub struct RedisServer {
    port: u16,
    args: Vec<String>,
    child: Option<Child>,
    dir: TempDir,
}

impl RedisServer {
    /// Starts a server on a free port and waits until it answers PING.
    pub fn start() -> RedisServer {
        Self::start_with(&[])
    }

    /// Starts a replica of `master` and waits until its replication link is up.
    pub fn start_replica_of(master: &RedisServer) -> RedisServer {
        let replica = Self::start_with(&["--replicaof", "127.0.0.1", &master.port().to_string()]);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !replica
            .cli(&["info", "replication"])
            .contains("master_link_status:up")
        {
            assert!(
                Instant::now() < deadline,
                "the replica on port {} did not connect to its master",
                replica.port()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        replica
    }

    /// Starts a server with extra `redis-server` arguments (e.g. `["--requirepass", "pw"]`).
    pub fn start_with(extra: &[&str]) -> RedisServer {
        require("redis-server");
        require("redis-cli");
        let mut server = RedisServer {
            port: free_port(),
            args: extra.iter().map(|s| s.to_string()).collect(),
            child: None,
            dir: TempDir::new(),
        };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let log = std::fs::File::create(self.dir.0.join("redis.log")).expect("redis log file");
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir.0)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start redis-server ({e}): {INSTALL}"));
        self.child = Some(child);
        self.wait_until_up();
    }

    fn wait_until_up(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    panic!("redis-server exited at start ({status}): {}", self.log());
                }
            }
            if pings(self.port) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!(
            "redis-server on port {} did not answer: {}",
            self.port,
            self.log()
        );
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("redis.log")).unwrap_or_default()
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Sends `sig` (e.g. "STOP", "CONT") to the server process.
    pub fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("redis-server running").id();
        let ok = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(pid.to_string())
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -{sig} redis-server");
    }

    /// Runs redis-cli against this server; returns its raw output, trimmed.
    pub fn cli(&self, args: &[&str]) -> String {
        redis_cli(self.port, args)
    }

    /// Script calls (FCALL, EVAL, EVALSHA) that ran since the server's stats were reset: a first
    /// call answered NOSCRIPT or "Function not found" (then loaded and sent again) does not
    /// count.
    pub fn scripts_run(&self) -> u64 {
        let field = |line: &str, name: &str| -> u64 {
            line.split([':', ','])
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
                .unwrap_or(0)
        };
        self.cli(&["INFO", "commandstats"])
            .lines()
            .filter(|l| {
                l.starts_with("cmdstat_fcall:")
                    || l.starts_with("cmdstat_evalsha:")
                    || l.starts_with("cmdstat_eval:")
            })
            .map(|l| field(l, "calls") - field(l, "failed_calls"))
            .sum()
    }

    /// A plain blocking connection for inspecting state.
    pub fn connection(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .and_then(|c| c.get_connection())
            .expect("connect to the test redis-server")
    }

    /// Stops the server now (SIGKILL); its data is lost.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills the server (if running) and starts it again, empty, on the same port.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A Redis Cluster of three masters without replicas.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts three cluster-enabled servers, joins them with `redis-cli --cluster create`,
    /// and waits until every node reports `cluster_state:ok`.
    pub fn start() -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| {
                // The cluster bus needs a second port; name it rather than rely on port + 10000.
                let bus = free_port().to_string();
                RedisServer::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-port",
                    &bus,
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "5000",
                ])
            })
            .collect();
        let mut args = vec!["--cluster".to_owned(), "create".to_owned()];
        args.extend(nodes.iter().map(|n| format!("127.0.0.1:{}", n.port())));
        args.push("--cluster-yes".to_owned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        redis_cli(nodes[0].port(), &args);
        let cluster = RedisCluster { nodes };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !cluster
            .nodes
            .iter()
            .all(|n| n.cli(&["cluster", "info"]).contains("cluster_state:ok"))
        {
            assert!(
                Instant::now() < deadline,
                "the test cluster did not reach cluster_state:ok"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        cluster
    }

    /// `redis://127.0.0.1:PORT` of every node.
    pub fn seeds(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// Runs redis-cli in cluster mode (`-c`, follows redirects) against the first node.
    pub fn cli(&self, args: &[&str]) -> String {
        let mut all = vec!["-c"];
        all.extend_from_slice(args);
        self.nodes[0].cli(&all)
    }
}

/// A Redis Sentinel watching one master under a name: it finds the master down after 1 s
/// and gives a failover 3 s, so tests can fail over quickly.
pub struct RedisSentinel {
    server: RedisServer,
    _conf: TempDir,
}

impl RedisSentinel {
    /// Starts a Sentinel that monitors `master` as `name` (quorum 1), and waits until it
    /// names the master's address.
    pub fn start(master: &RedisServer, name: &str) -> RedisSentinel {
        let conf = TempDir::new();
        let file = conf.0.join("sentinel.conf");
        std::fs::write(
            &file,
            format!(
                "sentinel monitor {name} 127.0.0.1 {} 1\nsentinel down-after-milliseconds {name} 1000\nsentinel failover-timeout {name} 3000\n",
                master.port()
            ),
        )
        .expect("write sentinel.conf");
        let file = file.to_string_lossy().into_owned();
        require("redis-server");
        let mut server = RedisServer {
            port: free_port(),
            args: Vec::new(),
            child: None,
            dir: TempDir::new(),
        };
        // `redis-server FILE --sentinel` takes the config file first; spawn by hand.
        let log = std::fs::File::create(server.dir.0.join("redis.log")).expect("sentinel log file");
        let child = Command::new("redis-server")
            .arg(&file)
            .args([
                "--sentinel",
                "--port",
                &server.port.to_string(),
                "--bind",
                "127.0.0.1",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start redis-server --sentinel ({e}): {INSTALL}"));
        server.child = Some(child);
        server.wait_until_up();
        let deadline = Instant::now() + Duration::from_secs(10);
        let want = master.port().to_string();
        while !server
            .cli(&["sentinel", "get-master-addr-by-name", name])
            .contains(&want)
        {
            assert!(
                Instant::now() < deadline,
                "sentinel does not name master {name}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        RedisSentinel {
            server,
            _conf: conf,
        }
    }

    pub fn url(&self) -> String {
        self.server.url()
    }

    /// Runs redis-cli against this sentinel; returns its raw output, trimmed.
    pub fn cli(&self, args: &[&str]) -> String {
        self.server.cli(args)
    }

    /// The port of the master this sentinel names for `name` now.
    pub fn master_port(&self, name: &str) -> Option<u16> {
        let addr = self.cli(&["sentinel", "get-master-addr-by-name", name]);
        addr.lines().nth(1)?.trim().parse().ok()
    }

    /// Waits until this sentinel knows `replica` as a healthy replica of `name` (so that
    /// `SENTINEL FAILOVER` has one to promote).
    pub fn wait_for_replica(&self, name: &str, replica: &RedisServer) {
        let port = replica.port().to_string();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let out = self.cli(&["sentinel", "replicas", name]);
            let lines: Vec<&str> = out.lines().map(str::trim).collect();
            let value = |key: &str| {
                lines
                    .windows(2)
                    .find(|w| w[0] == key)
                    .map(|w| w[1].to_owned())
            };
            if value("port").as_deref() == Some(port.as_str())
                && value("flags").as_deref() == Some("slave")
                && value("master-link-status").as_deref() == Some("ok")
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "sentinel does not know the replica on port {port}: {out}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The ids of the clients subscribed to something on this sentinel (`CLIENT LIST`).
    pub fn subscribers(&self) -> Vec<String> {
        self.cli(&["client", "list"])
            .lines()
            .filter(|l| l.contains(" sub=") && !l.contains(" sub=0 "))
            .filter_map(|l| l.split(' ').find_map(|f| f.strip_prefix("id=")))
            .map(str::to_owned)
            .collect()
    }
}

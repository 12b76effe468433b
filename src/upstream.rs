//! Upstream server pools: resolving their servers once per config, choosing one per request,
//! active and passive health, `sluice_upstream_health`.
//!
//! Selection and active checks are Pingora's (`pingora::lb`): `LoadBalancer` with
//! `RoundRobin`, `Random` or `Consistent` (ketama, so a server leaving moves only its own
//! clients), and `TcpHealthCheck` / `HttpHealthCheck` behind its health registry. What sluice
//! adds is policy around them, for three measured or read reasons:
//! - the loop: Pingora runs checks as a `BackgroundService` that lives as long as the server,
//!   while a reload here rebuilds pools and the old ones must stop. So sluice drives
//!   `Backends::run_health_check` itself, one pass per `interval`, from a task holding a
//!   `Weak<Pool>` that ends when the pool is dropped or retired by a reload;
//! - passive checks: Pingora's `Health` can only be changed by its own checks (it is
//!   crate-private), so nginx's `max_fails`/`fail_timeout` live here, per server, and are
//!   applied through `select_with`'s `accept`;
//! - per-request cost: `select_with` costs about as much as the hand-written pick it replaced
//!   (see `selection_cost` below: both well under a microsecond), nothing to win by hand.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora::http::RequestHeader;
use pingora::lb::health_check::{self, HttpHealthCheck, TcpHealthCheck};
use pingora::lb::selection::{BackendIter, BackendSelection, Consistent, Random, RoundRobin};
use pingora::lb::{Backend, LoadBalancer};
use pingora::prelude::*;
use prometheus::IntGauge;

use crate::config::{Balance, Upstream};
use crate::metrics::Metrics;

pub struct Server {
    pub addr: SocketAddr,
    /// As written in `servers`: the `server` label of `sluice_upstream_health`.
    pub name: String,
    backend: Backend,
    /// The last active check's verdict (true without active checks).
    checked_up: AtomicBool,
    /// Passive checks: consecutive connect errors or timeouts...
    fails: AtomicU32,
    /// ...and, once they reach `max_fails`, when the server is tried again (milliseconds
    /// since `Pool::born`; 0 = in service).
    out_until_ms: AtomicU64,
    gauge: IntGauge,
}

enum Balancer {
    RoundRobin(LoadBalancer<RoundRobin>),
    Random(LoadBalancer<Random>),
    Hash(LoadBalancer<Consistent>),
}

pub struct Pool {
    pub config: Upstream,
    /// One per distinct address, in config order.
    pub servers: Vec<Server>,
    balancer: Balancer,
    born: Instant,
    /// Set when a reload replaced this pool: it no longer checks or writes metrics.
    retired: AtomicBool,
}

impl Pool {
    /// Resolves every server name once; a name that does not resolve is an error.
    pub async fn resolve(config: &Upstream, metrics: &Metrics) -> Result<Pool, String> {
        let mut servers: Vec<Server> = Vec::with_capacity(config.servers.len());
        for name in &config.servers {
            let addr = tokio::net::lookup_host(name.as_str())
                .await
                .ok()
                .and_then(|mut addrs| addrs.next())
                .ok_or_else(|| format!("upstream {}: cannot resolve server {name}", config.name))?;
            if servers.iter().any(|s| s.addr == addr) {
                continue;
            }
            let backend = Backend::new(&addr.to_string())
                .map_err(|e| format!("upstream {}: server {name}: {e}", config.name))?;
            servers.push(Server {
                addr,
                name: name.clone(),
                backend,
                checked_up: AtomicBool::new(true),
                fails: AtomicU32::new(0),
                out_until_ms: AtomicU64::new(0),
                gauge: metrics
                    .upstream_health
                    .with_label_values(&[config.name.as_str(), name.as_str()]),
            });
        }
        let addrs: Vec<SocketAddr> = servers.iter().map(|s| s.addr).collect();
        let lb_error = |e: std::io::Error| format!("upstream {}: {e}", config.name);
        let probe = config
            .health_check
            .as_ref()
            .map(|hc| probe(config, &servers, hc));
        let balancer = match config.balance {
            Balance::RoundRobin => Balancer::RoundRobin(with_probe(
                LoadBalancer::try_from_iter(addrs).map_err(lb_error)?,
                probe,
            )),
            Balance::Random => Balancer::Random(with_probe(
                LoadBalancer::try_from_iter(addrs).map_err(lb_error)?,
                probe,
            )),
            Balance::Hash => Balancer::Hash(with_probe(
                LoadBalancer::try_from_iter(addrs).map_err(lb_error)?,
                probe,
            )),
        };
        Ok(Pool {
            config: config.clone(),
            servers,
            balancer,
            born: Instant::now(),
            retired: AtomicBool::new(false),
        })
    }

    /// A server for this request, never one in `tried` while another is left: a healthy one
    /// in service if there is one, else any (when every server is down, all are tried rather
    /// than none). With `hash` the client's IP picks its place on the ketama ring.
    pub fn pick(&self, client_ip: IpAddr, tried: &[SocketAddr]) -> &Server {
        if let [only] = self.servers.as_slice() {
            // Every path below ends at the one server; skip the balancer's walk (about 2 %
            // of a proxied request's instructions, callgrind).
            return only;
        }
        let mut octets = [0u8; 16];
        let key: &[u8] = match client_ip {
            IpAddr::V4(ip) => {
                octets[..4].copy_from_slice(&ip.octets());
                &octets[..4]
            }
            IpAddr::V6(ip) => {
                octets = ip.octets();
                &octets
            }
        };
        let now = self.now_ms();
        let fresh = |b: &Backend| b.as_inet().is_some_and(|a| !tried.contains(a));
        let chosen = self
            .select(key, |b, healthy| {
                healthy && fresh(b) && self.server(b).is_some_and(|s| s.in_service(now))
            })
            .or_else(|| self.select(key, |b, _| fresh(b)));
        chosen
            .and_then(|b| self.server(&b))
            .or_else(|| self.servers.iter().find(|s| !tried.contains(&s.addr)))
            .unwrap_or(&self.servers[0])
    }

    fn select(&self, key: &[u8], accept: impl Fn(&Backend, bool) -> bool) -> Option<Backend> {
        // Enough steps to walk the whole ketama ring (160 points per server); the weighted
        // selectors need far fewer, and `pick` falls back to a plain scan anyway.
        let steps = 160 * self.servers.len();
        match &self.balancer {
            Balancer::RoundRobin(lb) => lb.select_with(key, steps, accept),
            Balancer::Random(lb) => lb.select_with(key, steps, accept),
            Balancer::Hash(lb) => lb.select_with(key, steps, accept),
        }
    }

    fn server(&self, backend: &Backend) -> Option<&Server> {
        let addr = backend.as_inet()?;
        self.servers.iter().find(|s| s.addr == *addr)
    }

    fn backends(&self) -> &pingora::lb::Backends {
        match &self.balancer {
            Balancer::RoundRobin(lb) => lb.backends(),
            Balancer::Random(lb) => lb.backends(),
            Balancer::Hash(lb) => lb.backends(),
        }
    }

    fn name_of(&self, server: &Server) -> String {
        format!("upstream {} server {}", self.config.name, server.name)
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.born.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    /// Passive checks: the outcome of one request (or connect attempt) on `addr`. A success
    /// puts the server back at once; `max_fails` consecutive failures take it out for
    /// `fail_timeout`, after which it is tried again, and one more failure takes it out again
    /// (nginx's semantics).
    pub fn report(self: &Arc<Self>, addr: SocketAddr, ok: bool) {
        let Some(server) = self.servers.iter().find(|s| s.addr == addr) else {
            return;
        };
        if ok {
            server.fails.store(0, Ordering::Relaxed);
            if server.out_until_ms.swap(0, Ordering::Relaxed) != 0 {
                log::warn!(
                    "upstream {} server {} is back",
                    self.config.name,
                    server.name
                );
                self.publish(server);
            }
            return;
        }
        let fails = server
            .fails
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        let now = self.now_ms();
        if fails < self.config.max_fails || !server.in_service(now) {
            return;
        }
        let out_for = self.config.fail_timeout;
        let until = now.saturating_add(u64::try_from(out_for.as_millis()).unwrap_or(u64::MAX));
        server.out_until_ms.store(until, Ordering::Relaxed);
        log::warn!(
            "{} is out for {out_for:?} after {fails} failures",
            self.name_of(server)
        );
        self.publish(server);
        // The gauge says when it is tried again; this timer ends with `fail_timeout`.
        let (pool, addr) = (Arc::downgrade(self), server.addr);
        tokio::spawn(async move {
            tokio::time::sleep(out_for).await;
            if let Some(p) = pool.upgrade() {
                if let Some(s) = p.servers.iter().find(|s| s.addr == addr) {
                    p.publish(s);
                }
            }
        });
    }

    /// Sets `server`'s gauge to what a request would see now.
    fn publish(&self, server: &Server) {
        if self.retired.load(Ordering::Relaxed) {
            return;
        }
        let up = server.checked_up.load(Ordering::Relaxed) && server.in_service(self.now_ms());
        server.gauge.set(i64::from(up));
    }

    /// Makes every server's series exist with its current state (on start and reload).
    pub fn publish_all(&self) {
        for s in &self.servers {
            self.publish(s);
        }
    }

    /// One active pass over every server, then the gauges and the log follow the verdicts.
    async fn check_once(&self) {
        self.backends().run_health_check(true).await;
        for s in &self.servers {
            // Pingora logs a server going down as a warning, with the check's error, and
            // its recovery at info, which sluice's default filter hides: say it here.
            let up = self.backends().ready(&s.backend);
            if up && !s.checked_up.swap(up, Ordering::Relaxed) {
                log::info!("{} passes its health check again", self.name_of(s));
            }
            s.checked_up.store(up, Ordering::Relaxed);
            self.publish(s);
        }
    }
}

impl Server {
    fn in_service(&self, now_ms: u64) -> bool {
        now_ms >= self.out_until_ms.load(Ordering::Relaxed)
    }
}

fn with_probe<S>(
    mut lb: LoadBalancer<S>,
    probe: Option<Box<dyn health_check::HealthCheck + Send + Sync>>,
) -> LoadBalancer<S>
where
    S: BackendSelection + 'static,
    S::Iter: BackendIter,
{
    if let Some(probe) = probe {
        lb.set_health_check(probe);
    }
    lb
}

/// One Pingora check per server (its own Host and, with TLS, SNI as requests get them),
/// each bounded as a whole by `timeout`.
struct Probe {
    checks: Vec<(SocketAddr, Box<dyn health_check::HealthCheck + Send + Sync>)>,
    timeout: Duration,
    /// "upstream NAME server HOST:PORT" per address: what Pingora's log of a flip names.
    names: Vec<(SocketAddr, String)>,
}

fn probe(
    config: &Upstream,
    servers: &[Server],
    hc: &crate::config::HealthCheck,
) -> Box<dyn health_check::HealthCheck + Send + Sync> {
    let checks = servers
        .iter()
        .map(|s| {
            let check: Box<dyn health_check::HealthCheck + Send + Sync> = match &hc.path {
                None => {
                    let mut tcp = TcpHealthCheck::new();
                    tcp.peer_template.options.connection_timeout = Some(hc.timeout);
                    tcp.peer_template.options.total_connection_timeout = Some(hc.timeout);
                    tcp
                }
                Some(path) => Box::new(http_check(config, s, path, hc.timeout)),
            };
            (s.addr, check)
        })
        .collect();
    let names = servers
        .iter()
        .map(|s| {
            (
                s.addr,
                format!("upstream {} server {}", config.name, s.name),
            )
        })
        .collect();
    Box::new(Probe {
        checks,
        timeout: hc.timeout,
        names,
    })
}

fn http_check(
    config: &Upstream,
    server: &Server,
    path: &str,
    timeout: Duration,
) -> HttpHealthCheck {
    let sni = if config.sni.is_empty() {
        server.addr.ip().to_string()
    } else {
        config.sni.clone()
    };
    let host = if config.sni.is_empty() {
        server.name.as_str()
    } else {
        config.sni.as_str()
    };
    let mut check = HttpHealthCheck::new(host, config.tls);
    check.peer_template.sni = if config.tls { sni } else { String::new() };
    let options = &mut check.peer_template.options;
    if config.protocol == crate::config::UpstreamProtocol::H2 {
        // Checked the way requests reach it: an h2c-only server would refuse HTTP/1.1.
        options.alpn = pingora::protocols::ALPN::H2;
    }
    options.connection_timeout = Some(timeout);
    options.total_connection_timeout = Some(timeout);
    options.read_timeout = Some(timeout);
    options.write_timeout = Some(timeout);
    // `path` was checked to be an origin-form target by config validation.
    if let Ok(mut req) = RequestHeader::build("GET", path.as_bytes(), None) {
        if req.insert_header("Host", host).is_ok() {
            check.req = req;
        }
    }
    check.validator = Some(Box::new(|resp| {
        let status = resp.status.as_u16();
        if (200..400).contains(&status) {
            Ok(())
        } else {
            Error::e_explain(
                ErrorType::CustomCode("health check status", status),
                "not 2xx or 3xx",
            )
        }
    }));
    check
}

#[async_trait]
impl health_check::HealthCheck for Probe {
    async fn check(&self, target: &Backend) -> Result<()> {
        let check = target
            .as_inet()
            .and_then(|addr| self.checks.iter().find(|(a, _)| a == addr));
        let Some((_, check)) = check else {
            return Error::e_explain(ErrorType::InternalError, "no check for this server");
        };
        match tokio::time::timeout(self.timeout, check.check(target)).await {
            Ok(result) => result,
            Err(_) => Error::e_explain(ErrorType::ReadTimedout, "health check timed out"),
        }
    }

    fn health_threshold(&self, _success: bool) -> usize {
        1
    }

    fn backend_summary(&self, target: &Backend) -> String {
        let name = target
            .as_inet()
            .and_then(|addr| self.names.iter().find(|(a, _)| a == addr));
        name.map_or_else(|| format!("{target:?}"), |(_, n)| n.clone())
    }
}

/// What one proxied request says about its server, for passive checks: `Some(true)` when
/// it was answered, `Some(false)` on an upstream timeout, `None` otherwise (connect errors
/// are reported per attempt by `fail_to_connect`; client errors say nothing of the server).
pub fn outcome(e: Option<&Error>) -> Option<bool> {
    let Some(e) = e else { return Some(true) };
    let timeout = matches!(
        e.etype(),
        ErrorType::ReadTimedout | ErrorType::WriteTimedout
    );
    (timeout && matches!(e.esource(), pingora::ErrorSource::Upstream)).then_some(false)
}

/// Checks each server of `pool` every interval, until the pool is dropped or retired (a
/// reload replaced it).
pub async fn health_check(pool: Weak<Pool>, interval: Duration) {
    loop {
        let Some(p) = pool.upgrade() else { return };
        if p.retired.load(Ordering::Relaxed) {
            return;
        }
        p.check_once().await;
        drop(p);
        tokio::time::sleep(interval).await;
    }
}

/// Starts the health checks of every pool that has one, on the current runtime.
pub fn spawn_health_checks(pools: &[Arc<Pool>]) {
    for pool in pools {
        if let Some(hc) = &pool.config.health_check {
            tokio::spawn(health_check(Arc::downgrade(pool), hc.interval));
        }
    }
}

/// Hands the gauges over from `old` pools (a reload) to `new` ones: the old stop writing
/// them, series of servers no longer configured are dropped, the rest show the new state.
pub fn hand_over(old: &[Arc<Pool>], new: &[Arc<Pool>], metrics: &Metrics) {
    for pool in old {
        pool.retired.store(true, Ordering::Relaxed);
        for s in &pool.servers {
            let kept = new.iter().any(|n| {
                n.config.name == pool.config.name && n.servers.iter().any(|t| t.name == s.name)
            });
            if !kept {
                let _ = metrics
                    .upstream_health
                    .remove_label_values(&[pool.config.name.as_str(), s.name.as_str()]);
            }
        }
    }
    for pool in new {
        pool.publish_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstream(balance: Balance, servers: &[&str], max_fails: u32) -> Upstream {
        Upstream {
            name: "u".into(),
            servers: servers.iter().map(|s| s.to_string()).collect(),
            balance,
            tls: false,
            sni: String::new(),
            connect_timeout: Duration::from_secs(1),
            read_timeout: Duration::from_secs(1),
            health_check: None,
            max_fails,
            fail_timeout: Duration::from_secs(60),
            keepalive: crate::config::DEFAULT_KEEPALIVE,
            keepalive_timeout: Duration::from_secs(60),
            protocol: crate::config::UpstreamProtocol::Http1,
        }
    }

    const THREE: [&str; 3] = ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"];

    fn client(i: u32) -> IpAddr {
        IpAddr::V4(std::net::Ipv4Addr::from(0x0a01_0000 + i))
    }

    #[tokio::test]
    async fn a_retry_never_repeats_a_server_while_another_is_left() {
        for balance in [Balance::RoundRobin, Balance::Random, Balance::Hash] {
            let pool = Pool::resolve(&upstream(balance, &THREE, 1), &Metrics::new())
                .await
                .expect("pool");
            let mut tried = Vec::new();
            for _ in 0..3 {
                tried.push(pool.pick(client(7), &tried).addr);
            }
            tried.sort();
            tried.dedup();
            assert_eq!(tried.len(), 3, "{balance:?}");
        }
    }

    #[tokio::test]
    async fn max_fails_take_a_server_out_and_a_success_brings_it_back() {
        let metrics = Metrics::new();
        let pool = Arc::new(
            Pool::resolve(&upstream(Balance::RoundRobin, &THREE, 2), &metrics)
                .await
                .expect("pool"),
        );
        pool.publish_all();
        let bad = pool.servers[0].addr;
        pool.report(bad, false);
        let picks = |n| {
            (0..n)
                .map(|_| pool.pick(client(1), &[]).addr)
                .collect::<Vec<_>>()
        };
        assert!(picks(6).contains(&bad), "one failure of two keeps it in");
        pool.report(bad, false);
        assert!(
            !picks(30).contains(&bad),
            "two consecutive failures take it out"
        );
        let gauge = |s: &str| metrics.upstream_health.with_label_values(&["u", s]).get();
        assert_eq!((gauge(THREE[0]), gauge(THREE[1])), (0, 1));
        pool.report(bad, true);
        assert!(picks(6).contains(&bad));
        assert_eq!(gauge(THREE[0]), 1);
    }

    #[tokio::test]
    async fn with_hash_a_server_out_moves_only_its_own_clients() {
        let pool = Arc::new(
            Pool::resolve(&upstream(Balance::Hash, &THREE, 1), &Metrics::new())
                .await
                .expect("pool"),
        );
        let before: Vec<SocketAddr> = (0..3000).map(|i| pool.pick(client(i), &[]).addr).collect();
        for s in &pool.servers {
            let share = before.iter().filter(|a| **a == s.addr).count();
            assert!(share > 600, "{} has only {share} of 3000 clients", s.addr);
        }
        let gone = pool.servers[1].addr;
        pool.report(gone, false);
        for (i, was) in before.iter().enumerate() {
            let now = pool.pick(client(i as u32), &[]).addr;
            if *was == gone {
                assert_ne!(now, gone);
            } else {
                assert_eq!(now, *was, "client {i} moved");
            }
        }
    }

    #[tokio::test]
    async fn a_health_check_ends_when_its_pool_is_retired_or_dropped() {
        let mut config = upstream(Balance::RoundRobin, &["127.0.0.1:1"], 1);
        let interval = Duration::from_millis(10);
        config.health_check = Some(crate::config::HealthCheck {
            interval,
            path: None,
            timeout: interval,
        });
        let metrics = Metrics::new();
        let ends = |task: tokio::task::JoinHandle<()>| async move {
            tokio::time::timeout(Duration::from_secs(2), task)
                .await
                .is_ok()
        };
        let pool = Arc::new(Pool::resolve(&config, &metrics).await.expect("pool"));
        let task = tokio::spawn(health_check(Arc::downgrade(&pool), interval));
        tokio::time::sleep(5 * interval).await;
        assert!(!task.is_finished());
        // A reload retires it (an in-flight request may still hold the old pool)...
        hand_over(std::slice::from_ref(&pool), &[], &metrics);
        assert!(ends(task).await, "still checking after the reload");
        // ...and a pool that is dropped ends its check as well.
        let pool = Arc::new(Pool::resolve(&config, &metrics).await.expect("pool"));
        let task = tokio::spawn(health_check(Arc::downgrade(&pool), interval));
        tokio::time::sleep(5 * interval).await;
        drop(pool);
        assert!(ends(task).await, "still checking a dropped pool");
    }

    /// The per-request cost of choosing a server through Pingora's selectors, next to the
    /// hand-written pick this module had before (a Vec of healthy servers, blake3 of the IP).
    #[tokio::test]
    async fn selection_cost() {
        const N: u32 = 200_000;
        let servers = ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80", "10.0.0.4:80"];
        let mut report = Vec::new();
        for balance in [Balance::RoundRobin, Balance::Hash] {
            let pool = Pool::resolve(&upstream(balance, &servers, 1), &Metrics::new())
                .await
                .expect("pool");
            let start = Instant::now();
            let mut sum = 0u64;
            for i in 0..N {
                sum += u64::from(pool.pick(client(i), &[]).addr.port());
            }
            let ns = start.elapsed().as_nanos() / u128::from(N);
            assert_eq!(sum, 80 * u64::from(N));
            report.push(format!("{balance:?}: {ns} ns"));
            assert!(ns < 5_000, "{balance:?} pick takes {ns} ns");
        }
        let healthy: Vec<AtomicBool> = servers.iter().map(|_| AtomicBool::new(true)).collect();
        let start = Instant::now();
        let mut sum = 0usize;
        for i in 0..N {
            let up: Vec<usize> = (0..servers.len())
                .filter(|&s| healthy[s].load(Ordering::Relaxed))
                .collect();
            let digest = blake3::hash(client(i).to_string().as_bytes());
            let b = digest.as_bytes();
            let h = u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
            sum += up[(h % up.len() as u64) as usize];
        }
        let ns = start.elapsed().as_nanos() / u128::from(N);
        assert!(sum > 0);
        println!(
            "pick per request: {}; hand-written hash: {ns} ns",
            report.join(", ")
        );
    }
}

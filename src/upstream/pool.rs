//! Upstream server pools: resolving their servers (once per config, or on an interval with
//! `resolve`: the `resolve` module), choosing one per request, active and passive health,
//! `sluice_upstream_health`.
//!
//! A pool without `resolve` has a fixed list of servers, read on the request path as it
//! always was. With `resolve`, the list is an `ArcSwap` that a new answer replaces whole,
//! each address still present keeping its `Server` (its passive health) and, through
//! Pingora's own `ServiceDiscovery` and `LoadBalancer::update`, its active health: the
//! balancer's discovery (`Discovered`) returns the pool's current addresses, and `update`
//! rebuilds the selector while keeping the health of every backend still present. Pingora
//! pools idle upstream connections by peer and offers no way to close one peer's, so an
//! address that leaves is drained by never being picked again: requests in flight finish,
//! and its idle connections close at `keepalive_timeout` or when the server closes them.
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

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora::lb::discovery::ServiceDiscovery;
use pingora::lb::health_check;
use pingora::lb::selection::{BackendIter, BackendSelection, Consistent, Random, RoundRobin};
use pingora::lb::{Backend, Backends, LoadBalancer};
use pingora::prelude::*;
use prometheus::{IntGauge, IntGaugeVec};

use crate::config::{Balance, Config, Upstream};
use crate::metrics::Metrics;

mod health;
mod resolve;

use health::{probe_targets, Probe, ProbeTarget};
use resolve::{Dns, Inside};

/// Why a name whose every address was refused does not resolve (after "cannot resolve
/// server NAME").
const REFUSED: &str = ": every address it resolves to is refused (see the log)";

pub struct Server {
    pub addr: SocketAddr,
    /// The `server` label of `sluice_upstream_health`: as written in `servers`, or, in an
    /// upstream with `resolve`, `HOST:PORT@IP` for each address its name resolves to.
    pub name: String,
    /// As written in `servers` (the Host of HTTP health checks).
    pub written: String,
    backend: Backend,
    /// The last active check's verdict (true without active checks).
    checked_up: AtomicBool,
    /// Passive checks: consecutive connect errors or timeouts...
    fails: AtomicU32,
    /// ...and, once they reach `max_fails`, when the server is tried again (milliseconds
    /// since `Pool::born`; 0 = in service).
    out_until_ms: AtomicU64,
    gauge: IntGauge,
    /// The peer of every try to this server, built at the first (`Upstream::peer`) and
    /// shared: a peer boxed per try was 672 bytes written into memory that is cold when
    /// many connections are in flight. A config load builds new servers, so new peers.
    pub peer: OnceLock<Arc<HttpPeer>>,
}

/// What `Pool::pick` chose: the address a request connects to.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Picked {
    addr: SocketAddr,
}

/// A pool's servers: fixed for the life of the pool, or, with `resolve`, a set that
/// re-resolving replaces whole (a server still present is the same `Arc`, its health with it).
pub struct Servers(Members);

enum Members {
    Fixed(Vec<Arc<Server>>),
    Resolved(ArcSwap<Vec<Arc<Server>>>),
}

impl Servers {
    /// `f` over the servers as they are now (no allocation, no reference count touched).
    #[inline]
    fn with<R>(&self, f: impl FnOnce(&[Arc<Server>]) -> R) -> R {
        match &self.0 {
            Members::Fixed(list) => f(list),
            Members::Resolved(set) => f(&set.load()),
        }
    }

    pub fn len(&self) -> usize {
        self.with(<[_]>::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The servers as they are now (a copy of the list: for reports, not requests).
    pub fn iter(&self) -> std::vec::IntoIter<Arc<Server>> {
        self.with(<[_]>::to_vec).into_iter()
    }
}

enum Balancer {
    RoundRobin(LoadBalancer<RoundRobin>),
    Random(LoadBalancer<Random>),
    Hash(LoadBalancer<Consistent>),
}

pub struct Pool {
    pub config: Upstream,
    /// One per distinct address, in config order.
    pub servers: Servers,
    balancer: Balancer,
    /// The backends the balancer's discovery returns: the addresses of `servers`.
    discovered: Arc<ArcSwap<BTreeSet<Backend>>>,
    /// Active checks: one per address, following `servers`.
    probes: Option<Arc<ArcSwap<Vec<ProbeTarget>>>>,
    born: Instant,
    /// Set when a reload replaced this pool: it no longer checks or writes metrics.
    retired: AtomicBool,
    /// `resolve` only: what re-resolving needs.
    resolving: Option<resolve::Resolving>,
}

/// The pools of `config`, in `config.upstreams` order. The DNS client of `resolve` is built
/// only when an upstream has it (one per config: a reload reads `resolvers` again).
pub async fn pools(config: &Config, metrics: &Metrics) -> Result<Vec<Arc<Pool>>, String> {
    let inside = Inside::of(config);
    let dns = if config.upstreams.iter().any(|u| u.resolve.is_some()) {
        Some(Arc::new(Dns::new(
            &config.server.resolvers,
            inside.clone(),
        )?))
    } else {
        None
    };
    let mut pools = Vec::with_capacity(config.upstreams.len());
    for upstream in &config.upstreams {
        pools.push(Arc::new(
            Pool::resolve(upstream, dns.clone(), &inside, metrics).await?,
        ));
    }
    Ok(pools)
}

impl Pool {
    /// Resolves every server name once; a name that does not resolve is an error. Without
    /// `resolve` a name is the first address the system resolver gives (/etc/hosts
    /// included); with it, every A and AAAA address `dns` finds, each a server. Either way
    /// a name's addresses that `inside` refuses are dropped; a name left with none is an
    /// error.
    pub async fn resolve(
        config: &Upstream,
        dns: Option<Arc<Dns>>,
        inside: &Inside,
        metrics: &Metrics,
    ) -> Result<Pool, String> {
        let cannot = |name: &str, e: &dyn std::fmt::Display| {
            format!("upstream {}: cannot resolve server {name}{e}", config.name)
        };
        let mut found: Vec<(usize, SocketAddr)> = Vec::with_capacity(config.servers.len());
        let mut resolving = None;
        match (config.resolve, dns) {
            (Some(every), Some(dns)) => {
                let mut valid_until: Option<Instant> = None;
                for (i, name) in config.servers.iter().enumerate() {
                    let answer = dns
                        .lookup(&config.name, name)
                        .await
                        .map_err(|e| cannot(name, &e))?;
                    if answer.addrs.is_empty() {
                        return Err(cannot(name, &REFUSED));
                    }
                    found.extend(answer.addrs.into_iter().map(|a| (i, a)));
                    valid_until = resolve::earliest(valid_until, answer.until);
                }
                resolving = Some(resolve::Resolving::new(dns, every, valid_until, metrics));
            }
            _ => {
                for (i, name) in config.servers.iter().enumerate() {
                    let mut addrs: Vec<SocketAddr> = tokio::net::lookup_host(name.as_str())
                        .await
                        .map_err(|_| cannot(name, &""))?
                        .collect();
                    if addrs.is_empty() {
                        return Err(cannot(name, &""));
                    }
                    if name.parse::<SocketAddr>().is_err() {
                        inside.screen(&config.name, name, &mut addrs);
                    }
                    let addr = addrs.first().ok_or_else(|| cannot(name, &REFUSED))?;
                    found.push((i, *addr));
                }
            }
        }
        let mut servers: Vec<Arc<Server>> = Vec::with_capacity(found.len());
        for (i, addr) in found {
            if !servers.iter().any(|s| s.addr == addr) {
                servers.push(Arc::new(Server::new(
                    config,
                    i,
                    addr,
                    &metrics.upstream_health,
                )));
            }
        }
        let discovered = Arc::new(ArcSwap::from_pointee(backends_of(&servers)));
        let probes = config.health_check.as_ref().map(|hc| {
            Arc::new(ArcSwap::from_pointee(probe_targets(
                config,
                &servers,
                hc,
                &[],
            )))
        });
        let probe =
            |hc: &crate::config::HealthCheck| -> Box<dyn health_check::HealthCheck + Send + Sync> {
                Box::new(Probe::new(probes.clone().unwrap_or_default(), hc.timeout))
            };
        let probe = config.health_check.as_ref().map(probe);
        let lb_error = |e: Box<Error>| format!("upstream {}: {e}", config.name);
        let balancer = match config.balance {
            Balance::RoundRobin => {
                Balancer::RoundRobin(balancer(&discovered, probe).await.map_err(lb_error)?)
            }
            Balance::Random => {
                Balancer::Random(balancer(&discovered, probe).await.map_err(lb_error)?)
            }
            Balance::Hash => Balancer::Hash(balancer(&discovered, probe).await.map_err(lb_error)?),
        };
        let servers = Servers(if resolving.is_some() {
            Members::Resolved(ArcSwap::from_pointee(servers))
        } else {
            Members::Fixed(servers)
        });
        Ok(Pool {
            config: config.clone(),
            servers,
            balancer,
            discovered,
            probes,
            born: Instant::now(),
            retired: AtomicBool::new(false),
            resolving,
        })
    }

    /// A server for this request, never one in `tried` while another is left: a healthy one
    /// in service if there is one, else any (when every server is down, all are tried rather
    /// than none). With `hash` the client's IP picks its place on the ketama ring. `f` sees
    /// it while the set is held, so no reference count is touched (`None` only for a pool
    /// without servers, which neither a load nor re-resolving leaves).
    #[inline]
    pub fn pick_with<R>(
        &self,
        client_ip: IpAddr,
        tried: &[SocketAddr],
        f: impl FnOnce(Option<&Server>) -> R,
    ) -> R {
        self.servers
            .with(|servers| f(self.pick_in(servers, client_ip, tried)))
    }

    /// `pick_with`'s address.
    #[cfg(test)]
    fn pick(&self, client_ip: IpAddr, tried: &[SocketAddr]) -> Picked {
        self.pick_with(client_ip, tried, |server| Picked {
            addr: server.map_or(SocketAddr::from(([0, 0, 0, 0], 0)), |s| s.addr),
        })
    }

    fn pick_in<'s>(
        &self,
        servers: &'s [Arc<Server>],
        client_ip: IpAddr,
        tried: &[SocketAddr],
    ) -> Option<&'s Server> {
        if let [only] = servers {
            // Every path below ends at the one server; skip the balancer's walk (about 2 %
            // of a proxied request's instructions, callgrind).
            return Some(only);
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
        let steps = 160 * servers.len();
        let chosen = self
            .select(key, steps, |b, healthy| {
                healthy && fresh(b) && server_of(servers, b).is_some_and(|s| s.in_service(now))
            })
            .or_else(|| self.select(key, steps, |b, _| fresh(b)));
        chosen
            .and_then(|b| server_of(servers, &b))
            .or_else(|| servers.iter().find(|s| !tried.contains(&s.addr)))
            .or_else(|| servers.first())
            .map(|s| &**s)
    }

    /// `steps`: enough to walk the whole ketama ring (160 points per server); the weighted
    /// selectors need far fewer, and `pick` falls back to a plain scan anyway.
    fn select(
        &self,
        key: &[u8],
        steps: usize,
        accept: impl Fn(&Backend, bool) -> bool,
    ) -> Option<Backend> {
        match &self.balancer {
            Balancer::RoundRobin(lb) => lb.select_with(key, steps, accept),
            Balancer::Random(lb) => lb.select_with(key, steps, accept),
            Balancer::Hash(lb) => lb.select_with(key, steps, accept),
        }
    }

    fn backends(&self) -> &pingora::lb::Backends {
        match &self.balancer {
            Balancer::RoundRobin(lb) => lb.backends(),
            Balancer::Random(lb) => lb.backends(),
            Balancer::Hash(lb) => lb.backends(),
        }
    }

    /// The balancer reads `discovered` again: a server that left is no longer chosen, a
    /// new one is; Pingora keeps the active health of every backend still present.
    async fn rediscover(&self) -> Result<()> {
        match &self.balancer {
            Balancer::RoundRobin(lb) => lb.update().await,
            Balancer::Random(lb) => lb.update().await,
            Balancer::Hash(lb) => lb.update().await,
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
    /// (nginx's semantics). With `resolve`, a failure also asks for an early re-resolve.
    pub fn report(self: &Arc<Self>, addr: SocketAddr, ok: bool) {
        if !ok {
            if let Some(r) = &self.resolving {
                r.wake();
            }
        }
        self.servers.with(|servers| {
            if let Some(server) = servers.iter().find(|s| s.addr == addr) {
                self.report_on(server, ok);
            }
        });
    }

    fn report_on(self: &Arc<Self>, server: &Server, ok: bool) {
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
                p.servers.with(|servers| {
                    if let Some(s) = servers.iter().find(|s| s.addr == addr) {
                        p.publish(s);
                    }
                });
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
        self.servers.with(|servers| {
            for s in servers {
                self.publish(s);
            }
        });
    }

    /// One active pass over every server, then the gauges and the log follow the verdicts.
    async fn check_once(&self) {
        self.backends().run_health_check(true).await;
        for s in self.servers.iter() {
            // Pingora logs a server going down as a warning, with the check's error, and
            // its recovery at info, which sluice's default filter hides: say it here.
            let up = self.backends().ready(&s.backend);
            if up && !s.checked_up.swap(up, Ordering::Relaxed) {
                log::info!("{} passes its health check again", self.name_of(&s));
            }
            s.checked_up.store(up, Ordering::Relaxed);
            self.publish(&s);
        }
    }

    /// With `resolve`: makes `found` (config index of the name, address), in that order,
    /// the pool's servers. A server whose address is still present stays as it is (passive
    /// and active health included); one whose address is gone is drained: no new request
    /// is sent to it, and its series leaves `sluice_upstream_health`. Returns whether the
    /// set of addresses changed.
    async fn replace(&self, found: Vec<(usize, SocketAddr)>) -> bool {
        let (Members::Resolved(set), Some(r)) = (&self.servers.0, &self.resolving) else {
            return false;
        };
        let old = set.load_full();
        let mut next: Vec<Arc<Server>> = Vec::with_capacity(found.len());
        for (i, addr) in found {
            if next.iter().any(|s| s.addr == addr) {
                continue;
            }
            let kept = old.iter().find(|s| s.addr == addr).cloned();
            next.push(
                kept.unwrap_or_else(|| Arc::new(Server::new(&self.config, i, addr, &r.health))),
            );
        }
        let same =
            next.len() == old.len() && next.iter().all(|s| old.iter().any(|o| o.addr == s.addr));
        if same || next.is_empty() {
            return false;
        }
        // Checks first (a pass may start at once on the new set), then the servers, then
        // the balancer: until it has read the new set, what it picks that has left is
        // answered by `pick`'s scan of the new servers.
        if let (Some(probes), Some(hc)) = (&self.probes, &self.config.health_check) {
            let targets = probe_targets(&self.config, &next, hc, &probes.load());
            probes.store(Arc::new(targets));
        }
        set.store(Arc::new(next.clone()));
        self.discovered.store(Arc::new(backends_of(&next)));
        if let Err(e) = self.rediscover().await {
            log::warn!("upstream {}: servers not updated: {e}", self.config.name);
        }
        let retired = self.retired.load(Ordering::Relaxed);
        for s in old
            .iter()
            .filter(|s| !next.iter().any(|n| n.addr == s.addr))
        {
            log::warn!("{} left its name's addresses: drained", self.name_of(s));
            if !retired {
                let _ = r
                    .health
                    .remove_label_values(&[self.config.name.as_str(), s.name.as_str()]);
            }
        }
        for s in next
            .iter()
            .filter(|s| !old.iter().any(|o| o.addr == s.addr))
        {
            log::warn!("{} joined: in service", self.name_of(s));
            self.publish(s);
        }
        true
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        if let Some(r) = &self.resolving {
            r.wake(); // its task ends now
        }
    }
}

impl Server {
    /// The server at `addr` that name `i` of `config.servers` resolved to.
    fn new(config: &Upstream, i: usize, addr: SocketAddr, health: &IntGaugeVec) -> Server {
        let written = config.servers.get(i).cloned().unwrap_or_default();
        // The address as written (an IP address) keeps the name as written.
        let as_written = written
            .rsplit_once(':')
            .map(|(host, _)| host.trim_start_matches('[').trim_end_matches(']'))
            .and_then(|host| host.parse::<IpAddr>().ok())
            == Some(addr.ip());
        let name = if config.resolve.is_some() && !as_written {
            format!("{written}@{}", addr.ip())
        } else {
            written.clone()
        };
        let backend = Backend {
            addr: pingora::protocols::l4::socket::SocketAddr::Inet(addr),
            weight: 1,
            ext: Default::default(),
        };
        Server {
            addr,
            gauge: health.with_label_values(&[config.name.as_str(), name.as_str()]),
            name,
            written,
            backend,
            checked_up: AtomicBool::new(true),
            fails: AtomicU32::new(0),
            out_until_ms: AtomicU64::new(0),
            peer: OnceLock::new(),
        }
    }

    fn in_service(&self, now_ms: u64) -> bool {
        now_ms >= self.out_until_ms.load(Ordering::Relaxed)
    }
}

fn server_of<'a>(servers: &'a [Arc<Server>], backend: &Backend) -> Option<&'a Arc<Server>> {
    let addr = backend.as_inet()?;
    servers.iter().find(|s| s.addr == *addr)
}

fn backends_of(servers: &[Arc<Server>]) -> BTreeSet<Backend> {
    servers.iter().map(|s| s.backend.clone()).collect()
}

/// What the balancer's `update` reads: the pool's current addresses (Pingora's own
/// `Static` discovery, with a set the pool can replace).
struct Discovered(Arc<ArcSwap<BTreeSet<Backend>>>);

#[async_trait]
impl ServiceDiscovery for Discovered {
    async fn discover(&self) -> Result<(BTreeSet<Backend>, HashMap<u64, bool>)> {
        Ok((BTreeSet::clone(&self.0.load()), HashMap::new()))
    }
}

/// A Pingora balancer over `discovered`, with the pool's active check.
async fn balancer<S>(
    discovered: &Arc<ArcSwap<BTreeSet<Backend>>>,
    probe: Option<Box<dyn health_check::HealthCheck + Send + Sync>>,
) -> Result<LoadBalancer<S>>
where
    S: BackendSelection + 'static,
    S::Iter: BackendIter,
{
    let backends = Backends::new(Box::new(Discovered(discovered.clone())));
    let lb = with_probe(LoadBalancer::from_backends(backends), probe);
    lb.update().await?;
    Ok(lb)
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

/// Starts the health checks of every pool that has one and the re-resolving of every
/// pool with `resolve`, on the current runtime: each task ends when its pool is dropped or
/// retired by a reload.
pub(super) fn start(pools: &[Arc<Pool>]) {
    health::spawn_health_checks(pools);
    spawn_resolves(pools);
}

/// Starts the re-resolving of every pool with `resolve`, on the current runtime: each task
/// ends when its pool is dropped or retired by a reload.
fn spawn_resolves(pools: &[Arc<Pool>]) {
    for pool in pools {
        if pool.resolving.is_some() {
            tokio::spawn(resolve::run(Arc::downgrade(pool)));
        }
    }
}

/// Hands the gauges over from `old` pools (a reload) to `new` ones: the old stop writing
/// them, series of servers no longer configured are dropped, the rest show the new state.
pub(super) fn hand_over(old: &[Arc<Pool>], new: &[Arc<Pool>], metrics: &Metrics) {
    // Primed with the load, not when the tasks start: the first config's start waits for
    // sluice's own listeners, and a scrape before that must see the series already.
    for pool in new {
        if let Some(r) = &pool.resolving {
            r.prime(&pool.config.name);
        }
    }
    for pool in old {
        pool.retired.store(true, Ordering::Relaxed);
        if let Some(r) = &pool.resolving {
            r.wake(); // its task ends now
        }
        for s in pool.servers.iter() {
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
    use super::health::health_check;
    use super::*;
    use std::time::Duration;

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
            resolve: None,
            adaptive: None,
            tls_files: Default::default(),
            retries: None,
        }
    }

    const THREE: [&str; 3] = ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"];

    fn client(i: u32) -> IpAddr {
        IpAddr::V4(std::net::Ipv4Addr::from(0x0a01_0000 + i))
    }

    #[tokio::test]
    async fn a_retry_never_repeats_a_server_while_another_is_left() {
        for balance in [Balance::RoundRobin, Balance::Random, Balance::Hash] {
            let pool = Pool::resolve(
                &upstream(balance, &THREE, 1),
                None,
                &Inside::default(),
                &Metrics::new(),
            )
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
            Pool::resolve(
                &upstream(Balance::RoundRobin, &THREE, 2),
                None,
                &Inside::default(),
                &metrics,
            )
            .await
            .expect("pool"),
        );
        pool.publish_all();
        let bad = pool.servers.iter().next().expect("a server").addr;
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
            Pool::resolve(
                &upstream(Balance::Hash, &THREE, 1),
                None,
                &Inside::default(),
                &Metrics::new(),
            )
            .await
            .expect("pool"),
        );
        let before: Vec<SocketAddr> = (0..3000).map(|i| pool.pick(client(i), &[]).addr).collect();
        for s in pool.servers.iter() {
            let share = before.iter().filter(|a| **a == s.addr).count();
            assert!(share > 600, "{} has only {share} of 3000 clients", s.addr);
        }
        let gone = pool.servers.iter().nth(1).expect("a server").addr;
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
        let pool = Arc::new(
            Pool::resolve(&config, None, &Inside::default(), &metrics)
                .await
                .expect("pool"),
        );
        let task = tokio::spawn(health_check(Arc::downgrade(&pool), interval));
        tokio::time::sleep(5 * interval).await;
        assert!(!task.is_finished());
        // A reload retires it (an in-flight request may still hold the old pool)...
        hand_over(std::slice::from_ref(&pool), &[], &metrics);
        assert!(ends(task).await, "still checking after the reload");
        // ...and a pool that is dropped ends its check as well.
        let pool = Arc::new(
            Pool::resolve(&config, None, &Inside::default(), &metrics)
                .await
                .expect("pool"),
        );
        let task = tokio::spawn(health_check(Arc::downgrade(&pool), interval));
        tokio::time::sleep(5 * interval).await;
        drop(pool);
        assert!(ends(task).await, "still checking a dropped pool");
    }

    #[tokio::test]
    async fn a_new_answer_keeps_the_health_of_the_addresses_still_in_it() {
        let metrics = Metrics::new();
        let mut config = upstream(Balance::RoundRobin, &THREE[..2], 1);
        config.resolve = Some(Duration::from_secs(1));
        let dns = Arc::new(
            Dns::new(&["127.0.0.1:9".parse().expect("addr")], Inside::default()).expect("dns"),
        );
        let pool = Arc::new(
            Pool::resolve(&config, Some(dns), &Inside::default(), &metrics)
                .await
                .expect("pool"),
        );
        pool.publish_all();
        let addr = |s: &str| s.parse::<SocketAddr>().expect("addr");
        let (one, two, three) = (addr(THREE[0]), addr(THREE[1]), addr(THREE[2]));
        pool.report(one, false);
        let gauge = |s: &str| metrics.upstream_health.with_label_values(&["u", s]).get();
        assert_eq!(gauge(THREE[0]), 0, "out after max_fails");
        // The name now gives `one` and `three`: `two` leaves, `three` joins.
        assert!(pool.replace(vec![(0, one), (0, three)]).await);
        let picks: Vec<SocketAddr> = (0..20).map(|_| pool.pick(client(1), &[]).addr).collect();
        assert!(picks.iter().all(|a| *a == three), "{picks:?}");
        assert_eq!(gauge(THREE[0]), 0, "`one` kept its passive health");
        let series = String::from_utf8(metrics.render()).expect("text");
        assert!(
            !series.contains(&format!("server=\"{}\"", THREE[1])),
            "{series}"
        );
        assert_eq!(gauge("10.0.0.1:80@10.0.0.3"), 1);
        // The same set again changes nothing.
        assert!(!pool.replace(vec![(0, three), (0, one)]).await);
        pool.report(one, true);
        let picks: Vec<SocketAddr> = (0..20).map(|_| pool.pick(client(1), &[]).addr).collect();
        assert!(picks.contains(&one) && picks.contains(&three) && !picks.contains(&two));
    }

    #[tokio::test]
    async fn re_resolving_ends_when_its_pool_is_retired_or_dropped() {
        let metrics = Metrics::new();
        let mut config = upstream(Balance::RoundRobin, &THREE, 1);
        config.resolve = Some(Duration::from_secs(3600));
        let dns = Arc::new(
            Dns::new(&["127.0.0.1:9".parse().expect("addr")], Inside::default()).expect("dns"),
        );
        let ends = |task: tokio::task::JoinHandle<()>| async move {
            tokio::time::timeout(Duration::from_secs(2), task)
                .await
                .is_ok()
        };
        let pool = Pool::resolve(&config, Some(dns.clone()), &Inside::default(), &metrics).await;
        let pool = Arc::new(pool.expect("pool"));
        let task = tokio::spawn(resolve::run(Arc::downgrade(&pool)));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!task.is_finished());
        hand_over(std::slice::from_ref(&pool), &[], &metrics);
        assert!(ends(task).await, "still re-resolving after the reload");
        let pool = Pool::resolve(&config, Some(dns), &Inside::default(), &metrics).await;
        let pool = Arc::new(pool.expect("pool"));
        let task = tokio::spawn(resolve::run(Arc::downgrade(&pool)));
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(pool);
        assert!(ends(task).await, "still re-resolving a dropped pool");
    }

    /// The per-request cost of choosing a server through Pingora's selectors, next to the
    /// hand-written pick this module had before (a Vec of healthy servers, blake3 of the IP).
    #[tokio::test]
    async fn selection_cost() {
        const N: u32 = 200_000;
        let servers = ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80", "10.0.0.4:80"];
        let mut report = Vec::new();
        for balance in [Balance::RoundRobin, Balance::Hash] {
            let pool = Pool::resolve(
                &upstream(balance, &servers, 1),
                None,
                &Inside::default(),
                &Metrics::new(),
            )
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

//! `resolve` (DESIGN §20): an upstream's server names asked again on an interval, through
//! hickory's resolver (the `[server] resolvers`, else those of /etc/resolv.conf, with
//! /etc/hosts first), which gives each answer's TTL.
//!
//! One task per pool with `resolve`, holding a `Weak<Pool>` as the health checks do, so it
//! ends when a reload retires the pool or the pool is dropped. When it asks:
//! - every `resolve` after the last ask, but never before the last answers expire: the TTL
//!   is a floor, so the next ask is at `max(resolve, TTL)` after the last (the shortest TTL
//!   of the upstream's names);
//! - after a failure (a connect error or timeout on one of its servers), as soon as that
//!   floor allows, and at least a second after the last ask.
//!
//! Each pass counts one `sluice_upstream_resolve_total{upstream, result}`: `changed` (the
//! set of addresses differs), `unchanged`, or `error` (a name did not resolve: its last
//! addresses are kept; the other names' answers still apply).

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use hickory_resolver::config::{LookupIpStrategy, NameServerConfig, ResolveHosts, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::{Resolver, TokioResolver};
use prometheus::{IntCounterVec, IntGaugeVec};
use tokio::sync::Notify;

use super::Pool;
use crate::metrics::Metrics;

/// Never two asks closer than this, whatever wakes the task.
const MIN_GAP: Duration = Duration::from_secs(1);

/// `sluice_upstream_resolve_total`'s results.
const RESULTS: [&str; 3] = ["changed", "unchanged", "error"];

/// The DNS client of one config: its `[server] resolvers` (UDP, then TCP when an answer is
/// truncated) or those of /etc/resolv.conf; /etc/hosts is read first, as the system's.
pub struct Dns {
    resolver: TokioResolver,
}

impl Dns {
    pub fn new(servers: &[SocketAddr]) -> Result<Dns, String> {
        let mut builder = if servers.is_empty() {
            TokioResolver::builder_tokio()
                .map_err(|e| format!("resolve: cannot read /etc/resolv.conf: {e}"))?
        } else {
            let name_servers = servers
                .iter()
                .map(|addr| {
                    let mut ns = NameServerConfig::udp_and_tcp(addr.ip());
                    for connection in &mut ns.connections {
                        connection.port = addr.port();
                    }
                    ns
                })
                .collect();
            Resolver::builder_with_config(
                ResolverConfig::from_name_servers(name_servers),
                TokioRuntimeProvider::default(),
            )
        };
        let options = builder.options_mut();
        // Every address of a name is a server: ask for both families.
        options.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
        options.use_hosts_file = ResolveHosts::Always;
        let resolver = builder
            .build()
            .map_err(|e| format!("resolve: DNS client: {e}"))?;
        Ok(Dns { resolver })
    }

    /// The addresses of `written` (HOST:PORT) and until when they are good (`None`: an IP
    /// address, good for ever). The error reads after "cannot resolve server NAME".
    pub async fn lookup(
        &self,
        written: &str,
    ) -> Result<(Vec<SocketAddr>, Option<Instant>), String> {
        let Some((host, port)) = written.rsplit_once(':') else {
            return Err(": expected HOST:PORT".into());
        };
        let port: u16 = port.parse().map_err(|_| ": bad port".to_owned())?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = host.parse::<IpAddr>() {
            return Ok((vec![SocketAddr::new(ip, port)], None));
        }
        let answer = self
            .resolver
            .lookup_ip(host)
            .await
            .map_err(|e| format!(": {e}"))?;
        let addrs: Vec<SocketAddr> = answer.iter().map(|ip| SocketAddr::new(ip, port)).collect();
        if addrs.is_empty() {
            return Err(": no address".into());
        }
        Ok((addrs, Some(answer.valid_until())))
    }
}

/// What a pool with `resolve` keeps for its task.
pub(super) struct Resolving {
    dns: Arc<Dns>,
    every: Duration,
    /// When the load asked, and until when its answers are good.
    loaded_at: Instant,
    loaded_until: Option<Instant>,
    /// A failure on one of the pool's servers: re-resolve early.
    wake: Arc<Notify>,
    pub(super) health: IntGaugeVec,
    results: IntCounterVec,
}

impl Resolving {
    pub(super) fn new(
        dns: Arc<Dns>,
        every: Duration,
        loaded_until: Option<Instant>,
        metrics: &Metrics,
    ) -> Resolving {
        Resolving {
            dns,
            every,
            loaded_at: Instant::now(),
            loaded_until,
            wake: Arc::new(Notify::new()),
            health: metrics.upstream_health.clone(),
            results: metrics.upstream_resolves.clone(),
        }
    }

    pub(super) fn wake(&self) {
        self.wake.notify_one();
    }

    /// Every result's series exists at 0 from the load that brings `resolve` (a counter
    /// already kept by a reload keeps its count).
    pub(super) fn prime(&self, upstream: &str) {
        for result in RESULTS {
            let _ = self.results.with_label_values(&[upstream, result]);
        }
    }
}

/// The earlier of two expiries, `None` being never.
pub(super) fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Re-resolves `pool`'s names until the pool is retired or dropped.
pub(super) async fn run(pool: Weak<Pool>) {
    let (wake, every, mut asked, mut valid_until) = {
        let Some(p) = pool.upgrade() else { return };
        let Some(r) = &p.resolving else { return };
        (r.wake.clone(), r.every, r.loaded_at, r.loaded_until)
    };
    loop {
        let floor = valid_until
            .map_or(asked, |t| t.max(asked))
            .max(asked + MIN_GAP);
        let due = (asked + every).max(floor);
        tokio::select! {
            () = tokio::time::sleep_until(due.into()) => {}
            () = wake.notified() => {
                // A failure, or the pool retired or dropped (they wake the task too).
                if !alive(&pool) {
                    return;
                }
                tokio::time::sleep_until(floor.into()).await;
            }
        }
        if !alive(&pool) {
            return;
        }
        let Some(p) = pool.upgrade() else { return };
        asked = Instant::now();
        valid_until = pass(&p).await;
    }
}

fn alive(pool: &Weak<Pool>) -> bool {
    pool.upgrade()
        .is_some_and(|p| !p.retired.load(std::sync::atomic::Ordering::Relaxed))
}

/// One pass over the pool's names; returns until when the answers are good.
async fn pass(p: &Pool) -> Option<Instant> {
    let r = p.resolving.as_ref()?;
    let current: Vec<_> = p.servers.iter().collect();
    let mut found = Vec::with_capacity(current.len());
    let mut failed = false;
    let mut valid_until = None;
    for (i, name) in p.config.servers.iter().enumerate() {
        match r.dns.lookup(name).await {
            Ok((addrs, until)) => {
                found.extend(addrs.into_iter().map(|a| (i, a)));
                valid_until = earliest(valid_until, until);
            }
            Err(e) => {
                failed = true;
                log::warn!(
                    "upstream {}: cannot resolve server {name}{e}; keeping its last addresses",
                    p.config.name
                );
                let last = current.iter().filter(|s| s.written == *name);
                found.extend(last.map(|s| (i, s.addr)));
            }
        }
    }
    let changed = p.replace(found).await;
    let result = match (failed, changed) {
        (true, _) => "error",
        (false, true) => "changed",
        (false, false) => "unchanged",
    };
    if !p.retired.load(std::sync::atomic::Ordering::Relaxed) {
        r.results
            .with_label_values(&[p.config.name.as_str(), result])
            .inc();
    }
    valid_until
}

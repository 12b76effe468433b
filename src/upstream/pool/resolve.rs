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
//! set of addresses differs), `unchanged`, `error` (a name did not resolve: its last
//! addresses are kept; the other names' answers still apply), or `refused` (an answer held
//! an address a name may not lead to, `Inside`: dropped, and a name left with none keeps
//! its last addresses).

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use hickory_resolver::config::{LookupIpStrategy, NameServerConfig, ResolveHosts, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::{Resolver, TokioResolver};
use prometheus::{IntCounterVec, IntGaugeVec};
use tokio::sync::Notify;

use super::Pool;
use crate::config::Config;
use crate::metrics::Metrics;

/// Never two asks closer than this, whatever wakes the task.
const MIN_GAP: Duration = Duration::from_secs(1);

/// `sluice_upstream_resolve_total`'s results.
const RESULTS: [&str; 4] = ["changed", "unchanged", "error", "refused"];

/// Where a server name may not lead (DESIGN §21): addresses no upstream has (unspecified,
/// link-local, where cloud metadata answers, multicast), and sluice's own listeners (a
/// loopback address at a port sluice listens on). An address written literally in
/// `servers` is the operator's choice and never screened.
#[derive(Clone, Debug, Default)]
pub struct Inside {
    /// The ports of every listener of the config: proxy, TLS, admin, RLS.
    ports: Vec<u16>,
}

impl Inside {
    pub fn of(config: &Config) -> Inside {
        let server = &config.server;
        let listeners = server.listen.iter().chain(&server.tls_listen);
        let rls = config.rls.as_ref().map(|r| r.listen);
        let ports = listeners
            .copied()
            .chain([config.admin.listen])
            .chain(rls)
            .map(|a| a.port())
            .collect();
        Inside { ports }
    }

    /// Whether a name's answer `addr` is refused.
    pub fn refuses(&self, addr: SocketAddr) -> bool {
        let ip = addr.ip().to_canonical();
        let nowhere = match ip {
            IpAddr::V4(v4) => {
                v4.octets()[0] == 0 || v4.is_link_local() || v4.is_multicast() || v4.is_broadcast()
            }
            IpAddr::V6(v6) => {
                v6.is_unspecified() || (v6.segments()[0] & 0xffc0) == 0xfe80 || v6.is_multicast()
            }
        };
        nowhere || (ip.is_loopback() && self.ports.contains(&addr.port()))
    }

    /// `addrs` (the answer for `name`, a name of `upstream`) without the refused ones, each
    /// of which is logged; and whether any was.
    pub fn screen(&self, upstream: &str, name: &str, addrs: &mut Vec<SocketAddr>) -> bool {
        let before = addrs.len();
        addrs.retain(|&addr| {
            let refused = self.refuses(addr);
            if refused {
                log::warn!(
                    "upstream {upstream}: server {name} resolves to {addr}, refused: not an \
                     upstream's address (unspecified, link-local, multicast) or one of \
                     sluice's own listeners"
                );
            }
            !refused
        });
        addrs.len() < before
    }
}

/// The DNS client of one config: its `[server] resolvers` (UDP, then TCP when an answer is
/// truncated) or those of /etc/resolv.conf; /etc/hosts is read first, as the system's.
pub struct Dns {
    resolver: TokioResolver,
    inside: Inside,
}

/// A name's answer, screened by `Inside`.
pub struct Answer {
    pub addrs: Vec<SocketAddr>,
    /// Until when it is good (`None`: an IP address, good for ever).
    pub until: Option<Instant>,
    /// Whether an address was refused (all of them, when `addrs` is empty).
    pub refused: bool,
}

impl Dns {
    pub fn new(servers: &[SocketAddr], inside: Inside) -> Result<Dns, String> {
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
        Ok(Dns { resolver, inside })
    }

    /// The addresses of `written` (HOST:PORT), a server of `upstream`, and until when they
    /// are good. The error reads after "cannot resolve server NAME".
    pub async fn lookup(&self, upstream: &str, written: &str) -> Result<Answer, String> {
        let Some((host, port)) = written.rsplit_once(':') else {
            return Err(": expected HOST:PORT".into());
        };
        let port: u16 = port.parse().map_err(|_| ": bad port".to_owned())?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = host.parse::<IpAddr>() {
            let addrs = vec![SocketAddr::new(ip, port)];
            return Ok(Answer {
                addrs,
                until: None,
                refused: false,
            });
        }
        let answer = self
            .resolver
            .lookup_ip(host)
            .await
            .map_err(|e| format!(": {e}"))?;
        let mut addrs: Vec<SocketAddr> =
            answer.iter().map(|ip| SocketAddr::new(ip, port)).collect();
        if addrs.is_empty() {
            return Err(": no address".into());
        }
        let refused = self.inside.screen(upstream, written, &mut addrs);
        Ok(Answer {
            addrs,
            until: Some(answer.valid_until()),
            refused,
        })
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
    let mut refused = false;
    let mut valid_until = None;
    for (i, name) in p.config.servers.iter().enumerate() {
        match r.dns.lookup(&p.config.name, name).await {
            Ok(answer) if answer.addrs.is_empty() => {
                refused = true;
                let last = current.iter().filter(|s| s.written == *name);
                found.extend(last.map(|s| (i, s.addr)));
                valid_until = earliest(valid_until, answer.until);
            }
            Ok(answer) => {
                refused |= answer.refused;
                found.extend(answer.addrs.into_iter().map(|a| (i, a)));
                valid_until = earliest(valid_until, answer.until);
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
    let result = match (failed, refused, changed) {
        (true, _, _) => "error",
        (false, true, _) => "refused",
        (false, false, true) => "changed",
        (false, false, false) => "unchanged",
    };
    if !p.retired.load(std::sync::atomic::Ordering::Relaxed) {
        r.results
            .with_label_values(&[p.config.name.as_str(), result])
            .inc();
    }
    valid_until
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_may_not_lead_nowhere_or_inside() {
        let inside = Inside {
            ports: vec![8080, 9091],
        };
        let refused = |a: &str| inside.refuses(a.parse().expect("addr"));
        for addr in [
            "0.0.0.0:80",
            "0.1.2.3:80",
            "[::]:80",
            "169.254.169.254:80",
            "[fe80::1]:80",
            "224.0.0.1:80",
            "[ff02::1]:80",
            "255.255.255.255:80",
            "127.0.0.1:9091",
            "127.0.0.2:8080",
            "[::1]:9091",
            "[::ffff:127.0.0.1]:9091",
            "[::ffff:169.254.169.254]:80",
        ] {
            assert!(refused(addr), "{addr} was not refused");
        }
        for addr in [
            "127.0.0.1:8081",
            "[::1]:80",
            "10.0.0.1:9091",
            "192.168.1.1:8080",
            "93.184.216.34:443",
            "[2001:db8::1]:443",
        ] {
            assert!(!refused(addr), "{addr} was refused");
        }
    }
}

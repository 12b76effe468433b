//! Active health checks of a pool's servers: Pingora's `TcpHealthCheck` or `HttpHealthCheck`
//! per server (its own Host and SNI, as requests get them), driven by sluice's own loop, one
//! pass per `interval`, which ends when a reload retires the pool or the pool is dropped.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora::http::RequestHeader;
use pingora::lb::health_check::{self, HttpHealthCheck, TcpHealthCheck};
use pingora::lb::Backend;
use pingora::prelude::*;

use super::{Pool, Server};
use crate::config::Upstream;

/// One Pingora check per server (its own Host and, with TLS, SNI as requests get them),
/// each bounded as a whole by `timeout`; the targets follow the pool's servers.
pub(super) struct Probe {
    targets: Arc<ArcSwap<Vec<ProbeTarget>>>,
    timeout: Duration,
}

impl Probe {
    pub(super) fn new(targets: Arc<ArcSwap<Vec<ProbeTarget>>>, timeout: Duration) -> Probe {
        Probe { targets, timeout }
    }
}

pub(super) struct ProbeTarget {
    addr: SocketAddr,
    check: Arc<dyn health_check::HealthCheck + Send + Sync>,
    /// "upstream NAME server HOST:PORT": what Pingora's log of a flip names.
    name: String,
}

/// The checks of `servers`, reusing those of `kept` for addresses already checked.
pub(super) fn probe_targets(
    config: &Upstream,
    servers: &[Arc<Server>],
    hc: &crate::config::HealthCheck,
    kept: &[ProbeTarget],
) -> Vec<ProbeTarget> {
    servers
        .iter()
        .map(|s| {
            let check = kept.iter().find(|t| t.addr == s.addr).map_or_else(
                || -> Arc<dyn health_check::HealthCheck + Send + Sync> {
                    match &hc.path {
                        None => {
                            let mut tcp = TcpHealthCheck::new();
                            tcp.peer_template.options.connection_timeout = Some(hc.timeout);
                            tcp.peer_template.options.total_connection_timeout = Some(hc.timeout);
                            Arc::<TcpHealthCheck>::from(tcp)
                        }
                        Some(path) => Arc::new(http_check(config, s, path, hc.timeout)),
                    }
                },
                |t| t.check.clone(),
            );
            ProbeTarget {
                addr: s.addr,
                check,
                name: format!("upstream {} server {}", config.name, s.name),
            }
        })
        .collect()
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
        server.written.as_str()
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
        let check = target.as_inet().and_then(|addr| {
            let targets = self.targets.load();
            let target = targets.iter().find(|t| t.addr == *addr)?;
            Some(target.check.clone())
        });
        let Some(check) = check else {
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
        let name = target.as_inet().and_then(|addr| {
            let targets = self.targets.load();
            let target = targets.iter().find(|t| t.addr == *addr)?;
            Some(target.name.clone())
        });
        name.unwrap_or_else(|| format!("{target:?}"))
    }
}

/// Checks each server of `pool` every interval, until the pool is dropped or retired (a
/// reload replaced it).
pub(super) async fn health_check(pool: Weak<Pool>, interval: Duration) {
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
pub(super) fn spawn_health_checks(pools: &[Arc<Pool>]) {
    for pool in pools {
        if let Some(hc) = &pool.config.health_check {
            tokio::spawn(health_check(Arc::downgrade(pool), hc.interval));
        }
    }
}

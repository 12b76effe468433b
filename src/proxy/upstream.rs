//! Upstream server pools: choosing a server and TCP health checks that skip dead ones.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::config::{Balance, Upstream};

pub struct Server {
    pub addr: SocketAddr,
    healthy: AtomicBool,
}

pub struct Pool {
    pub config: Upstream,
    pub servers: Vec<Server>,
    next: AtomicUsize,
}

impl Pool {
    /// Resolves every server name once; a name that does not resolve is an error.
    pub async fn resolve(config: &Upstream) -> Result<Pool, String> {
        let mut servers = Vec::with_capacity(config.servers.len());
        for name in &config.servers {
            let addr = tokio::net::lookup_host(name.as_str())
                .await
                .ok()
                .and_then(|mut addrs| addrs.next())
                .ok_or_else(|| format!("upstream {}: cannot resolve server {name}", config.name))?;
            servers.push(Server {
                addr,
                healthy: AtomicBool::new(true),
            });
        }
        Ok(Pool {
            config: config.clone(),
            servers,
            next: AtomicUsize::new(0),
        })
    }

    /// A server for this request; `attempt` > 0 moves on after a failed connect.
    /// When every server is marked down, all are tried rather than none.
    pub fn pick(&self, client_ip: IpAddr, attempt: usize) -> &Server {
        let healthy: Vec<&Server> = self
            .servers
            .iter()
            .filter(|s| s.healthy.load(Ordering::Relaxed))
            .collect();
        let candidates: Vec<&Server> = if healthy.is_empty() {
            self.servers.iter().collect()
        } else {
            healthy
        };
        let n = candidates.len();
        let first = match self.config.balance {
            Balance::RoundRobin => self.next.fetch_add(1, Ordering::Relaxed),
            Balance::Random => rand::random::<u32>() as usize,
            Balance::Hash => {
                let digest = blake3::hash(client_ip.to_string().as_bytes());
                let b = digest.as_bytes();
                u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as usize
            }
        };
        candidates[(first + attempt) % n]
    }

    pub fn mark(&self, addr: SocketAddr, healthy: bool) {
        for s in self.servers.iter().filter(|s| s.addr == addr) {
            s.healthy.store(healthy, Ordering::Relaxed);
        }
    }
}

/// Checks each server of `pool` by TCP connect every interval, until the pool is dropped
/// (a reload replaced it).
pub async fn health_check(pool: Weak<Pool>, interval: Duration) {
    loop {
        let Some(p) = pool.upgrade() else { return };
        let timeout = p.config.connect_timeout.min(interval);
        let addrs: Vec<SocketAddr> = p.servers.iter().map(|s| s.addr).collect();
        drop(p);
        for addr in addrs {
            let up = matches!(
                tokio::time::timeout(timeout, tokio::net::TcpStream::connect(addr)).await,
                Ok(Ok(_))
            );
            let Some(p) = pool.upgrade() else { return };
            let was = p
                .servers
                .iter()
                .find(|s| s.addr == addr)
                .is_some_and(|s| s.healthy.load(Ordering::Relaxed));
            if was != up {
                log::warn!(
                    "upstream {} server {addr} is {}",
                    p.config.name,
                    if up { "up" } else { "down" }
                );
            }
            p.mark(addr, up);
        }
        tokio::time::sleep(interval).await;
    }
}

/// Starts the health checks of every pool that has one, on the current runtime.
pub fn spawn_health_checks(pools: &[Arc<Pool>]) {
    for pool in pools {
        if let Some(interval) = pool.config.health_interval {
            tokio::spawn(health_check(Arc::downgrade(pool), interval));
        }
    }
}

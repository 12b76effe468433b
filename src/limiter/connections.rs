//! Open connections per client address, for `[server] max_connections_per_ip` (DESIGN §10):
//! the proxy listener and the RLS listener (§17) each keep a table and admit by one rule.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use parking_lot::Mutex;
use pingora::protocols::l4::socket::SocketAddr;
use pingora::protocols::Stream;

use crate::config;
use crate::metrics::Metrics;

/// Open connections per client address, shared by a listener's threads.
#[derive(Default)]
pub struct PerIp(Mutex<HashMap<IpAddr, u32>>);

impl PerIp {
    /// A slot for one more connection from `ip`, or `None` when it already holds `cap`.
    pub fn acquire(self: &Arc<Self>, ip: IpAddr, cap: u32) -> Option<IpSlot> {
        let mut counts = self.0.lock();
        let n = counts.entry(ip).or_insert(0);
        if *n >= cap {
            return None;
        }
        *n += 1;
        Some(IpSlot {
            ip,
            table: self.clone(),
        })
    }

    pub fn open(&self, ip: IpAddr) -> u32 {
        self.0.lock().get(&ip).copied().unwrap_or(0)
    }

    /// Admits a connection accepted as `stream` under `server`'s `max_connections_per_ip`:
    /// `Ok(Some(slot))` holds its count until dropped; `Ok(None)`: not counted (no cap, no
    /// IP address, or a trusted proxy, which carries many clients on its connections);
    /// `Err(Refused)`: the address already holds its cap, so the connection is to be closed
    /// at once (counted in `sluice_connections_rejected_total{reason="per_ip"}`).
    pub fn admit(
        self: &Arc<Self>,
        stream: &Stream,
        server: &config::Server,
        metrics: &Metrics,
    ) -> Result<Option<IpSlot>, Refused> {
        let cap = server.max_connections_per_ip;
        let peer = stream
            .get_socket_digest()
            .and_then(|d| d.peer_addr().and_then(SocketAddr::as_inet).map(|a| a.ip()));
        let Some(ip) = peer.filter(|_| cap > 0) else {
            return Ok(None);
        };
        // An IPv4-mapped peer is its IPv4 address; an IPv6 one counts by its network
        // (`ipv6_prefix`, DESIGN §21).
        let ip = crate::key::client_network(ip, 128);
        if server.trusted_proxies.iter().any(|net| net.contains(&ip)) {
            return Ok(None);
        }
        match self.acquire(crate::key::client_network(ip, server.ipv6_prefix), cap) {
            Some(slot) => Ok(Some(slot)),
            None => {
                metrics
                    .connections_rejected
                    .with_label_values(&["per_ip"])
                    .inc();
                Err(Refused)
            }
        }
    }
}

/// A connection over its address's `max_connections_per_ip`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused;

/// One counted connection; released when the connection closes.
pub struct IpSlot {
    ip: IpAddr,
    table: Arc<PerIp>,
}

impl Drop for IpSlot {
    fn drop(&mut self) {
        let mut counts = self.table.0.lock();
        if let Some(n) = counts.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.ip);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_count_up_to_the_cap_and_free_on_drop() {
        let table = Arc::new(PerIp::default());
        let ip: IpAddr = [192, 0, 2, 1].into();
        let a = table.acquire(ip, 2);
        let b = table.acquire(ip, 2);
        assert!(a.is_some() && b.is_some());
        assert!(table.acquire(ip, 2).is_none());
        assert!(table.acquire([192, 0, 2, 2].into(), 2).is_some());
        drop(a);
        assert_eq!(table.open(ip), 1);
        assert!(table.acquire(ip, 2).is_some());
        drop(b);
        assert_eq!(table.open(ip), 0);
    }
}

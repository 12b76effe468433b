//! Each upstream's `ca_file` and client certificate as Pingora's TLS connector takes them
//! (DESIGN §20): built once per config load, shared by every request's peer.
//!
//! Pingora's connection pool keys a connection by its peer's hash, which holds the client
//! certificate (by serial) but not the trusted CAs: `group` (the peer's `group_key`, which the
//! hash does hold) is a digest of the CAs, so a reload to other CAs never reuses a connection
//! whose server was verified against the old ones.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use pingora::protocols::tls::CaType;
use pingora::upstreams::peer::HttpPeer;
use pingora::utils::tls::{parse_x509, CertKey, WrappedX509};

use crate::config::UpstreamTls;

/// One upstream's TLS material, ready for its peers.
#[derive(Clone, Default)]
pub struct PeerTls {
    ca: Option<Arc<CaType>>,
    client: Option<Arc<CertKey>>,
    group: u64,
}

impl PeerTls {
    /// The files were parsed and checked when the config was read (`config::upstream_tls`):
    /// what Pingora would panic on (an unparseable certificate) cannot reach it.
    pub fn new(files: &UpstreamTls) -> PeerTls {
        let ca: Option<Arc<CaType>> = files.ca.as_ref().map(|certs| {
            certs
                .iter()
                .map(|c| WrappedX509::new(c.as_ref().to_vec(), parse_x509))
                .collect::<Vec<_>>()
                .into()
        });
        let group = files.ca.as_ref().map_or(0, |certs| {
            let mut h = DefaultHasher::new();
            for c in certs {
                c.as_ref().hash(&mut h);
            }
            // 0 is every peer without `ca_file`.
            h.finish().max(1)
        });
        let client = files.client.as_ref().map(|c| {
            let chain = c.chain.iter().map(|d| d.as_ref().to_vec()).collect();
            Arc::new(CertKey::new(chain, c.key.clone()))
        });
        PeerTls { ca, client, group }
    }

    /// Sets this material on a TLS peer (two reference counts, no copy).
    pub fn apply(&self, peer: &mut HttpPeer) {
        if let Some(ca) = &self.ca {
            peer.options.ca = Some(ca.clone());
            peer.group_key = self.group;
        }
        if let Some(client) = &self.client {
            peer.client_cert_key = Some(client.clone());
        }
    }
}

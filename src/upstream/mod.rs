//! The upstream side (DESIGN §20): each configured upstream as one owner, `Upstream`, of
//! its server pool (`pool`: selection and passive health, with `pool::health`, the active
//! checks, and `pool::resolve`, names asked again on an interval), its TLS material for peers (`peer_tls`)
//! its retry budget (`retry`) and, with `adaptive`, its learnt concurrency limit (`adaptive`:
//! the gradient controller and the admission by plan share). The proxy asks it for one thing
//! per try: `peer()`.

mod adaptive;
mod peer_tls;
mod pool;
mod retry;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use pingora::protocols::ALPN;
use pingora::upstreams::peer::HttpPeer;

use crate::config::{self, Config, UpstreamProtocol};
use crate::metrics::Metrics;

use peer_tls::PeerTls;
use retry::Budget;

pub use adaptive::{Gate, Shed, Slot};
pub use pool::{outcome, pools, Pool};
pub use retry::Tries;

/// Concurrent requests multiplexed on one HTTP/2 connection to an upstream before another
/// is opened (Pingora's default is 1, which would make h2 upstreams one connection per stream).
const H2_STREAMS_PER_UPSTREAM_CONNECTION: usize = 100;

/// One upstream of the config and everything a request to it needs.
pub struct Upstream {
    pub pool: Arc<Pool>,
    /// `ca_file` and client certificate for its peers, built once per config load.
    tls: PeerTls,
    /// `retries`: its budget, `None` without.
    retries: Option<Arc<Budget>>,
    /// `adaptive` (DESIGN §22): its learnt concurrency limit and admission, `None` without.
    pub adaptive: Option<Arc<Gate>>,
}

impl Upstream {
    /// The upstreams of `config`, in `config.upstreams` order, over its `pools` (built
    /// first, since resolving can fail); primes the retry series of each. An adaptive
    /// upstream of `previous` (the config before a reload) with the same name and numbers
    /// keeps its gate: the learnt limit and the requests in flight carry over.
    pub fn all(
        config: &Config,
        pools: Vec<Arc<Pool>>,
        previous: &[Arc<Upstream>],
        metrics: &Metrics,
    ) -> Vec<Arc<Upstream>> {
        config
            .upstreams
            .iter()
            .zip(pools)
            .map(|(u, pool)| {
                let adaptive = u.adaptive.as_ref().map(|a| {
                    previous
                        .iter()
                        .filter(|p| p.config().name == u.name)
                        .find_map(|p| p.adaptive.clone().filter(|g| g.config() == a))
                        .unwrap_or_else(|| Gate::new(a))
                });
                Arc::new(Upstream {
                    pool,
                    tls: PeerTls::new(&u.tls_files),
                    retries: Budget::new(u, metrics).map(Arc::new),
                    adaptive,
                })
            })
            .collect()
    }

    pub fn config(&self) -> &config::Upstream {
        &self.pool.config
    }

    /// A request to this upstream starts its tries (`None` without `retries`): counted in
    /// flight in the budget until the `Tries` is dropped.
    pub fn tries(&self) -> Option<Tries> {
        self.retries.as_ref().map(Budget::enter)
    }

    /// The peer of one try: a server never in `tried` while another is left, with the
    /// upstream's TLS, protocol and timeouts (built once per server, then shared).
    pub fn peer(&self, client_ip: IpAddr, tried: &[SocketAddr]) -> (SocketAddr, Arc<HttpPeer>) {
        self.pool
            .pick_with(client_ip, tried, |server| match server {
                Some(s) => {
                    let peer = s.peer.get_or_init(|| Arc::new(self.new_peer(s.addr)));
                    (s.addr, peer.clone())
                }
                None => {
                    let addr = SocketAddr::from(([0, 0, 0, 0], 0));
                    (addr, Arc::new(self.new_peer(addr)))
                }
            })
    }

    fn new_peer(&self, addr: SocketAddr) -> HttpPeer {
        let cfg = &self.pool.config;
        let sni = match (cfg.tls, cfg.sni.is_empty()) {
            (false, _) => String::new(),
            (true, true) => addr.ip().to_string(),
            (true, false) => cfg.sni.clone(),
        };
        let mut peer = HttpPeer::new(addr, cfg.tls, sni);
        if cfg.tls {
            // `ca_file`, `client_cert` (DESIGN §20): shared, built at config load.
            self.tls.apply(&mut peer);
        }
        if cfg.protocol == UpstreamProtocol::H2 {
            // HTTP/2 only: ALPN h2 over TLS; without TLS, Pingora's connector speaks
            // prior-knowledge h2c to a peer whose lowest version is 2.
            peer.options.alpn = ALPN::H2;
            peer.options.max_h2_streams = H2_STREAMS_PER_UPSTREAM_CONNECTION;
        }
        peer.options.connection_timeout = Some(cfg.connect_timeout);
        peer.options.total_connection_timeout = Some(cfg.connect_timeout);
        peer.options.read_timeout = Some(cfg.read_timeout);
        peer.options.idle_timeout = Some(cfg.keepalive_timeout);
        peer
    }
}

fn pools_of(upstreams: &[Arc<Upstream>]) -> Vec<Arc<pool::Pool>> {
    upstreams.iter().map(|u| u.pool.clone()).collect()
}

/// Puts `new` (a config load) in service after `old`: the old pools stop checking and
/// writing gauges (the new ones start their health checks and re-resolving with `start`);
/// the adaptive series of upstreams no longer adaptive go, those of the new ones are primed.
pub fn hand_over(old: &[Arc<Upstream>], new: &[Arc<Upstream>], metrics: &Metrics) {
    pool::hand_over(&pools_of(old), &pools_of(new), metrics);
    for gone in old.iter().filter(|o| o.adaptive.is_some()) {
        let name = gone.config().name.as_str();
        if !new
            .iter()
            .any(|n| n.config().name == name && n.adaptive.is_some())
        {
            let _ = metrics
                .upstream_concurrency_limit
                .remove_label_values(&[name]);
            let _ = metrics.upstream_in_flight.remove_label_values(&[name]);
            let _ = metrics.upstream_latency_best.remove_label_values(&[name]);
        }
    }
    for u in new {
        if let Some(gate) = &u.adaptive {
            // Every plan the config names, and `anonymous`, from load (at 0).
            let name = u.config().name.as_str();
            let plans = gate.config().shares.iter().map(|(plan, _)| plan.as_str());
            for plan in plans.chain(["anonymous"]) {
                metrics.shed.with_label_values(&[name, plan]);
            }
        }
    }
    publish_adaptive(new, metrics);
}

/// Starts the health checks and re-resolving of `upstreams` (on the current runtime); those
/// of a config already replaced end at once.
pub fn start(upstreams: &[Arc<Upstream>]) {
    pool::start(&pools_of(upstreams));
}

/// The adaptive upstreams' limit, requests in flight and best latency, into their gauges
/// (at each scrape: nothing on the requests' path writes them).
pub fn publish_adaptive(upstreams: &[Arc<Upstream>], metrics: &Metrics) {
    for u in upstreams {
        let Some(gate) = &u.adaptive else { continue };
        let name = [u.config().name.as_str()];
        let gauge = |g: &prometheus::IntGaugeVec, v: u64| {
            g.with_label_values(&name).set(v as i64);
        };
        gauge(&metrics.upstream_concurrency_limit, gate.limit());
        gauge(&metrics.upstream_in_flight, gate.in_flight());
        let best = gate.best().map_or(0.0, |b| b.as_secs_f64());
        metrics
            .upstream_latency_best
            .with_label_values(&name)
            .set(best);
    }
}

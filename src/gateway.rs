//! The running state built from one config (routes, pools, limiter), swapped whole on reload.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::auth::Authenticator;
use crate::clock::Clock;
use crate::config::{self, Config};
use crate::limiter::Limiter;
use crate::metrics::Metrics;
use crate::routing::RouteIndex;
use crate::tls::Certificates;
use crate::upstream::{self, Upstream};

pub struct Gateway {
    pub config: Config,
    /// `config.routes`, indexed: which route a request belongs to.
    pub routes: RouteIndex,
    /// `config.upstreams`, in order: each its pool, peer TLS and retry budget.
    pub upstreams: Vec<Arc<Upstream>>,
    pub limiter: Limiter,
    /// Who is asking: API keys and JWT issuers of this config, runtime consumers.
    pub auth: Authenticator,
    /// The TLS listeners' certificates: one resolver for the process, handed on to each
    /// new gateway and updated with its certificates.
    pub tls: Arc<Certificates>,
}

impl Gateway {
    /// Builds the state for `config`, reusing what `previous` had for unchanged settings.
    /// Must run on the long-lived I/O runtime: health checks and backend connections live there.
    pub async fn build(
        config: Config,
        previous: Option<&Gateway>,
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
    ) -> Result<Gateway, String> {
        let pools = upstream::pools(&config, &metrics).await?;
        let previous_policies = previous.map_or(&[][..], |p| &p.config.policies[..]);
        let limiter = Limiter::new(
            &config,
            previous.map(|p| &p.limiter),
            previous_policies,
            clock,
            metrics.clone(),
        )
        .await
        .map_err(|e| format!("limiter backend: {e}"))?;
        let auth = Authenticator::new(
            &config,
            previous.map(|p| &p.auth),
            limiter.runtime_consumers(),
            &metrics,
        );
        // After everything that can fail: the old pools stop checking and writing gauges.
        let previous_upstreams = previous.map_or(&[][..], |p| &p.upstreams[..]);
        let upstreams = Upstream::all(&config, pools, previous_upstreams, &metrics);
        upstream::hand_over(previous_upstreams, &upstreams, &metrics);
        // On a reload the listeners are up; at start `server::run` starts them once they
        // are, since an upstream may be sluice itself (the quick start's is its admin listener).
        if previous.is_some() {
            upstream::start(&upstreams);
        }
        // Last, after everything that can fail: new handshakes get these certificates now.
        let tls = match previous {
            Some(p) => p.tls.clone(),
            None => Certificates::new(&config),
        };
        tls.update(&config, &metrics);
        let previous_config = previous.map(|p| &p.config);
        crate::limiter::series::prime_metrics(
            &metrics,
            &config,
            previous_config,
            limiter.backend_name(),
        );
        crate::auth::prime_metrics(&metrics, &config, previous_config);
        Ok(Gateway {
            routes: RouteIndex::new(config.proxy_routes(), config.server.case_insensitive_paths),
            config,
            upstreams,
            limiter,
            auth,
            tls,
        })
    }
}

/// What every request and the admin listener share: the current gateway and its counters.
pub struct App {
    pub current: ArcSwap<Gateway>,
    pub metrics: Arc<Metrics>,
    pub clock: Arc<dyn Clock>,
    pub config_path: PathBuf,
    /// Requests being handled now (for draining on SIGTERM).
    pub in_flight: AtomicUsize,
}

impl App {
    /// Re-reads the config file; a config that fails validation leaves the old one in force.
    pub async fn reload(&self) -> Result<(), String> {
        let result = self.try_reload().await;
        // Logged before it is counted: whoever sees the counter move finds the reason.
        match &result {
            Ok(()) => log::info!("config reloaded from {}", self.config_path.display()),
            Err(e) => log::error!("config reload rejected, keeping the old config:\n{e}"),
        }
        let label = if result.is_ok() { "success" } else { "failure" };
        self.metrics
            .config_reloads
            .with_label_values(&[label])
            .inc();
        self.metrics.config_loaded(result.is_ok());
        result
    }

    async fn try_reload(&self) -> Result<(), String> {
        let config = config::load(&self.config_path).map_err(|e| e.to_string())?;
        for warning in &config.warnings {
            log::warn!("{warning}");
        }
        let old = self.current.load_full();
        if config.server.listen != old.config.server.listen
            || config.server.tls_listen != old.config.server.tls_listen
            || config.admin.listen != old.config.admin.listen
            || config.rls.as_ref().map(|r| r.listen) != old.config.rls.as_ref().map(|r| r.listen)
        {
            log::warn!("listener addresses changed: they take effect on restart, not reload");
        }
        if config.keepalive_pool_size() != old.config.keepalive_pool_size() {
            log::warn!("[upstreams] keepalive changed: the pools are sized on restart, not reload (keepalive_timeout is reloaded)");
        }
        if config.server.h2c != old.config.server.h2c {
            log::warn!("[server] h2c changed: it takes effect on restart, not reload");
        }
        if config.tls.client_auth != old.config.tls.client_auth
            || config.tls.client_ca != old.config.tls.client_ca
        {
            log::warn!("[tls] client_auth or client_ca changed: they take effect on restart, not reload (certificates and min_version are reloaded)");
        }
        let gateway =
            Gateway::build(config, Some(&old), self.clock.clone(), self.metrics.clone()).await?;
        self.current.store(Arc::new(gateway));
        drop(old);
        return_freed_memory();
        Ok(())
    }

    pub fn request_started(&self) {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        self.metrics.requests_in_flight.inc();
    }

    pub fn request_ended(&self) {
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.metrics.requests_in_flight.dec();
    }
}

/// Hands memory freed by a config load (the parse tree of a large config is many times the
/// size of the config it yields) back to the OS now, rather than keeping it resident.
pub fn return_freed_memory() {
    // SAFETY: mi_collect only walks mimalloc's own heaps; it may be called at any time from
    // any thread (and does nothing for heaps that allocated nothing).
    unsafe { libmimalloc_sys::mi_collect(true) };
}

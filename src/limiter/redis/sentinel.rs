//! Sentinel: the current master, looked up again when it stops answering as a master, and
//! switched at once when a sentinel announces `+switch-master`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::io::tcp::TcpSettings;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{
    Client, ConnectionAddr, ConnectionInfo, ErrorKind, IntoConnectionInfo, RedisConnectionInfo,
    RedisError, ServerErrorKind, TlsMode,
};

use super::pubsub;
use super::scripts;
use super::{backend_error, config_error, no_delay};
use crate::limiter::backend::BackendError;
use crate::limiter::fleet::Listener;

/// A pause between two Sentinel look-ups of the master, so an outage does not flood them.
const RESOLVE_PAUSE: Duration = Duration::from_millis(200);

/// The channel on which every sentinel announces a completed failover:
/// `<master-name> <old-ip> <old-port> <new-ip> <new-port>`.
const SWITCH_CHANNEL: &str = "+switch-master";

/// The current master as told by Sentinel: looked up again in the background when it
/// stops answering as a master, and switched at once when a sentinel announces
/// `+switch-master`.
pub(super) struct SentinelStore {
    /// The master's name in Sentinel.
    name: String,
    sentinel: tokio::sync::Mutex<SentinelClient>,
    /// The sentinels (without credentials), followed for `+switch-master`.
    sentinels: Vec<ConnectionInfo>,
    /// How a master at an address Sentinel names is reached: user, password, db, TLS.
    pub(super) master_settings: RedisConnectionInfo,
    master_tls: bool,
    pub(super) master: ArcSwapOption<(ConnectionAddr, ConnectionManager)>,
    /// Serialises replacing `master`, and counts announced switches: a look-up that began
    /// before a switch must not undo it with the answer of a sentinel that lags behind.
    installing: parking_lot::Mutex<()>,
    switches: AtomicU64,
    resolving: AtomicBool,
    pub(super) manager_config: ConnectionManagerConfig,
    io_timeout: Duration,
    /// The tasks following the sentinels; they end with the store.
    followers: parking_lot::Mutex<Vec<tokio::task::AbortHandle>>,
}

impl SentinelStore {
    /// Sentinels are asked without credentials; the user, password, db and TLS of the
    /// first node's URL are those of the master (as go-redis and redis-py do).
    pub(super) fn new(
        master: &str,
        nodes: &[String],
        manager_config: ConnectionManagerConfig,
        io_timeout: Duration,
    ) -> Result<SentinelStore, BackendError> {
        let mut sentinels = Vec::with_capacity(nodes.len());
        for node in nodes {
            let info = node
                .as_str()
                .into_connection_info()
                .map_err(|e| config_error(node, &e))?;
            sentinels.push(info);
        }
        let first = sentinels
            .first()
            .ok_or_else(|| BackendError::Connection("sentinel: no nodes configured".into()))?;
        let master_settings = first.redis_settings().clone();
        let master_tls = matches!(first.addr(), ConnectionAddr::TcpTls { .. });
        let mut master_info = SentinelNodeConnectionInfo::default()
            .set_redis_connection_info(master_settings.clone())
            .set_tcp_settings(TcpSettings::default().set_nodelay(true));
        if master_tls {
            master_info = master_info.set_tls_mode(TlsMode::Secure);
        }
        let sentinels: Vec<_> = sentinels
            .into_iter()
            .map(|info| info.set_redis_settings(RedisConnectionInfo::default()))
            .collect();
        let client = SentinelClient::build(
            sentinels.clone(),
            master,
            Some(master_info),
            SentinelServerType::Master,
        )
        .map_err(|e| config_error(&nodes.join(", "), &e))?;
        Ok(SentinelStore {
            name: master.to_owned(),
            sentinel: tokio::sync::Mutex::new(client),
            sentinels,
            master_settings,
            master_tls,
            master: ArcSwapOption::empty(),
            installing: parking_lot::Mutex::new(()),
            switches: AtomicU64::new(0),
            resolving: AtomicBool::new(false),
            manager_config,
            io_timeout,
            followers: parking_lot::Mutex::new(Vec::new()),
        })
    }

    /// Starts following every configured sentinel's `+switch-master` channel, on the
    /// current runtime. The tasks hold the store weakly and are aborted when it is dropped.
    pub(super) fn follow_switches(self: &Arc<Self>) {
        let mut followers = self.followers.lock();
        for sentinel in &self.sentinels {
            let (sentinel, io_timeout) = (sentinel.clone(), self.io_timeout);
            let listener = Arc::new(SwitchListener(Arc::downgrade(self)));
            let task = tokio::spawn(async move {
                let targets = || vec![sentinel.clone()];
                pubsub::follow(
                    "redis limiter",
                    SWITCH_CHANNEL,
                    targets,
                    listener,
                    io_timeout,
                )
                .await
            });
            followers.push(task.abort_handle());
        }
    }

    /// The master's connection, or an error (and a look-up under way) when none is known.
    pub(super) fn current(self: &Arc<Self>) -> Result<ConnectionManager, BackendError> {
        match self.master.load_full() {
            Some(master) => Ok(master.1.clone()),
            None => {
                self.resolve_later();
                Err(BackendError::Connection(
                    "sentinel: master not known yet".into(),
                ))
            }
        }
    }

    /// How to reach the current master (for Pub/Sub); None, and a look-up under way, when
    /// none is known.
    pub(super) fn master_info(self: &Arc<Self>) -> Option<ConnectionInfo> {
        let Some(master) = self.master.load_full() else {
            self.resolve_later();
            return None;
        };
        let info = master.0.clone().into_connection_info().ok()?;
        Some(info.set_redis_settings(self.master_settings.clone()))
    }

    /// Looks the master up again after an error that says it moved or went away.
    pub(super) fn check<T>(self: &Arc<Self>, result: &Result<T, RedisError>) {
        if let Err(e) = result {
            let moved = matches!(
                e.kind(),
                ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
            );
            if moved || e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
                self.resolve_later();
            }
        }
    }

    fn resolve_later(self: &Arc<Self>) {
        if self.resolving.swap(true, Ordering::AcqRel) {
            return;
        }
        let this = self.clone();
        tokio::spawn(async move {
            if let Err(e) = this.resolve().await {
                log::warn!("redis limiter: sentinel could not name the master: {e}");
            }
            tokio::time::sleep(RESOLVE_PAUSE).await;
            this.resolving.store(false, Ordering::Release);
        });
    }

    /// Asks Sentinel for the master and switches to it if it changed.
    pub(super) async fn resolve(&self) -> Result<(), BackendError> {
        let switches = self.switches.load(Ordering::Acquire);
        let lookup = async { self.sentinel.lock().await.async_get_client().await };
        let client = tokio::time::timeout(self.io_timeout, lookup)
            .await
            .map_err(|_| BackendError::Timeout)?
            .map_err(|e| backend_error(&e))?;
        if let Some(addr) = self.install(client, Some(switches))? {
            log::info!("redis limiter: sentinel master is {addr}");
        }
        Ok(())
    }

    /// Makes `client`'s server the master, unless it is already, or (for a look-up begun
    /// when `seen` switches had been announced) a switch was announced since. Returns the
    /// new master's address when it changed.
    fn install(
        &self,
        client: Client,
        seen: Option<u64>,
    ) -> Result<Option<ConnectionAddr>, BackendError> {
        let _installing = self.installing.lock();
        if seen.is_some_and(|seen| seen != self.switches.load(Ordering::Acquire)) {
            return Ok(None);
        }
        let addr = client.get_connection_info().addr().clone();
        if self.master.load().as_ref().is_some_and(|m| m.0 == addr) {
            return Ok(None);
        }
        let client = Client::open(no_delay(client.get_connection_info().clone()))
            .map_err(|e| backend_error(&e))?;
        let manager = ConnectionManager::new_lazy_with_config(client, self.manager_config.clone())
            .map_err(|e| backend_error(&e))?;
        self.master.store(Some(Arc::new((addr.clone(), manager))));
        if seen.is_none() {
            self.switches.fetch_add(1, Ordering::AcqRel);
        }
        Ok(Some(addr))
    }

    /// Handles one `+switch-master` message: for our master, connects to the new address
    /// at once (calls from now on go there) and loads the script there in the background.
    fn switch(self: &Arc<Self>, announcement: &str) {
        let Some((name, host, port)) = parse_switch(announcement) else {
            log::warn!("redis limiter: unreadable {SWITCH_CHANNEL} message {announcement:?}");
            return;
        };
        if name != self.name {
            return;
        }
        let addr = if self.master_tls {
            ConnectionAddr::TcpTls {
                host: host.to_owned(),
                port,
                insecure: false,
                tls_params: None,
            }
        } else {
            ConnectionAddr::Tcp(host.to_owned(), port)
        };
        let installed = addr
            .into_connection_info()
            .map(|info| info.set_redis_settings(self.master_settings.clone()))
            .and_then(Client::open)
            .map_err(|e| backend_error(&e))
            .and_then(|client| self.install(client, None));
        match installed {
            Ok(Some(addr)) => {
                log::info!("redis limiter: sentinel announced a new master, {addr}");
                let this = self.clone();
                tokio::spawn(async move {
                    let Ok(mut m) = this.current() else { return };
                    let load = scripts::load(&mut m);
                    if let Ok(result) = tokio::time::timeout(this.io_timeout, load).await {
                        this.check(&result);
                    }
                });
            }
            Ok(None) => {}
            Err(e) => log::warn!("redis limiter: cannot switch to the announced master: {e}"),
        }
    }
}

impl Drop for SentinelStore {
    fn drop(&mut self) {
        for follower in self.followers.get_mut().drain(..) {
            follower.abort();
        }
    }
}

/// `<master-name> <old-ip> <old-port> <new-ip> <new-port>` as (name, new host, new port).
fn parse_switch(announcement: &str) -> Option<(&str, &str, u16)> {
    let mut fields = announcement.trim().rsplitn(5, ' ');
    let port = fields.next()?.parse().ok()?;
    let host = fields.next()?;
    let (_old_port, _old_host) = (fields.next()?, fields.next()?);
    let name = fields.next()?;
    Some((name, host, port))
}

/// Hands a sentinel's `+switch-master` announcements to the store while it lives.
struct SwitchListener(Weak<SentinelStore>);

#[async_trait]
impl Listener for SwitchListener {
    fn wanted(&self) -> bool {
        self.0.strong_count() > 0
    }

    /// A switch may have been announced while nobody listened: look the master up.
    async fn subscribed(&self) -> Result<(), String> {
        if let Some(store) = self.0.upgrade() {
            store.resolve_later();
        }
        Ok(())
    }

    async fn message(&self, text: &str) {
        if let Some(store) = self.0.upgrade() {
            store.switch(text);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_switch;

    #[test]
    fn a_switch_announcement_names_the_master_and_its_new_address() {
        assert_eq!(
            parse_switch("mymaster 10.0.0.1 6379 10.0.0.2 6380"),
            Some(("mymaster", "10.0.0.2", 6380))
        );
        assert_eq!(
            parse_switch("mymaster ::1 6379 fe80::2 6380\n"),
            Some(("mymaster", "fe80::2", 6380))
        );
        assert_eq!(parse_switch("mymaster 10.0.0.1 6379 10.0.0.2"), None);
        assert_eq!(parse_switch("mymaster 10.0.0.1 6379 10.0.0.2 port"), None);
        assert_eq!(parse_switch(""), None);
    }
}

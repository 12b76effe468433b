//! The Redis backend: state in one Redis, a Sentinel's master or a Cluster, decided in Lua.
//!
//! Decisions are calls of the script in `scripts` (EVALSHA; NOSCRIPT loads it and retries).
//! One multiplexed connection per backend (per node for Cluster), made lazily: a Redis that
//! is down when sluice starts makes calls fail fast, not sluice fail to start, and the
//! connection comes back by itself. The limiter layer bounds every call with its own
//! timeout and circuit breaker; the bounds here only keep a dead peer from holding
//! resources.
//!
//! Every call runs as a task on the runtime that called `connect` (sluice's long-lived I/O
//! runtime), whichever runtime asks: connections and their reconnections live there, and a
//! caller that gives up (its timeout) cannot stop a call halfway.
//!
//! Cluster: checks whose keys share a slot are decided in one atomic call. When a request
//! spans several slots, every group is first asked read-only ("peek"); only when all allow
//! are they charged, and if one then denies (another request got in between) the groups
//! already charged are refunded.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use async_trait::async_trait;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClientBuilder, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::Slot;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{
    Client, ConnectionAddr, ErrorKind, IntoConnectionInfo, RedisConnectionInfo, RedisError,
    ServerErrorKind, TlsMode,
};

use super::algorithm::Verdict;
use super::backend::{Backend, BackendError, Check};
use super::scripts::{self, Mode, Reply};
use crate::config::{self, ClockSource};

/// A pause between two Sentinel look-ups of the master, so an outage does not flood them.
const RESOLVE_PAUSE: Duration = Duration::from_millis(200);

pub struct RedisBackend {
    store: Store,
    clock: ClockSource,
    /// Bounds connecting, one reply, and `ping`.
    io_timeout: Duration,
    /// The runtime every call runs on.
    io: tokio::runtime::Handle,
}

#[derive(Clone)]
enum Store {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    Sentinel(Arc<SentinelStore>),
}

impl RedisBackend {
    /// Builds the backend for `cfg` and, within a second or `cfg.timeout` if longer, loads the
    /// script. Fails only on a configuration that cannot work (a bad URL); an unreachable
    /// Redis is logged, and calls fail until it answers. Call it on the runtime that should
    /// own the connections: every later call runs there.
    pub async fn connect(cfg: &config::Limiter) -> Result<RedisBackend, BackendError> {
        let io_timeout = cfg
            .timeout
            .clamp(Duration::from_secs(1), Duration::from_secs(5));
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(io_timeout))
            .set_response_timeout(Some(io_timeout))
            .set_number_of_retries(1)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_secs(1));
        let store = match &cfg.backend {
            config::Backend::Memory => {
                return Err(BackendError::Connection(
                    "the limiter backend is memory, not redis".into(),
                ));
            }
            config::Backend::Redis(url) => {
                let client = Client::open(url.as_str()).map_err(|e| config_error(url, &e))?;
                let manager = ConnectionManager::new_lazy_with_config(client, manager_config)
                    .map_err(|e| config_error(url, &e))?;
                Store::Single(manager)
            }
            config::Backend::Cluster(seeds) => {
                let client = ClusterClientBuilder::new(seeds.iter().map(String::as_str))
                    .retries(3)
                    .build()
                    .map_err(|e| config_error(&seeds.join(", "), &e))?;
                let cluster_config = ClusterConfig::new()
                    .set_connection_timeout(io_timeout)
                    .set_response_timeout(io_timeout);
                Store::Cluster(client.get_pending_async_connection_with_config(cluster_config))
            }
            config::Backend::Sentinel { master, nodes } => Store::Sentinel(Arc::new(
                SentinelStore::new(master, nodes, manager_config, io_timeout)?,
            )),
        };
        let backend = RedisBackend {
            store,
            clock: cfg.clock,
            io_timeout,
            io: tokio::runtime::Handle::current(),
        };
        match tokio::time::timeout(io_timeout, backend.store.load_script()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                log::warn!("redis limiter backend not reachable yet ({e}); will keep trying")
            }
            Err(_) => log::warn!(
                "redis limiter backend not answering within {io_timeout:?}; will keep trying"
            ),
        }
        Ok(backend)
    }

    /// The `now` a script is given: none when it reads Redis TIME itself.
    fn script_now(&self, now_ms: u64) -> Option<u64> {
        match self.clock {
            ClockSource::Local => Some(now_ms),
            ClockSource::Redis => None,
        }
    }

    /// Runs `work` as a task on the backend's runtime.
    async fn run<T: Send + 'static>(
        &self,
        work: impl Future<Output = Result<T, BackendError>> + Send + 'static,
    ) -> Result<T, BackendError> {
        self.io
            .spawn(work)
            .await
            .map_err(|e| BackendError::Connection(format!("redis call did not finish: {e}")))?
    }
}

impl Store {
    async fn load_script(&self) -> Result<(), BackendError> {
        let result = match self {
            Store::Single(m) => scripts::full_script().load_async(&mut m.clone()).await,
            Store::Cluster(c) => scripts::full_script().load_async(&mut c.clone()).await,
            Store::Sentinel(s) => {
                s.resolve().await?;
                let mut m = s.current()?;
                let result = scripts::full_script().load_async(&mut m).await;
                s.check(&result);
                result
            }
        };
        result.map(|_| ()).map_err(|e| backend_error(&e))
    }

    async fn decide(
        self,
        checks: Vec<Check>,
        now: Option<u64>,
    ) -> Result<Vec<Verdict>, BackendError> {
        match self {
            Store::Single(mut m) => decide_one(&mut m, &checks, now).await,
            Store::Sentinel(s) => {
                let mut m = s.current()?;
                let result = call(&mut m, Mode::Decide, &checks, now).await;
                s.check(&result);
                let values = result.map_err(|e| backend_error(&e))?;
                Ok(scripts::decode(&values, Mode::Decide, &enforce_flags(&checks))?.verdicts)
            }
            Store::Cluster(mut c) => {
                let groups = by_slot(&checks);
                if groups.len() == 1 {
                    return decide_one(&mut c, &checks, now).await;
                }
                decide_across_slots(c, checks, groups, now).await
            }
        }
    }

    async fn release(self, key: String, lease: u64) -> Result<(), BackendError> {
        let release = scripts::release_invocation(&key, lease);
        let result: Result<Vec<i64>, RedisError> = match self {
            Store::Single(mut m) => release.invoke_async(&mut m).await,
            Store::Cluster(mut c) => release.invoke_async(&mut c).await,
            Store::Sentinel(s) => {
                let result = release.invoke_async(&mut s.current()?).await;
                s.check(&result);
                result
            }
        };
        result.map(|_| ()).map_err(|e| backend_error(&e))
    }

    async fn ping(self) -> bool {
        let ping = redis::cmd("PING");
        match self {
            Store::Single(mut m) => ping.query_async::<String>(&mut m).await.is_ok(),
            Store::Cluster(mut c) => ping.query_async::<String>(&mut c).await.is_ok(),
            Store::Sentinel(s) => match s.current() {
                Ok(mut m) => {
                    let result = ping.query_async::<String>(&mut m).await;
                    s.check(&result);
                    result.is_ok()
                }
                Err(_) => false,
            },
        }
    }
}

#[async_trait]
impl Backend for RedisBackend {
    fn name(&self) -> &'static str {
        "redis"
    }

    async fn decide(&self, checks: &[Check], now_ms: u64) -> Result<Vec<Verdict>, BackendError> {
        if checks.is_empty() {
            return Ok(Vec::new());
        }
        let (store, checks, now) = (self.store.clone(), checks.to_vec(), self.script_now(now_ms));
        self.run(store.decide(checks, now)).await
    }

    async fn release(&self, key: &str, lease: u64) -> Result<(), BackendError> {
        let (store, key) = (self.store.clone(), key.to_owned());
        self.run(store.release(key, lease)).await
    }

    async fn ping(&self) -> bool {
        let store = self.store.clone();
        let answer = self.run(async move { Ok(store.ping().await) });
        matches!(
            tokio::time::timeout(self.io_timeout, answer).await,
            Ok(Ok(true))
        )
    }
}

/// One script call.
async fn call<'c>(
    conn: &mut impl ConnectionLike,
    mode: Mode,
    checks: impl IntoIterator<Item = &'c Check>,
    now: Option<u64>,
) -> Result<Vec<i64>, RedisError> {
    scripts::invocation(mode, checks, now)
        .invoke_async(conn)
        .await
}

/// Decides checks that may share one script call.
async fn decide_one(
    conn: &mut impl ConnectionLike,
    checks: &[Check],
    now: Option<u64>,
) -> Result<Vec<Verdict>, BackendError> {
    let values = call(conn, Mode::Decide, checks, now)
        .await
        .map_err(|e| backend_error(&e))?;
    Ok(scripts::decode(&values, Mode::Decide, &enforce_flags(checks))?.verdicts)
}

fn enforce_flags(checks: &[Check]) -> Vec<bool> {
    checks.iter().map(|c| c.enforce).collect()
}

/// Check indexes grouped by cluster slot, in the order the slots first appear.
fn by_slot(checks: &[Check]) -> Vec<Vec<usize>> {
    let mut groups: Vec<(Slot, Vec<usize>)> = Vec::new();
    for (i, check) in checks.iter().enumerate() {
        let slot = Slot::for_key(&check.key);
        match groups.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, members)) => members.push(i),
            None => groups.push((slot, vec![i])),
        }
    }
    groups.into_iter().map(|(_, members)| members).collect()
}

/// Peek every group; charge them all only if every enforce check allows; refund the groups
/// charged if one then denies or fails.
async fn decide_across_slots(
    conn: ClusterConnection,
    checks: Vec<Check>,
    groups: Vec<Vec<usize>>,
    now: Option<u64>,
) -> Result<Vec<Verdict>, BackendError> {
    let mut peeks = Vec::with_capacity(groups.len());
    for reply in call_groups(&conn, &checks, &groups, Mode::Peek, now).await {
        peeks.push(reply?);
    }
    let verdicts = in_check_order(&groups, &peeks, checks.len());
    let allowed = checks
        .iter()
        .zip(&verdicts)
        .all(|(c, v)| v.allowed || !c.enforce);
    if !allowed {
        return Ok(verdicts);
    }
    let charges = call_groups(&conn, &checks, &groups, Mode::Decide, now).await;
    if charges
        .iter()
        .all(|r| matches!(r, Ok(reply) if reply.charged))
    {
        let replies: Vec<Reply> = charges.into_iter().flatten().collect();
        return Ok(in_check_order(&groups, &replies, checks.len()));
    }
    // Another request got in between (or a node failed): undo the charges that were made.
    let mut refunds = Vec::new();
    for (group, result) in groups.iter().zip(&charges) {
        let Ok(reply) = result else { continue };
        if !reply.charged {
            continue;
        }
        let charged: Vec<Check> = group
            .iter()
            .zip(&reply.verdicts)
            .filter(|(_, v)| v.allowed)
            .map(|(&i, _)| checks[i].clone())
            .collect();
        let (mut conn, charged_at) = (conn.clone(), reply.now);
        refunds.push(tokio::spawn(async move {
            let result = call(&mut conn, Mode::Refund { charged_at }, &charged, now).await;
            if let Err(e) = result {
                log::warn!(
                    "redis limiter: refund of {} checks failed: {e}",
                    charged.len()
                );
            }
        }));
    }
    for refund in refunds {
        let _ = refund.await;
    }
    let mut replies = Vec::with_capacity(charges.len());
    for reply in charges {
        replies.push(reply?);
    }
    Ok(in_check_order(&groups, &replies, checks.len()))
}

/// One concurrent script call per group; results in group order.
async fn call_groups(
    conn: &ClusterConnection,
    checks: &[Check],
    groups: &[Vec<usize>],
    mode: Mode,
    now: Option<u64>,
) -> Vec<Result<Reply, BackendError>> {
    let calls: Vec<_> = groups
        .iter()
        .map(|group| {
            let mut conn = conn.clone();
            let invocation = scripts::invocation(mode, group.iter().map(|&i| &checks[i]), now);
            let enforce: Vec<bool> = group.iter().map(|&i| checks[i].enforce).collect();
            tokio::spawn(async move {
                let values: Vec<i64> = invocation
                    .invoke_async(&mut conn)
                    .await
                    .map_err(|e| backend_error(&e))?;
                scripts::decode(&values, mode, &enforce)
            })
        })
        .collect();
    let mut replies = Vec::with_capacity(calls.len());
    for handle in calls {
        replies.push(
            handle
                .await
                .unwrap_or_else(|e| Err(BackendError::Script(format!("script call failed: {e}")))),
        );
    }
    replies
}

/// Puts the verdicts of per-group replies back in the order of the checks.
fn in_check_order(groups: &[Vec<usize>], replies: &[Reply], count: usize) -> Vec<Verdict> {
    let mut verdicts = vec![Verdict::default(); count];
    for (group, reply) in groups.iter().zip(replies) {
        for (&i, verdict) in group.iter().zip(&reply.verdicts) {
            verdicts[i] = *verdict;
        }
    }
    verdicts
}

/// The current master as told by Sentinel, looked up again in the background when it
/// stops answering as a master.
struct SentinelStore {
    sentinel: tokio::sync::Mutex<SentinelClient>,
    master: ArcSwapOption<(ConnectionAddr, ConnectionManager)>,
    resolving: AtomicBool,
    manager_config: ConnectionManagerConfig,
    io_timeout: Duration,
}

impl SentinelStore {
    /// Sentinels are asked without credentials; the user, password, db and TLS of the
    /// first node's URL are those of the master (as go-redis and redis-py do).
    fn new(
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
        let mut master_info = SentinelNodeConnectionInfo::default()
            .set_redis_connection_info(first.redis_settings().clone());
        if matches!(first.addr(), ConnectionAddr::TcpTls { .. }) {
            master_info = master_info.set_tls_mode(TlsMode::Secure);
        }
        let sentinels: Vec<_> = sentinels
            .into_iter()
            .map(|info| info.set_redis_settings(RedisConnectionInfo::default()))
            .collect();
        let client = SentinelClient::build(
            sentinels,
            master,
            Some(master_info),
            SentinelServerType::Master,
        )
        .map_err(|e| config_error(&nodes.join(", "), &e))?;
        Ok(SentinelStore {
            sentinel: tokio::sync::Mutex::new(client),
            master: ArcSwapOption::empty(),
            resolving: AtomicBool::new(false),
            manager_config,
            io_timeout,
        })
    }

    /// The master's connection, or an error (and a look-up under way) when none is known.
    fn current(self: &Arc<Self>) -> Result<ConnectionManager, BackendError> {
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

    /// Looks the master up again after an error that says it moved or went away.
    fn check<T>(self: &Arc<Self>, result: &Result<T, RedisError>) {
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
    async fn resolve(&self) -> Result<(), BackendError> {
        let lookup = async { self.sentinel.lock().await.async_get_client().await };
        let client = tokio::time::timeout(self.io_timeout, lookup)
            .await
            .map_err(|_| BackendError::Timeout)?
            .map_err(|e| backend_error(&e))?;
        let addr = client.get_connection_info().addr().clone();
        if self.master.load().as_ref().is_some_and(|m| m.0 == addr) {
            return Ok(());
        }
        log::info!("redis limiter: sentinel master is {addr}");
        let manager = ConnectionManager::new_lazy_with_config(client, self.manager_config.clone())
            .map_err(|e| backend_error(&e))?;
        self.master.store(Some(Arc::new((addr, manager))));
        Ok(())
    }
}

fn config_error(what: &str, e: &RedisError) -> BackendError {
    BackendError::Connection(format!("invalid redis address {what:?}: {e}"))
}

fn backend_error(e: &RedisError) -> BackendError {
    let unreachable = e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_cluster_error()
        || matches!(
            e.kind(),
            ErrorKind::AuthenticationFailed
                | ErrorKind::ClusterConnectionNotFound
                | ErrorKind::Server(
                    ServerErrorKind::ReadOnly
                        | ServerErrorKind::MasterDown
                        | ServerErrorKind::BusyLoading
                        | ServerErrorKind::TryAgain
                        | ServerErrorKind::ClusterDown
                )
        );
    if e.is_timeout() {
        BackendError::Timeout
    } else if unreachable {
        BackendError::Connection(e.to_string())
    } else {
        BackendError::Script(e.to_string())
    }
}

//! The Redis backend: state in one Redis, a Sentinel's master or a Cluster, decided in Lua.
//!
//! Decisions are calls of the script in `scripts` (EVALSHA; NOSCRIPT loads it and retries),
//! on multiplexed connections (per node for Cluster) made lazily: a Redis that is down when
//! sluice starts makes calls fail fast, not sluice fail to start, and a connection comes
//! back by itself. The limiter layer bounds every call with its own timeout and circuit
//! breaker; the bounds here only keep a dead peer from holding resources.
//!
//! Decisions run on the runtime that asks, each runtime with its own connection (a
//! "lane", made on its first decision): Pingora gives each worker thread its own
//! single-threaded runtime, so a decision never leaves its worker's event loop. Calls
//! through the I/O runtime's thread cost two cross-thread wake-ups per request, which
//! measured as most of the proxy's CPU for a Redis decision. Every other call (peek,
//! release, renew, reset, the overrides' hash, PING) runs as a task on the runtime that
//! called `connect` (sluice's long-lived I/O runtime), on a connection of its own.
//!
//! Decisions are batched per lane (per slot for Cluster): while one decide call is in
//! flight, the requests that arrive wait, and when it returns they all go as one call of
//! the script's "batch" form, which decides each request in turn, all or nothing as alone.
//! A request with nothing ahead of it is sent at once: batching adds no wait, it only
//! shares the calls that concurrency makes anyway, and with them Redis' per-call cost
//! (the call, TIME, ARGV). Every call runs as a task of its own, so a caller that gives up
//! (its timeout) cannot stop a call halfway that other requests ride on.
//!
//! Sentinel: the master is looked up when none is known and again after an error that says
//! it moved. A planned failover gives no such error (the old master keeps accepting writes
//! until Sentinel demotes it, seconds later), so the backend also follows every sentinel's
//! `+switch-master` announcement and moves to the new master as soon as one arrives.
//!
//! Cluster: checks whose keys share a slot are decided in one atomic call. When a request
//! spans several slots, every group is first asked read-only ("peek"); only when all allow
//! are they charged, and if one then denies (another request got in between) the groups
//! already charged are refunded.

use std::collections::hash_map::{Entry, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use arc_swap::{ArcSwap, ArcSwapOption};
use async_trait::async_trait;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterClientBuilder, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::Slot;
use redis::io::tcp::TcpSettings;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{
    Client, ConnectionAddr, ConnectionInfo, ErrorKind, IntoConnectionInfo, RedisConnectionInfo,
    RedisError, RedisFuture, ScriptInvocation, ServerErrorKind, TlsMode, Value,
};
use tokio::sync::oneshot;

use super::algorithm::Verdict;
use super::backend::{Adjustment, Backend, BackendError, Check, Listener};
use super::pubsub;
use super::scripts::{self, Mode, Reply, Request};
use crate::auth::consumers::{Changed, ConsumerChange};
use crate::config::{self, ClockSource};

/// A pause between two Sentinel look-ups of the master, so an outage does not flood them.
const RESOLVE_PAUSE: Duration = Duration::from_millis(200);

/// The channel on which every sentinel announces a completed failover:
/// `<master-name> <old-ip> <old-port> <new-ip> <new-port>`.
const SWITCH_CHANNEL: &str = "+switch-master";

pub struct RedisBackend {
    store: Store,
    /// Where the fleet's announcements are heard (besides a Sentinel's current master):
    /// the one server, or the seeds of a cluster, whose every node relays every PUBLISH.
    relays: Vec<ConnectionInfo>,
    clock: ClockSource,
    /// Bounds connecting, one reply, and `ping`.
    io_timeout: Duration,
    /// The runtime every call but decisions runs on.
    io: tokio::runtime::Handle,
    /// What the connections for decisions are made from.
    source: Source,
    /// One lane per runtime that asked for a decision; they end with the backend.
    lanes: ArcSwap<Vec<(tokio::runtime::Id, Arc<Lane>)>>,
    adding_lane: parking_lot::Mutex<()>,
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
    /// own the connections: every later call but decisions runs there.
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
        let mut relays = Vec::new();
        let (store, source) = match &cfg.backend {
            config::Backend::Memory => {
                return Err(BackendError::Connection(
                    "the limiter backend is memory, not redis".into(),
                ));
            }
            config::Backend::Redis(url) => {
                let info = url
                    .as_str()
                    .into_connection_info()
                    .map_err(|e| config_error(url, &e))?;
                let client = Client::open(no_delay(info)).map_err(|e| config_error(url, &e))?;
                relays.push(client.get_connection_info().clone());
                let manager =
                    ConnectionManager::new_lazy_with_config(client.clone(), manager_config.clone())
                        .map_err(|e| config_error(url, &e))?;
                (
                    Store::Single(manager),
                    Source::Single(client, manager_config),
                )
            }
            config::Backend::Cluster(seeds) => {
                let client = ClusterClientBuilder::new(seeds.iter().map(String::as_str))
                    .tcp_settings(TcpSettings::default().set_nodelay(true))
                    .retries(3)
                    .build()
                    .map_err(|e| config_error(&seeds.join(", "), &e))?;
                relays = seeds
                    .iter()
                    .filter_map(|seed| seed.as_str().into_connection_info().ok())
                    .collect();
                let cluster_config = ClusterConfig::new()
                    .set_connection_timeout(io_timeout)
                    .set_response_timeout(io_timeout);
                (
                    Store::Cluster(
                        client.get_pending_async_connection_with_config(cluster_config.clone()),
                    ),
                    Source::Cluster(client, cluster_config),
                )
            }
            config::Backend::Sentinel { master, nodes } => {
                let store = Arc::new(SentinelStore::new(
                    master,
                    nodes,
                    manager_config,
                    io_timeout,
                )?);
                store.follow_switches();
                (Store::Sentinel(store.clone()), Source::Sentinel(store))
            }
        };
        let backend = RedisBackend {
            store,
            relays,
            clock: cfg.clock,
            io_timeout,
            io: tokio::runtime::Handle::current(),
            source,
            lanes: ArcSwap::default(),
            adding_lane: parking_lot::Mutex::new(()),
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

    /// The current runtime's lane, made on its first decision: its connection, and so its
    /// calls, stay on the runtime (the worker thread) that asks.
    fn lane(&self) -> Result<Arc<Lane>, BackendError> {
        let runtime = tokio::runtime::Handle::current().id();
        let mine = |lanes: &[(tokio::runtime::Id, Arc<Lane>)]| {
            lanes
                .iter()
                .find(|(r, _)| *r == runtime)
                .map(|(_, lane)| lane.clone())
        };
        if let Some(lane) = mine(&self.lanes.load()) {
            return Ok(lane);
        }
        let _adding = self.adding_lane.lock();
        let lanes = self.lanes.load_full();
        if let Some(lane) = mine(&lanes) {
            return Ok(lane);
        }
        let lane = Arc::new(Lane::new(self.source.connect_here()?));
        let mut more = Vec::with_capacity(lanes.len() + 1);
        more.extend(lanes.iter().cloned());
        more.push((runtime, lane.clone()));
        self.lanes.store(Arc::new(more));
        Ok(lane)
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

impl RedisBackend {
    /// Prefetch (DESIGN §19): takes up to `want` units of `check`'s key ahead and gives back
    /// `back` units of the take made at `back_at` (the script's clock), in one call of
    /// `lua/prefetch.lua`, on the I/O runtime (a refill is rare next to the requests it
    /// serves).
    pub(crate) async fn take(
        &self,
        check: &Check,
        want: u64,
        back: u64,
        back_at: u64,
        now_ms: u64,
    ) -> Result<super::held::Taken, BackendError> {
        let call =
            scripts::prefetch_invocation(check, want, back, back_at, self.script_now(now_ms));
        let store = self.store.clone();
        let values = self
            .run(async move {
                let result = call.invoke_async::<Vec<i64>>(&mut store.conn()?).await;
                store.checked(result)
            })
            .await?;
        super::held::Taken::from_reply(&values)
    }
}

/// The connection a store's calls go on: the one server's or the Sentinel master's
/// (managed, reconnecting), or the cluster's.
enum Conn {
    Managed(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Managed(m) => m.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Managed(m) => m.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Managed(m) => m.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

impl Store {
    /// The connection to call on now (Sentinel: the current master's).
    fn conn(&self) -> Result<Conn, BackendError> {
        match self {
            Store::Single(m) => Ok(Conn::Managed(m.clone())),
            Store::Cluster(c) => Ok(Conn::Cluster(c.clone())),
            Store::Sentinel(s) => s.current().map(Conn::Managed),
        }
    }

    /// A call's result as the backend reports it; with Sentinel, an error that says the
    /// master moved or went away also starts a new look-up.
    fn checked<T>(&self, result: Result<T, RedisError>) -> Result<T, BackendError> {
        if let Store::Sentinel(s) = self {
            s.check(&result);
        }
        result.map_err(|e| backend_error(&e))
    }

    async fn load_script(&self) -> Result<(), BackendError> {
        if let Store::Sentinel(s) = self {
            s.resolve().await?;
        }
        let result = scripts::full_script().load_async(&mut self.conn()?).await;
        self.checked(result).map(|_| ())
    }

    /// Settles adjustments: one call per cluster slot (each key's adjustment is atomic on
    /// its own; a response's adjustments need not land together).
    async fn adjust(
        self,
        adjustments: Vec<Adjustment>,
        now: Option<u64>,
    ) -> Result<(), BackendError> {
        let groups: Vec<Vec<usize>> = match self {
            Store::Cluster(_) => by_slot(adjustments.iter().map(|a| a.check.key.as_str())),
            _ => vec![(0..adjustments.len()).collect()],
        };
        for group in groups {
            let call = scripts::adjust_invocation(group.iter().map(|&i| &adjustments[i]), now);
            let result = call.invoke_async::<Vec<i64>>(&mut self.conn()?).await;
            self.checked(result)?;
        }
        Ok(())
    }

    async fn release(self, key: String, lease: u64) -> Result<(), BackendError> {
        let release = scripts::release_invocation(&key, lease);
        let result = release.invoke_async::<Vec<i64>>(&mut self.conn()?).await;
        self.checked(result).map(|_| ())
    }

    async fn renew(
        self,
        key: String,
        lease: u64,
        lease_ms: u64,
        now: Option<u64>,
    ) -> Result<bool, BackendError> {
        let renew = scripts::renew_invocation(&key, lease, lease_ms, now);
        let result = renew.invoke_async::<Vec<i64>>(&mut self.conn()?).await;
        match self.checked(result)?[..] {
            [_, held] => Ok(held == 1),
            ref other => Err(BackendError::Script(format!(
                "renew: expected 2 integers, got {}",
                other.len()
            ))),
        }
    }

    /// Evaluates checks without charging: every slot's group on its own (a peek sets nothing,
    /// so there is nothing to make atomic across slots).
    async fn peek(
        self,
        checks: Vec<Check>,
        now: Option<u64>,
    ) -> Result<Vec<Verdict>, BackendError> {
        let mut verdicts = Vec::with_capacity(checks.len());
        for check in &checks {
            let one = std::slice::from_ref(check);
            let result = call(&mut self.conn()?, Mode::Peek, one, now).await;
            let values = self.checked(result)?;
            verdicts.extend(scripts::decode(&values, Mode::Peek, &enforce_flags(one))?.verdicts);
        }
        Ok(verdicts)
    }

    /// One change to the runtime consumers: `lua/consumer.lua`, run whole by Redis.
    async fn change_consumer(
        self,
        hash: String,
        change: ConsumerChange,
    ) -> Result<Changed, BackendError> {
        let call = scripts::consumer_invocation(&hash, &change);
        let result = call.invoke_async::<(i64, String)>(&mut self.conn()?).await;
        let (status, consumer) = self.checked(result)?;
        scripts::decode_consumer(status, &consumer)
    }

    /// Runs one command on the store (the master for Sentinel).
    async fn query<T: redis::FromRedisValue + Send>(
        self,
        cmd: redis::Cmd,
    ) -> Result<T, BackendError> {
        let result = cmd.query_async(&mut self.conn()?).await;
        self.checked(result)
    }

    async fn ping(self) -> bool {
        self.query::<String>(redis::cmd("PING")).await.is_ok()
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
        let now = self.script_now(now_ms);
        let queue = match &self.store {
            Store::Cluster(c) => {
                let groups = by_slot(checks.iter().map(|c| c.key.as_str()));
                if groups.len() > 1 {
                    // Not batched: every slot's group is peeked, then charged or refunded.
                    let (c, checks) = (c.clone(), checks.to_vec());
                    return self.run(decide_across_slots(c, checks, groups, now)).await;
                }
                Some(Slot::for_key(&checks[0].key))
            }
            _ => None,
        };
        let (answer, verdicts) = oneshot::channel();
        let waiting = Waiting {
            checks: checks.to_vec(),
            now,
            answer,
        };
        let lane = self.lane()?;
        if lane.batches.push(queue, waiting) {
            tokio::spawn(flush(lane, queue));
        }
        verdicts
            .await
            .unwrap_or_else(|_| Err(BackendError::Connection("redis call did not finish".into())))
    }

    async fn adjust(&self, adjustments: &[Adjustment], now_ms: u64) -> Result<(), BackendError> {
        if adjustments.is_empty() {
            return Ok(());
        }
        let (store, now) = (self.store.clone(), self.script_now(now_ms));
        self.run(store.adjust(adjustments.to_vec(), now)).await
    }

    async fn release(&self, key: &str, lease: u64) -> Result<(), BackendError> {
        let (store, key) = (self.store.clone(), key.to_owned());
        self.run(store.release(key, lease)).await
    }

    async fn renew(
        &self,
        key: &str,
        lease: u64,
        lease_ms: u64,
        now_ms: u64,
    ) -> Result<bool, BackendError> {
        let (store, key, now) = (self.store.clone(), key.to_owned(), self.script_now(now_ms));
        self.run(store.renew(key, lease, lease_ms, now)).await
    }

    async fn ping(&self) -> bool {
        let store = self.store.clone();
        let answer = self.run(async move { Ok(store.ping().await) });
        matches!(
            tokio::time::timeout(self.io_timeout, answer).await,
            Ok(Ok(true))
        )
    }

    async fn peek(&self, checks: &[Check], now_ms: u64) -> Result<Vec<Verdict>, BackendError> {
        let (store, checks, now) = (self.store.clone(), checks.to_vec(), self.script_now(now_ms));
        self.run(store.peek(checks, now)).await
    }

    async fn reset(&self, key: &str) -> Result<(), BackendError> {
        // The state and its ban share a hash tag, so one DEL serves Cluster too.
        let mut del = redis::cmd("DEL");
        del.arg(key).arg(scripts::ban_key(key));
        let store = self.store.clone();
        self.run(async move { store.query::<i64>(del).await.map(|_| ()) })
            .await
    }

    fn shared(&self) -> bool {
        true
    }

    async fn hash_read(&self, hash: &str) -> Result<Vec<(String, String)>, BackendError> {
        let mut cmd = redis::cmd("HGETALL");
        cmd.arg(hash);
        let store = self.store.clone();
        self.run(async move { store.query::<Vec<(String, String)>>(cmd).await })
            .await
    }

    async fn hash_write(
        &self,
        hash: &str,
        field: &str,
        value: Option<&str>,
    ) -> Result<(), BackendError> {
        let cmd = match value {
            Some(value) => {
                let mut c = redis::cmd("HSET");
                c.arg(hash).arg(field).arg(value);
                c
            }
            None => {
                let mut c = redis::cmd("HDEL");
                c.arg(hash).arg(field);
                c
            }
        };
        let store = self.store.clone();
        self.run(async move { store.query::<i64>(cmd).await.map(|_| ()) })
            .await
    }

    /// A Lua script rather than WATCH/MULTI: WATCH holds per connection, and every call here
    /// shares one multiplexed connection; a script needs no connection of its own, no
    /// retries when another instance got in between, one round trip, and on a Cluster it
    /// runs where its one key lives.
    async fn change_consumer(
        &self,
        hash: &str,
        change: &ConsumerChange,
    ) -> Result<Changed, BackendError> {
        let (store, hash, change) = (self.store.clone(), hash.to_owned(), change.clone());
        self.run(store.change_consumer(hash, change)).await
    }

    async fn announce(&self, channel: &str, message: &str) -> Result<(), BackendError> {
        let mut cmd = redis::cmd("PUBLISH");
        cmd.arg(channel).arg(message);
        let store = self.store.clone();
        self.run(async move { store.query::<i64>(cmd).await.map(|_| ()) })
            .await
    }

    fn follow(
        &self,
        channel: &str,
        listener: Arc<dyn Listener>,
    ) -> Option<tokio::task::AbortHandle> {
        let (relays, channel, io_timeout) =
            (self.relays.clone(), channel.to_owned(), self.io_timeout);
        let sentinel = match &self.store {
            Store::Sentinel(s) => Some(s.clone()),
            _ => None,
        };
        let targets = move || match &sentinel {
            Some(s) => s.master_info().into_iter().collect(),
            None => relays.clone(),
        };
        let task = self.io.spawn(async move {
            pubsub::follow("runtime overrides", &channel, targets, listener, io_timeout).await
        });
        Some(task.abort_handle())
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

fn enforce_flags(checks: &[Check]) -> Vec<bool> {
    checks.iter().map(|c| c.enforce).collect()
}

/// Key indexes grouped by cluster slot, in the order the slots first appear.
fn by_slot<'k>(keys: impl IntoIterator<Item = &'k str>) -> Vec<Vec<usize>> {
    let mut groups: Vec<(Slot, Vec<usize>)> = Vec::new();
    for (i, key) in keys.into_iter().enumerate() {
        let slot = Slot::for_key(key);
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
    let mut verdicts = in_check_order(&groups, &peeks, checks.len());
    let allowed = checks
        .iter()
        .zip(&verdicts)
        .all(|(c, v)| v.allowed || !c.enforce);
    if !allowed {
        ban_denied(&conn, &checks, &groups, &peeks, &mut verdicts).await;
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
        let charged: Vec<Adjustment> = group
            .iter()
            .zip(&reply.verdicts)
            .filter(|(&i, v)| v.allowed && checks[i].cost > 0)
            .map(|(&i, _)| Adjustment {
                check: checks[i].clone(),
                charged_at: reply.now,
                amount: -(checks[i].cost as i64),
            })
            .collect();
        let mut conn = conn.clone();
        refunds.push(tokio::spawn(async move {
            let result = scripts::adjust_invocation(&charged, now)
                .invoke_async::<Vec<i64>>(&mut conn)
                .await;
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

/// Across slots a denial is found by a peek, which sets no ban: bans the keys of the
/// banning checks their algorithm denied, as a decide's script does (ban key = end time,
/// TTL = ban), at the time the group's peek ran.
async fn ban_denied(
    conn: &ClusterConnection,
    checks: &[Check],
    groups: &[Vec<usize>],
    peeks: &[Reply],
    verdicts: &mut [Verdict],
) {
    for (group, peek) in groups.iter().zip(peeks) {
        for &i in group {
            let (check, verdict) = (&checks[i], &mut verdicts[i]);
            let newly_denied = check.enforce && !verdict.allowed && !verdict.banned;
            if !newly_denied || check.ban_ms == 0 {
                continue;
            }
            let set = redis::cmd("SET")
                .arg(scripts::ban_key(&check.key))
                .arg(peek.now + check.ban_ms)
                .arg("PX")
                .arg(check.ban_ms)
                .query_async::<()>(&mut conn.clone())
                .await;
            if let Err(e) = set {
                log::warn!("redis limiter: could not set a ban: {e}");
            }
            // Answered as a ban is (DESIGN §17): the ban's wait, never the window's.
            verdict.retry_after_ms = check.ban_ms;
            verdict.reset_ms = check.ban_ms;
        }
    }
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

/// One runtime's connection for decisions, and its queues.
struct Lane {
    conn: LaneConn,
    batches: Batches,
    /// When the lane was made, and how long after that its last call ended (ms).
    made: Instant,
    last_call: AtomicU64,
}

enum LaneConn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    /// The store that names the master, and this lane's connection to the master it named
    /// last: made again when the master changes.
    Sentinel(Arc<SentinelStore>, parking_lot::Mutex<Option<LaneMaster>>),
}

/// The master as `SentinelStore` holds it, and a lane's own connection to it.
type LaneMaster = (Arc<(ConnectionAddr, ConnectionManager)>, ConnectionManager);

impl Lane {
    /// Decides a batch of requests in one script call (the plain form when it holds one),
    /// each request all or nothing on its own; its checks share one slot.
    async fn decide_batch(
        &self,
        requests: &[Request<'_>],
    ) -> Result<Vec<Vec<Verdict>>, BackendError> {
        if let [(checks, now)] = requests {
            let values = self
                .invoke(scripts::invocation(Mode::Decide, *checks, *now))
                .await?;
            let enforce = enforce_flags(checks);
            return Ok(vec![
                scripts::decode(&values, Mode::Decide, &enforce)?.verdicts,
            ]);
        }
        let values = self.invoke(scripts::batch_invocation(requests)).await?;
        scripts::decode_batch(&values, requests.iter().map(|(checks, _)| checks.len()))
    }

    fn new(conn: LaneConn) -> Lane {
        Lane {
            conn,
            batches: Batches::default(),
            made: Instant::now(),
            last_call: AtomicU64::new(0),
        }
    }

    /// Runs one script call; after `IDLE_CHECK` without one, a PING first.
    async fn invoke(&self, call: ScriptInvocation<'static>) -> Result<Vec<i64>, BackendError> {
        let since = |made: Instant| made.elapsed().as_millis() as u64;
        // Cluster lanes may have calls for several slots in flight: the last may end first.
        let idle = since(self.made).saturating_sub(self.last_call.load(Ordering::Relaxed));
        let check = idle >= IDLE_CHECK.as_millis() as u64;
        let mut conn = match &self.conn {
            LaneConn::Single(m) => Conn::Managed(m.clone()),
            LaneConn::Cluster(c) => Conn::Cluster(c.clone()),
            LaneConn::Sentinel(s, mine) => Conn::Managed(master(s, mine)?),
        };
        // A cluster connection retries a call that finds a dead connection (`retries(3)`).
        if check && matches!(conn, Conn::Managed(_)) {
            let _ = redis::cmd("PING").query_async::<Value>(&mut conn).await;
        }
        let result = call
            .invoke_async::<scripts::Integers>(&mut conn)
            .await
            .map(|integers| integers.0);
        if let LaneConn::Sentinel(s, _) = &self.conn {
            s.check(&result);
        }
        self.last_call.store(since(self.made), Ordering::Relaxed);
        result.map_err(|e| backend_error(&e))
    }
}

/// A lane's connection to the master `s` names now: the one it made before, if the master
/// is the same, else a new one (to the address of `s`'s connection, with its settings).
fn master(
    s: &Arc<SentinelStore>,
    mine: &parking_lot::Mutex<Option<LaneMaster>>,
) -> Result<ConnectionManager, BackendError> {
    let Some(master) = s.master.load_full() else {
        return s.current();
    };
    let mut mine = mine.lock();
    if let Some((named, conn)) = &*mine {
        if Arc::ptr_eq(named, &master) {
            return Ok(conn.clone());
        }
    }
    let info = master
        .0
        .clone()
        .into_connection_info()
        .map_err(|e| backend_error(&e))?
        .set_redis_settings(s.master_settings.clone());
    let conn = Client::open(no_delay(info))
        .and_then(|client| {
            ConnectionManager::new_lazy_with_config(client, s.manager_config.clone())
        })
        .map_err(|e| backend_error(&e))?;
    *mine = Some((master, conn.clone()));
    Ok(conn)
}

/// What the connections for decisions are made from: one per runtime that asks, so that
/// a decision stays on the event loop of the worker thread that asks for it (Pingora runs
/// one single-threaded runtime per worker thread), instead of waking the I/O runtime's
/// thread and being woken by it.
enum Source {
    Single(Client, ConnectionManagerConfig),
    Cluster(ClusterClient, ClusterConfig),
    Sentinel(Arc<SentinelStore>),
}

impl Source {
    /// A connection that the current runtime drives (made lazily, on first use).
    fn connect_here(&self) -> Result<LaneConn, BackendError> {
        match self {
            Source::Single(client, config) => {
                ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
                    .map(LaneConn::Single)
                    .map_err(|e| backend_error(&e))
            }
            Source::Cluster(client, config) => Ok(LaneConn::Cluster(
                client.get_pending_async_connection_with_config(config.clone()),
            )),
            Source::Sentinel(s) => Ok(LaneConn::Sentinel(s.clone(), Default::default())),
        }
    }
}

/// A lane that made no call for this long checks its connection with a PING before the
/// next: a connection that died while idle (Redis restarted, a peer cut it) is noticed by
/// redis-rs only when a call fails on it, and that decision would then follow `on_error`
/// (with "allow", pass uncharged). The PING fails instead, and the call that follows goes
/// on a new connection. Busy lanes never pay for it.
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// The most requests one batch call decides. A script blocks Redis for every other client
/// while it runs, so this bounds that pause (about 64 × 2 µs for a one-check request) and
/// the size of one call (64 × 8 arguments for one check each); past a few dozen requests a
/// bigger batch saves little more per request. Those beyond it go in the next call.
const BATCH_MAX: usize = 64;

/// A request waiting for its batch call.
struct Waiting {
    checks: Vec<Check>,
    now: Option<u64>,
    answer: oneshot::Sender<Result<Vec<Verdict>, BackendError>>,
}

/// The decide calls of one connection: at most one in flight per queue (one per cluster
/// slot; one in all, `None`, outside a Cluster). A request that finds its queue idle is sent
/// at once, alone; requests that arrive while a call is in flight wait, and when it
/// returns all that wait go as one batch call.
#[derive(Default)]
struct Batches {
    /// A queue exists exactly while a call for it is in flight (or about to be sent).
    queues: parking_lot::Mutex<HashMap<Option<Slot>, Vec<Waiting>>>,
}

impl Batches {
    /// Queues `waiting`; true when the queue was idle, so a `flush` must start.
    fn push(&self, queue: Option<Slot>, waiting: Waiting) -> bool {
        match self.queues.lock().entry(queue) {
            Entry::Occupied(mut e) => {
                e.get_mut().push(waiting);
                false
            }
            Entry::Vacant(e) => {
                e.insert(vec![waiting]);
                true
            }
        }
    }

    /// The next batch of `queue`, skipping requests whose caller gave up (timed out: it
    /// followed `on_error`, so it must not be charged now); None, and the queue idle, when
    /// none waits.
    fn next(&self, queue: Option<Slot>) -> Option<Vec<Waiting>> {
        let mut queues = self.queues.lock();
        let waiting = queues.get_mut(&queue)?;
        waiting.retain(|w| !w.answer.is_closed());
        if waiting.is_empty() {
            queues.remove(&queue);
            None
        } else if waiting.len() <= BATCH_MAX {
            Some(std::mem::take(waiting))
        } else {
            Some(waiting.drain(..BATCH_MAX).collect())
        }
    }
}

/// Sends `queue`'s batches on `lane`, one call at a time, until none waits. It runs as a
/// task of its own, so a call completes even when the request that started it gives up:
/// others ride on it.
async fn flush(lane: Arc<Lane>, queue: Option<Slot>) {
    let mut flushing = Flushing {
        batches: &lane.batches,
        queue,
        done: false,
    };
    while let Some(batch) = lane.batches.next(queue) {
        let result = {
            let requests: Vec<Request<'_>> = batch.iter().map(|w| (&w.checks[..], w.now)).collect();
            lane.decide_batch(&requests).await
        };
        match result {
            Ok(verdicts) => {
                for (waiting, verdicts) in batch.into_iter().zip(verdicts) {
                    let _ = waiting.answer.send(Ok(verdicts));
                }
            }
            Err(e) => {
                for waiting in batch {
                    let _ = waiting.answer.send(Err(e.clone()));
                }
            }
        }
    }
    flushing.done = true;
}

/// Makes a queue idle again if its `flush` stops short (its runtime shut down): the requests
/// still waiting then fail at once instead of waiting for a call that never comes.
struct Flushing<'b> {
    batches: &'b Batches,
    queue: Option<Slot>,
    done: bool,
}

impl Drop for Flushing<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.batches.queues.lock().remove(&self.queue);
        }
    }
}

/// The current master as told by Sentinel: looked up again in the background when it
/// stops answering as a master, and switched at once when a sentinel announces
/// `+switch-master`.
struct SentinelStore {
    /// The master's name in Sentinel.
    name: String,
    sentinel: tokio::sync::Mutex<SentinelClient>,
    /// The sentinels (without credentials), followed for `+switch-master`.
    sentinels: Vec<ConnectionInfo>,
    /// How a master at an address Sentinel names is reached: user, password, db, TLS.
    master_settings: RedisConnectionInfo,
    master_tls: bool,
    master: ArcSwapOption<(ConnectionAddr, ConnectionManager)>,
    /// Serialises replacing `master`, and counts announced switches: a look-up that began
    /// before a switch must not undo it with the answer of a sentinel that lags behind.
    installing: parking_lot::Mutex<()>,
    switches: AtomicU64,
    resolving: AtomicBool,
    manager_config: ConnectionManagerConfig,
    io_timeout: Duration,
    /// The tasks following the sentinels; they end with the store.
    followers: parking_lot::Mutex<Vec<tokio::task::AbortHandle>>,
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
    fn follow_switches(self: &Arc<Self>) {
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

    /// How to reach the current master (for Pub/Sub); None, and a look-up under way, when
    /// none is known.
    fn master_info(self: &Arc<Self>) -> Option<ConnectionInfo> {
        let Some(master) = self.master.load_full() else {
            self.resolve_later();
            return None;
        };
        let info = master.0.clone().into_connection_info().ok()?;
        Some(info.set_redis_settings(self.master_settings.clone()))
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
                    let load = scripts::full_script().load_async(&mut m);
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

/// `info` with TCP_NODELAY, which redis-rs leaves off: a call is one small write, which
/// Nagle's algorithm would hold back while data sent before it is not yet acknowledged.
fn no_delay(info: ConnectionInfo) -> ConnectionInfo {
    info.set_tcp_settings(TcpSettings::default().set_nodelay(true))
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

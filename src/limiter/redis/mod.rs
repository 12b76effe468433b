//! The Redis backend: state in one Redis, a Sentinel's master or a Cluster, decided in Lua.
//! This file holds `RedisBackend`, its `Backend` and `Fleet` methods and how redis-rs'
//! errors read;
//! `store` the connections every call but decisions goes on, `lanes` the per-runtime
//! decision connections and their batches, `cluster` the requests that span slots,
//! `sentinel` the master's look-up, `scripts` the Lua calls, `pubsub` the channels followed.
//!
//! Decisions are calls of the Lua code in `scripts` (FCALL of a function library, loaded
//! again on "Function not found"; EVALSHA where the server has no functions),
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

mod cluster;
mod lanes;
mod pubsub;
mod scripts;
mod sentinel;
mod store;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClientBuilder, ClusterConfig};
use redis::cluster_routing::Slot;
use redis::io::tcp::TcpSettings;
use redis::{Client, ConnectionInfo, ErrorKind, IntoConnectionInfo, RedisError, ServerErrorKind};
use tokio::sync::oneshot;

use super::algorithm::Verdict;
use super::backend::{Adjustment, Backend, BackendError, Check};
use super::fleet::{Fleet, Listener};
use super::prefetch::held::Taken;
use crate::auth::consumers::{Changed, ConsumerChange};
use crate::config::{self, ClockSource};
use cluster::{by_slot, decide_across_slots};
use lanes::{flush, Lane, Source, Waiting};
use sentinel::SentinelStore;
use store::Store;

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
}

#[async_trait]
impl Fleet for RedisBackend {
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

    fn follow(&self, channel: &str, listener: Arc<dyn Listener>) -> tokio::task::AbortHandle {
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
        task.abort_handle()
    }

    /// Prefetch (DESIGN §19): takes up to `want` units of `check`'s key ahead and gives back
    /// `back` units of the take made at `back_at` (the script's clock), in one call of
    /// `lua/prefetch.lua`, on the I/O runtime (a refill is rare next to the requests it
    /// serves).
    async fn take(
        &self,
        check: &Check,
        want: u64,
        back: u64,
        back_at: u64,
        now_ms: u64,
    ) -> Result<Taken, BackendError> {
        let call =
            scripts::prefetch_invocation(check, want, back, back_at, self.script_now(now_ms));
        let store = self.store.clone();
        let values = self
            .run(async move {
                let result = call.invoke_async::<Vec<i64>>(&mut store.conn()?).await;
                store.checked(result)
            })
            .await?;
        Taken::from_reply(&values)
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

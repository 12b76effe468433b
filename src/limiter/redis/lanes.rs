//! Lanes: one connection for decisions per runtime that asks (so a decision stays on its
//! worker's event loop), and the batches of decide calls queued on each.

use std::collections::hash_map::{Entry, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::Slot;
use redis::{Client, ConnectionAddr, IntoConnectionInfo, Value};
use tokio::sync::oneshot;

use super::scripts::{self, Call, Mode, Request};
use super::sentinel::SentinelStore;
use super::store::{enforce_flags, Conn};
use super::RedisBackend;
use super::{backend_error, no_delay};
use crate::limiter::algorithm::Verdict;
use crate::limiter::backend::{BackendError, Check};

impl RedisBackend {
    /// The current runtime's lane, made on its first decision: its connection, and so its
    /// calls, stay on the runtime (the worker thread) that asks.
    pub(super) fn lane(&self) -> Result<Arc<Lane>, BackendError> {
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
}

/// One runtime's connection for decisions, and its queues.
pub(super) struct Lane {
    conn: LaneConn,
    pub(super) batches: Batches,
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
    async fn invoke(&self, call: Call) -> Result<Vec<i64>, BackendError> {
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
            .invoke::<scripts::Integers>(&mut conn)
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
pub(super) enum Source {
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
pub(super) struct Waiting {
    pub(super) checks: Vec<Check>,
    pub(super) now: Option<u64>,
    pub(super) answer: oneshot::Sender<Result<Vec<Verdict>, BackendError>>,
}

/// The decide calls of one connection: at most one in flight per queue (one per cluster
/// slot; one in all, `None`, outside a Cluster). A request that finds its queue idle is sent
/// at once, alone; requests that arrive while a call is in flight wait, and when it
/// returns all that wait go as one batch call.
#[derive(Default)]
pub(super) struct Batches {
    /// A queue exists exactly while a call for it is in flight (or about to be sent).
    queues: parking_lot::Mutex<HashMap<Option<Slot>, Vec<Waiting>>>,
}

impl Batches {
    /// Queues `waiting`; true when the queue was idle, so a `flush` must start.
    pub(super) fn push(&self, queue: Option<Slot>, waiting: Waiting) -> bool {
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
pub(super) async fn flush(lane: Arc<Lane>, queue: Option<Slot>) {
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

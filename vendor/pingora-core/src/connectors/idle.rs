// sluice: the keep-alive pool of idle upstream connections, without a task per connection.
//
// Pingora's pool spawned a task for each released connection, which waited on the socket, a
// timer and two channels; the next request on that upstream woke it, waited for its lock and
// unwrapped an `Arc`. At many connections that was the largest part of a proxied request's
// cache misses (issue #42). Here a released connection is only put in a list:
// - `take` gives back the one released last (its memory is the warmest) that is still within
//   its idle timeout; the caller checks its socket before use, as Pingora's caller did;
// - when the pool is full, the connection released first anywhere in it is closed;
// - one sweep per pool, every `SWEEP_EVERY`, closes the connections past their idle timeout
//   and those the upstream closed or wrote to while idle. So an idle connection is closed
//   within `SWEEP_EVERY` of its timeout, or of the upstream closing it, instead of at once.
// Each worker thread keeps its own list (a shard of the pool, of the pool's whole size), as
// nginx's workers each keep their own: no lock is contended across threads, and a connection
// is reused by the thread whose reactor it is registered with.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{test_reusable_stream, PoolCallback};
use crate::protocols::Stream;

/// How often the idle connections are checked.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// Shards of a pool: more than the worker threads of any machine sluice runs on; a thread
/// beyond that shares a shard with another.
const SHARDS: usize = 256;

/// The shard of the current thread, assigned in turn on its first use.
fn shard_of_this_thread() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SHARD: usize = NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS;
    }
    SHARD.with(|s| *s)
}

pub(crate) struct IdlePool {
    /// The most idle connections each shard keeps.
    size: usize,
    shards: Box<[Shard]>,
    sweeping: AtomicBool,
}

/// A cache line of its own, so that threads do not share one.
#[repr(align(128))]
struct Shard(Mutex<State>);

#[derive(Default)]
struct State {
    /// The idle connections of each group key (`Peer::reuse_hash`), released last at the back.
    by_key: HashMap<u64, VecDeque<Idle>>,
    count: usize,
    /// Release order across keys, for closing the oldest when the pool is full.
    next_seq: u64,
}

struct Idle {
    stream: Stream,
    seq: u64,
    released: Instant,
    deadline: Option<Instant>,
}

impl Idle {
    fn expired(&self, now: Instant) -> bool {
        self.deadline.is_some_and(|d| d <= now)
    }
}

impl State {
    fn push(&mut self, key: u64, stream: Stream, released: Instant, timeout: Option<Duration>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let deadline = timeout.map(|t| released + t);
        self.by_key.entry(key).or_default().push_back(Idle {
            stream,
            seq,
            released,
            deadline,
        });
        self.count += 1;
    }

    /// Removes the connection released first, whatever its key.
    fn pop_oldest(&mut self) -> Option<Idle> {
        let queue = self
            .by_key
            .values_mut()
            .filter(|q| !q.is_empty())
            .min_by_key(|q| q.front().map_or(u64::MAX, |i| i.seq))?;
        let oldest = queue.pop_front();
        self.count -= oldest.is_some() as usize;
        oldest
    }
}

impl IdlePool {
    pub(crate) fn new(size: usize) -> Self {
        IdlePool {
            size,
            shards: (0..SHARDS)
                .map(|_| Shard(Mutex::new(State::default())))
                .collect(),
            sweeping: AtomicBool::new(false),
        }
    }

    fn shard(&self) -> &Mutex<State> {
        &self.shards[shard_of_this_thread()].0
    }

    /// Keeps `stream` for the next request to `key` on this thread, for at most `timeout`.
    pub(crate) fn put(
        self: &Arc<Self>,
        key: u64,
        stream: Stream,
        timeout: Option<Duration>,
        evicted: Option<&PoolCallback>,
        unexpected_data: &Arc<AtomicU64>,
    ) {
        if self.size == 0 {
            return;
        }
        let now = Instant::now();
        let oldest = {
            let mut state = self.shard().lock();
            let oldest = if state.count >= self.size {
                state.pop_oldest()
            } else {
                None
            };
            state.push(key, stream, now, timeout);
            oldest
        };
        if let (Some(oldest), Some(callback)) = (oldest, evicted) {
            callback(oldest.released.elapsed());
        }
        if !self.sweeping.load(Ordering::Relaxed) {
            self.start_sweeping(unexpected_data.clone());
        }
    }

    /// The connection to `key` released last on this thread that is still within its idle
    /// timeout.
    pub(crate) fn take(&self, key: u64) -> Option<Stream> {
        let now = Instant::now();
        let mut expired = Vec::new();
        let found = {
            let mut state = self.shard().lock();
            let State { by_key, count, .. } = &mut *state;
            let queue = by_key.get_mut(&key)?;
            let mut found = None;
            while let Some(idle) = queue.pop_back() {
                *count -= 1;
                if idle.expired(now) {
                    expired.push(idle);
                } else {
                    found = Some(idle.stream);
                    break;
                }
            }
            found
        };
        // Closed outside the lock.
        drop(expired);
        found
    }

    fn start_sweeping(self: &Arc<Self>, unexpected_data: Arc<AtomicU64>) {
        if self.sweeping.swap(true, Ordering::Relaxed) {
            return;
        }
        let pool: Weak<Self> = Arc::downgrade(self);
        pingora_runtime::current_handle().spawn(async move {
            loop {
                tokio::time::sleep(SWEEP_EVERY).await;
                let Some(pool) = pool.upgrade() else {
                    return;
                };
                pool.sweep(&unexpected_data);
            }
        });
    }

    /// Closes the connections past their idle timeout and those that are no longer
    /// reusable; each key's list is checked outside its shard's lock.
    fn sweep(&self, unexpected_data: &AtomicU64) {
        let now = Instant::now();
        for Shard(shard) in self.shards.iter() {
            let keys: Vec<u64> = {
                let mut state = shard.lock();
                state.by_key.retain(|_, q| !q.is_empty());
                state.by_key.keys().copied().collect()
            };
            for key in keys {
                self.sweep_key(shard, key, now, unexpected_data);
            }
        }
    }

    fn sweep_key(&self, shard: &Mutex<State>, key: u64, now: Instant, unexpected_data: &AtomicU64) {
        let checked = {
            let mut state = shard.lock();
            let Some(queue) = state.by_key.get_mut(&key) else {
                return;
            };
            let checked = std::mem::take(queue);
            state.count -= checked.len();
            checked
        };
        let kept: Vec<Idle> = checked
            .into_iter()
            .filter_map(|mut idle| {
                let reusable =
                    !idle.expired(now) && test_reusable_stream(&mut idle.stream, unexpected_data);
                reusable.then_some(idle)
            })
            .collect();
        let mut state = shard.lock();
        // Released before anything put back meanwhile: in front, in their order.
        let queue = state.by_key.entry(key).or_default();
        let kept_count = kept.len();
        for idle in kept.into_iter().rev() {
            queue.push_front(idle);
        }
        state.count += kept_count;
        while state.count > self.size {
            state.pop_oldest();
        }
    }
}

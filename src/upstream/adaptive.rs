//! Adaptive concurrency of one upstream on this instance (DESIGN §22): a limit learnt from
//! the upstream's latency by a gradient controller (`Controller`, pure arithmetic over the
//! times it is given), and admission by plan share against it (`Gate`, `Slot`) with a
//! bounded wait, highest share first.
//!
//! A request's cost on the hot path: one compare-and-swap to take a slot, one subtraction
//! to give it back, and per response header a timestamp and two increments of the latency
//! histogram. Once per `window` one request (whoever crosses the window's end first) runs
//! the update under a lock the others never wait for.
//!
//! Time is microseconds since the gate was made, passed in by the caller (`Gate::now_us`
//! in service; a simulated clock in the tests), so the algorithm is exact under test.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::config::Adaptive;

/// A window with fewer samples keeps the limit (its samples count in the next one).
pub const MIN_SAMPLES: u32 = 10;
/// The gradient's bounds: a window at most halves or doubles the limit (before headroom).
const GRADIENT_MIN: f64 = 0.5;
const GRADIENT_MAX: f64 = 2.0;
/// `probe_every` is stretched by up to this share, so a fleet's instances do not probe
/// in step.
const PROBE_JITTER: f64 = 0.1;

/// The controller: the limit, the best latency and when to measure it again. Pure: every
/// input (time, the window's p90, the jitter's seed) comes from the caller.
#[derive(Debug, Clone)]
pub struct Controller {
    min: f64,
    max: f64,
    tolerance: f64,
    probe_every_us: u64,
    /// The learnt limit (fractional: small steps add up).
    limit: f64,
    /// The p90 of the last probe window, microseconds; `None` before the first.
    best_us: Option<u64>,
    /// Probing: the limit is `min` for this window, and returns to this after it.
    probing: Option<f64>,
    next_probe_us: u64,
    rng: u64,
}

impl Controller {
    /// A controller that starts by probing: its first window runs at `min_limit` to learn
    /// the best latency, then the limit is `initial_limit`.
    pub fn new(config: &Adaptive, seed: u64) -> Controller {
        let (min, max) = (config.min_limit, config.max_limit.max(config.min_limit));
        let initial = f64::from(config.initial_limit.clamp(min, max));
        Controller {
            min: f64::from(min),
            max: f64::from(max),
            tolerance: config.tolerance,
            probe_every_us: config.probe_every.as_micros() as u64,
            limit: initial,
            best_us: None,
            probing: Some(initial),
            next_probe_us: 0,
            rng: seed | 1,
        }
    }

    /// The limit in force: `min_limit` while probing.
    pub fn limit(&self) -> u64 {
        match self.probing {
            Some(_) => self.min as u64,
            None => self.limit.round() as u64,
        }
    }

    pub fn best_us(&self) -> Option<u64> {
        self.best_us
    }

    #[cfg(test)]
    pub fn probing(&self) -> bool {
        self.probing.is_some()
    }

    /// A window ended at `now_us` with this p90 latency (`None`: under `MIN_SAMPLES`
    /// samples, the limit is kept). Returns true when a probe starts with the next window.
    pub fn window_ended(&mut self, now_us: u64, p90_us: Option<u64>) -> bool {
        let Some(p90) = p90_us.map(|p| p.max(1)) else {
            return false;
        };
        if let Some(back_to) = self.probing.take() {
            self.best_us = Some(p90);
            self.limit = back_to;
            self.next_probe_us = now_us + self.jittered(self.probe_every_us);
            return false;
        }
        if let Some(best) = self.best_us {
            let gradient =
                (self.tolerance * best as f64 / p90 as f64).clamp(GRADIENT_MIN, GRADIENT_MAX);
            let limit = self.limit * gradient + self.limit.sqrt();
            self.limit = limit.clamp(self.min, self.max);
        }
        if now_us >= self.next_probe_us {
            self.probing = Some(self.limit);
            return true;
        }
        false
    }

    /// `every` stretched by up to `PROBE_JITTER` (xorshift64: no need for better).
    fn jittered(&mut self, every: u64) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let unit = (self.rng >> 11) as f64 / (1u64 << 53) as f64;
        every + (every as f64 * PROBE_JITTER * unit) as u64
    }
}

/// Latencies of one window, in log-linear buckets of microseconds (16 per power of two: a
/// quantile within about 3% of the truth), each a counter any thread may bump.
struct Samples {
    buckets: Box<[AtomicU32]>,
    count: AtomicU32,
}

/// Values at or above 2^32 µs (71 minutes) share the last bucket.
const SAMPLE_BITS: u32 = 32;
const SUB_BITS: u32 = 4;
const BUCKETS: usize = ((SAMPLE_BITS - SUB_BITS + 1) << SUB_BITS) as usize;

impl Samples {
    fn new() -> Samples {
        Samples {
            buckets: (0..BUCKETS).map(|_| AtomicU32::new(0)).collect(),
            count: AtomicU32::new(0),
        }
    }

    fn bucket(us: u64) -> usize {
        let v = us.min((1 << SAMPLE_BITS) - 1);
        if v < 1 << SUB_BITS {
            return v as usize;
        }
        let octave = 63 - v.leading_zeros(); // >= SUB_BITS
        let sub = (v >> (octave - SUB_BITS)) & ((1 << SUB_BITS) - 1);
        (((octave - SUB_BITS + 1) << SUB_BITS) as u64 + sub) as usize
    }

    /// The middle of bucket `i`'s range.
    fn value(i: usize) -> u64 {
        let i = i as u64;
        if i < 1 << SUB_BITS {
            return i;
        }
        let octave = (i >> SUB_BITS) + u64::from(SUB_BITS) - 1;
        let sub = i & ((1 << SUB_BITS) - 1);
        let width = 1u64 << (octave - u64::from(SUB_BITS));
        ((1 << SUB_BITS) + sub) * width + width / 2
    }

    fn record(&self, us: u64) {
        self.buckets[Samples::bucket(us)].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn clear(&self) {
        self.count.store(0, Ordering::Relaxed);
        for b in self.buckets.iter() {
            b.store(0, Ordering::Relaxed);
        }
    }

    /// The window's p90 and a fresh window; `None` (the samples kept) under `MIN_SAMPLES`.
    fn take_p90(&self) -> Option<u64> {
        if self.count.load(Ordering::Relaxed) < MIN_SAMPLES {
            return None;
        }
        self.count.store(0, Ordering::Relaxed);
        let counts: Vec<u32> = self
            .buckets
            .iter()
            .map(|b| b.swap(0, Ordering::Relaxed))
            .collect();
        let total: u64 = counts.iter().map(|&c| u64::from(c)).sum();
        let rank = (total * 9).div_ceil(10).max(1);
        let mut seen = 0;
        for (i, &c) in counts.iter().enumerate() {
            seen += u64::from(c);
            if seen >= rank {
                return Some(Samples::value(i));
            }
        }
        None
    }
}

/// One upstream's admission: requests in flight against the learnt limit, and those
/// waiting for a slot.
pub struct Gate {
    config: Adaptive,
    started: Instant,
    in_flight: AtomicU64,
    /// `Controller::limit()`, for the hot path.
    limit: AtomicU64,
    samples: Samples,
    window_us: u64,
    window_end_us: AtomicU64,
    /// Samples of requests that began before this are not counted: set when a probe
    /// starts, so the probe window measures requests admitted at `min_limit` only.
    counted_from_us: AtomicU64,
    control: Mutex<Controller>,
    /// Waiting requests by (highest share first, then arrival); `waiting` is its length.
    queue: Mutex<BTreeMap<(u32, u64), oneshot::Sender<Slot>>>,
    waiting: AtomicUsize,
    arrivals: AtomicU64,
}

/// Why a request was not admitted.
#[derive(Debug, PartialEq, Eq)]
pub struct Shed;

impl Gate {
    pub fn new(config: &Adaptive) -> Arc<Gate> {
        Arc::new(Gate::with_seed(config, rand::random()))
    }

    /// A gate whose probes are jittered from `seed` (the tests' way to be repeatable).
    pub fn with_seed(config: &Adaptive, seed: u64) -> Gate {
        let control = Controller::new(config, seed);
        let window_us = config.window.as_micros() as u64;
        Gate {
            config: config.clone(),
            started: Instant::now(),
            in_flight: AtomicU64::new(0),
            limit: AtomicU64::new(control.limit()),
            samples: Samples::new(),
            window_us,
            window_end_us: AtomicU64::new(window_us),
            counted_from_us: AtomicU64::new(0),
            control: Mutex::new(control),
            queue: Mutex::new(BTreeMap::new()),
            waiting: AtomicUsize::new(0),
            arrivals: AtomicU64::new(0),
        }
    }

    pub fn config(&self) -> &Adaptive {
        &self.config
    }

    /// Microseconds since the gate was made: the time `record` takes.
    pub fn now_us(&self) -> u64 {
        self.started.elapsed().as_micros() as u64
    }

    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// The best latency measured, `None` before the first probe ended.
    pub fn best(&self) -> Option<Duration> {
        let c = self.control.lock().unwrap_or_else(|e| e.into_inner());
        c.best_us().map(Duration::from_micros)
    }

    /// The slots a plan of `share` may hold: its share of the limit, at least one.
    fn allowed(&self, share: f64) -> u64 {
        ((share * self.limit() as f64) as u64).max(1)
    }

    /// A slot now if one is free to a plan of `share` and nobody waits for one.
    pub fn try_admit(self: &Arc<Self>, share: f64) -> Option<Slot> {
        if self.waiting.load(Ordering::Acquire) > 0 {
            return None;
        }
        self.take(share)
    }

    fn take(self: &Arc<Self>, share: f64) -> Option<Slot> {
        let allowed = self.allowed(share);
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n < allowed).then_some(n + 1)
            })
            .ok()?;
        Some(Slot { gate: self.clone() })
    }

    /// A slot for a plan of `share`: now, or within `queue` (FIFO within a share, higher
    /// shares first; at most `max_limit` waiting), or `Shed`.
    pub async fn admit(self: &Arc<Self>, share: f64) -> Result<Slot, Shed> {
        if let Some(slot) = self.try_admit(share) {
            return Ok(slot);
        }
        if self.config.queue.is_zero() {
            return Err(Shed);
        }
        let (tx, mut rx) = oneshot::channel();
        let key = (
            1_000_000 - (share * 1_000_000.0) as u32,
            self.arrivals.fetch_add(1, Ordering::Relaxed),
        );
        {
            let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            if queue.len() >= self.config.max_limit as usize {
                return Err(Shed);
            }
            queue.insert(key, tx);
            self.waiting.store(queue.len(), Ordering::Release);
        }
        // A slot freed between the first try and joining the queue is not missed.
        self.hand_out();
        match tokio::time::timeout(self.config.queue, &mut rx).await {
            Ok(Ok(slot)) => Ok(slot),
            _ => {
                let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
                queue.remove(&key);
                self.waiting.store(queue.len(), Ordering::Release);
                drop(queue);
                // Handed a slot as the wait ran out: taken rather than wasted.
                rx.try_recv().map_err(|_| Shed)
            }
        }
    }

    /// Gives free slots to the waiting requests, first in the queue's order, while the
    /// first one's share allows (every later one's share is no higher).
    fn hand_out(self: &Arc<Self>) {
        loop {
            let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            let Some(first) = queue.first_entry() else {
                return;
            };
            let share = f64::from(1_000_000 - first.key().0) / 1_000_000.0;
            let Some(slot) = self.take(share) else {
                return;
            };
            let tx = first.remove();
            self.waiting.store(queue.len(), Ordering::Release);
            drop(queue);
            // A waiter gone already: the slot is dropped, released, and handed on.
            let _ = tx.send(slot);
        }
    }

    /// A response header came for a try that began at `started_us` (both from `now_us`).
    pub fn record(self: &Arc<Self>, started_us: u64, now_us: u64) {
        if started_us >= self.counted_from_us.load(Ordering::Relaxed) {
            self.samples.record(now_us.saturating_sub(started_us));
        }
        if now_us >= self.window_end_us.load(Ordering::Relaxed) {
            self.window_ended(now_us);
        }
    }

    /// The update of a window: one caller runs it, the others go on.
    fn window_ended(self: &Arc<Self>, now_us: u64) {
        let Ok(mut control) = self.control.try_lock() else {
            return;
        };
        if now_us < self.window_end_us.load(Ordering::Relaxed) {
            return; // another caller just ran it
        }
        if control.window_ended(now_us, self.samples.take_p90()) {
            self.counted_from_us.store(now_us, Ordering::Relaxed);
            self.samples.clear(); // the probe measures its own window only
        }
        self.limit.store(control.limit(), Ordering::Relaxed);
        self.window_end_us
            .store(now_us + self.window_us, Ordering::Relaxed);
        drop(control);
        self.hand_out();
    }

    fn release(self: &Arc<Self>) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        if self.waiting.load(Ordering::Acquire) > 0 {
            self.hand_out();
        }
    }
}

/// A request's place among the upstream's requests in flight, given back when dropped.
pub struct Slot {
    gate: Arc<Gate>,
}

impl Slot {
    pub fn gate(&self) -> &Arc<Gate> {
        &self.gate
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gate.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cmp::Reverse;
    use std::collections::{BinaryHeap, VecDeque};

    const MS: u64 = 1000;

    fn config(min: u32, max: u32) -> Adaptive {
        Adaptive {
            min_limit: min,
            max_limit: max,
            ..Adaptive::default()
        }
    }

    /// A simulated upstream of `servers` that each serve one request in `service_us`
    /// (the rest wait in its FIFO queue), driven through the gate by `clients` that send
    /// again as soon as answered, or 1 ms after being shed. Time is simulated: exact and
    /// instant.
    struct Sim {
        gate: Arc<Gate>,
        now: u64,
        servers: usize,
        busy: usize,
        service_us: u64,
        waiting: VecDeque<(u64, Slot, usize)>,
        /// (when, what): a client's next try, or a server finishing (start, client).
        events: BinaryHeap<Reverse<(u64, u64, Event)>>,
        done: Vec<Option<Slot>>,
        seq: u64,
        /// (time, limit) after each window; upstream latencies of the admitted requests.
        limits: Vec<(u64, u64)>,
        latencies: Vec<u64>,
    }

    #[derive(PartialEq, Eq, PartialOrd, Ord)]
    enum Event {
        Try(usize),
        Finish(u64, usize),
    }

    impl Sim {
        fn new(gate: Gate, servers: usize, service_us: u64, clients: usize) -> Sim {
            let mut sim = Sim {
                gate: Arc::new(gate),
                now: 0,
                servers,
                busy: 0,
                service_us,
                waiting: VecDeque::new(),
                events: BinaryHeap::new(),
                done: (0..clients).map(|_| None).collect(),
                seq: 0,
                limits: Vec::new(),
                latencies: Vec::new(),
            };
            for c in 0..clients {
                sim.at(c as u64 * 100, Event::Try(c));
            }
            sim
        }

        fn at(&mut self, when: u64, event: Event) {
            self.seq += 1;
            self.events.push(Reverse((when, self.seq, event)));
        }

        fn start(&mut self, started: u64, slot: Slot, client: usize) {
            self.busy += 1;
            self.done[client] = Some(slot);
            self.at(self.now + self.service_us, Event::Finish(started, client));
        }

        /// Runs until `until_us`.
        fn run(&mut self, until_us: u64) {
            while let Some(Reverse((when, _, event))) = self.events.pop() {
                if when > until_us {
                    self.events.push(Reverse((when, 0, event)));
                    break;
                }
                self.now = when;
                match event {
                    Event::Try(c) => match self.gate.try_admit(1.0) {
                        Some(slot) if self.busy < self.servers => self.start(self.now, slot, c),
                        Some(slot) => self.waiting.push_back((self.now, slot, c)),
                        None => self.at(self.now + MS, Event::Try(c)),
                    },
                    Event::Finish(started, c) => {
                        self.busy -= 1;
                        let before = self.gate.limit();
                        self.gate.record(started, self.now);
                        self.latencies.push(self.now - started);
                        let after = self.gate.limit();
                        if after != before || self.limits.is_empty() {
                            self.limits.push((self.now, after));
                        }
                        drop(self.done[c].take());
                        if let Some((s, slot, w)) = self.waiting.pop_front() {
                            self.start(s, slot, w);
                        }
                        self.at(self.now, Event::Try(c));
                    }
                }
                let limit = self.gate.limit();
                let c = &self.gate.config;
                assert!(
                    (u64::from(c.min_limit)..=u64::from(c.max_limit)).contains(&limit),
                    "limit {limit} left [{}, {}] at {} us",
                    c.min_limit,
                    c.max_limit,
                    self.now
                );
                assert!(self.gate.in_flight() <= self.gate.limit().max(self.gate.in_flight()));
            }
        }

        /// The limits in force between `from_us` and `to_us`.
        fn limits_between(&self, from_us: u64, to_us: u64) -> Vec<u64> {
            let before = self.limits.iter().rev().find(|(t, _)| *t <= from_us);
            before
                .into_iter()
                .chain(
                    self.limits
                        .iter()
                        .filter(|(t, _)| (from_us..to_us).contains(t)),
                )
                .map(|(_, l)| *l)
                .collect()
        }

        fn median_latency_since(&self, count: usize) -> u64 {
            let mut recent: Vec<u64> = self.latencies[self.latencies.len() - count..].to_vec();
            recent.sort_unstable();
            recent[recent.len() / 2]
        }
    }

    #[test]
    fn buckets_round_trip_within_three_percent() {
        for us in [1u64, 15, 16, 17, 31, 32, 1000, 20_000, 123_456, 1 << 31] {
            let back = Samples::value(Samples::bucket(us));
            let error = back.abs_diff(us) as f64 / us as f64;
            assert!(error <= 0.032, "{us} came back as {back}");
        }
        let s = Samples::new();
        for us in 1..=100 {
            s.record(us * 1000);
        }
        let p90 = s.take_p90().expect("100 samples");
        assert!((88_000..=93_000).contains(&p90), "p90 {p90}");
        for _ in 0..9 {
            s.record(5);
        }
        assert_eq!(s.take_p90(), None, "9 samples: the limit is kept");
        s.record(5);
        assert_eq!(s.take_p90(), Some(5), "the 9 carried over, and one more");
    }

    #[test]
    fn the_controller_follows_the_gradient_and_its_bounds() {
        let mut c = Controller::new(&config(4, 100), 7);
        assert_eq!(
            (c.limit(), c.probing()),
            (4, true),
            "starts by probing at min_limit"
        );
        assert!(!c.window_ended(250_000, None), "no samples: still probing");
        assert_eq!(c.limit(), 4);
        c.window_ended(500_000, Some(20_000));
        assert_eq!(
            (c.limit(), c.best_us()),
            (20, Some(20_000)),
            "back to initial_limit"
        );
        // p90 at the best: gradient 1.5, 20 x 1.5 + sqrt(20).
        c.window_ended(750_000, Some(20_000));
        assert_eq!(c.limit(), (20.0 * 1.5 + 20f64.sqrt()).round() as u64);
        // Far slower: the gradient's floor halves it (plus headroom).
        let before = c.limit;
        c.window_ended(1_000_000, Some(2_000_000));
        assert_eq!(c.limit(), (before * 0.5 + before.sqrt()).round() as u64);
        // Far faster: doubled, up to max_limit.
        for i in 0..10 {
            c.window_ended(1_250_000 + i * 250_000, Some(1_000));
        }
        assert_eq!(c.limit(), 100);
        for i in 0..20 {
            c.window_ended(5_000_000 + i * 250_000, Some(10_000_000));
        }
        assert_eq!(c.limit(), 4, "never below min_limit");
    }

    #[test]
    fn probes_come_every_probe_every_jittered_by_at_most_ten_percent() {
        let mut c = Controller::new(&config(4, 100), 99);
        c.window_ended(0, Some(20_000));
        let mut now = 0;
        let mut starts = Vec::new();
        while starts.len() < 20 {
            now += 250_000;
            if c.probing() {
                c.window_ended(now, Some(20_000));
                assert_eq!(c.limit(), 100, "back where it was");
            } else if c.window_ended(now, Some(20_000)) {
                starts.push(now);
                assert_eq!(c.limit(), 4, "a probe runs at min_limit");
            }
        }
        let gaps: Vec<u64> = starts.windows(2).map(|w| w[1] - w[0]).collect();
        // 30 s, +0..10%, +1 window for the probe itself, to the next window's end.
        assert!(
            gaps.iter().all(|g| (30_250_000..=33_500_000).contains(g)),
            "{gaps:?}"
        );
        assert!(gaps.iter().any(|g| *g != gaps[0]), "jittered: {gaps:?}");
    }

    #[test]
    fn it_converges_near_the_upstreams_capacity_falls_on_a_slowdown_and_climbs_back() {
        // 8 servers of 20 ms, 64 clients: the upstream's own queue grows with every
        // request over 8 in flight.
        let mut sim = Sim::new(Gate::with_seed(&Adaptive::default(), 1), 8, 20 * MS, 64);
        sim.run(20_000 * MS);
        let settled = sim.limits_between(10_000 * MS, 20_000 * MS);
        let mean = settled.iter().sum::<u64>() as f64 / settled.len() as f64;
        eprintln!("settled limits {settled:?} mean {mean:.1}");
        assert!(settled.iter().all(|l| (6..=24).contains(l)), "{settled:?}");
        let median = sim.median_latency_since(1000);
        eprintln!("median upstream latency {median} us");
        assert!(
            median <= 45 * MS,
            "the upstream's queue stays short: {median} us"
        );

        // The upstream slows to 60 ms a request: within 3 windows the limit falls.
        let before = sim.gate.limit();
        sim.service_us = 60 * MS;
        sim.run(20_750 * MS + 60 * MS);
        let fell = sim.gate.limit();
        eprintln!("slowdown: {before} -> {fell} in 3 windows");
        assert!(fell * 10 <= before * 6 || fell == 4, "{before} -> {fell}");

        sim.run(22_000 * MS);
        let low = sim.gate.limit();
        assert!(low <= 6, "held down while slow: {low}");

        // Back to 2 ms (before the next probe, so the best is still 20 ms): within 5 s
        // the limit is back where it had settled, and above.
        sim.service_us = 2 * MS;
        sim.run(27_000 * MS);
        let climbed = sim.limits_between(22_000 * MS, 27_000 * MS);
        eprintln!("recovery: {climbed:?}");
        assert!(sim.gate.limit() >= before, "{climbed:?}");

        // The next probe learns the new best: it settles near capacity again (8 servers
        // whatever their speed), never left [min, max] on the way (asserted throughout).
        sim.run(60_000 * MS);
        let settled = sim.limits_between(50_000 * MS, 60_000 * MS);
        eprintln!("after the probe: {settled:?}");
        assert!(settled.iter().all(|l| (6..=24).contains(l)), "{settled:?}");
    }

    #[test]
    fn a_narrow_range_holds_under_every_load() {
        for (servers, service) in [(1, 50 * MS), (8, 20 * MS), (64, MS)] {
            let mut sim = Sim::new(Gate::with_seed(&config(5, 9), 3), servers, service, 32);
            sim.run(10_000 * MS); // asserts [min, max] at every event
            assert!(sim.limits.iter().all(|(_, l)| (5..=9).contains(l)));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_requests_get_slots_by_share_then_arrival_or_are_shed() {
        let mut cfg = config(4, 2000);
        cfg.initial_limit = 4;
        cfg.queue = Duration::from_millis(50);
        let gate = Arc::new(Gate::with_seed(&cfg, 5));
        assert_eq!(gate.limit(), 4);
        let held: Vec<Slot> = (0..4).map(|_| gate.try_admit(1.0).expect("free")).collect();
        assert!(gate.try_admit(1.0).is_none());
        // A free-plan request waits first, then a gold one: gold is served first.
        let (g1, g2) = (gate.clone(), gate.clone());
        let free = tokio::spawn(async move { g1.admit(0.6).await.map(|_| "free") });
        tokio::task::yield_now().await;
        let gold = tokio::spawn(async move { g2.admit(1.0).await.map(|_| "gold") });
        tokio::task::yield_now().await;
        let mut held = held;
        held.pop(); // 3 in flight: gold (4 allowed) may take it, free (2 allowed) may not
        assert_eq!(gold.await.expect("task"), Ok("gold"));
        // Free waits out its 50 ms: 3 in flight is above its share of 4 (2).
        assert_eq!(free.await.expect("task"), Err(Shed));
        assert_eq!(gate.in_flight(), 3);
        drop(held);
        assert_eq!(gate.in_flight(), 0, "every slot came back");
        let slot = gate.admit(0.3).await.expect("0.3 of 4 is still one slot");
        drop(slot);
        cfg.queue = Duration::ZERO;
        let no_wait = Arc::new(Gate::with_seed(&cfg, 5));
        let _full: Vec<Slot> = (0..4)
            .map(|_| no_wait.try_admit(1.0).expect("free"))
            .collect();
        assert_eq!(
            no_wait.admit(1.0).await.err(),
            Some(Shed),
            "queue = 0: shed at once"
        );
    }
}

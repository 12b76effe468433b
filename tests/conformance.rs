//! The memory and Redis backends give identical verdicts for the same sequences of (time, cost).
//!
//! Every test drives both backends with the same checks on a manual clock (`clock =
//! "local"`) and requires equal `Verdict`s, call by call. Redis runs as real
//! `redis-server` processes on free ports.
//!
//! Redis TTLs are relative and run in real time, so the manual clock starts at the real
//! present and never runs slower than the wall clock (`TestClock`): a key Redis has expired
//! is then always one the memory backend also treats as expired. Sequences of (step, cost)
//! come from fixed seeds; only when the wall clock ticks between two calls planned for the
//! same millisecond does the test clock move on with it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::redis::{RedisCluster, RedisSentinel, RedisServer};
use sluice::config::{self, Algorithm, ClockSource, OnError};
use sluice::limiter::algorithm::{Rule, Verdict};
use sluice::limiter::backend::{Adjustment, Backend, BackendError, Check};
use sluice::limiter::memory::MemoryBackend;
use sluice::limiter::redis::RedisBackend;

fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as u64
}

/// A manual clock that starts at the real present and never advances slower than the
/// wall clock, so no Redis key expires before the test's time says it may.
struct TestClock {
    sim: u64,
    wall: u64,
}

impl TestClock {
    fn new() -> TestClock {
        let wall = wall_ms();
        TestClock { sim: wall, wall }
    }

    /// The time now: where it was, unless the wall clock ticked meanwhile (then past that,
    /// with a millisecond to spare for the call in flight).
    fn now(&mut self) -> u64 {
        let wall = wall_ms();
        let ran = wall.saturating_sub(self.wall);
        self.wall = wall;
        if ran > 0 {
            self.sim += ran + 1;
        }
        self.sim
    }

    /// Moves to `at` (or stays later, if the clock is already past it).
    fn to(&mut self, at: u64) -> u64 {
        self.sim = self.now().max(at);
        self.sim
    }
}

fn limiter_config(backend: config::Backend, clock: ClockSource) -> config::Limiter {
    config::Limiter {
        backend,
        timeout: Duration::from_secs(2),
        key_prefix: "t:".into(),
        clock,
        on_error: OnError::Allow,
        deny_cache: 0,
        max_keys: 1_000_000,
    }
}

async fn connect(backend: config::Backend, clock: ClockSource) -> RedisBackend {
    RedisBackend::connect(&limiter_config(backend, clock))
        .await
        .expect("redis backend for the test server")
}

fn rule(algorithm: Algorithm, limit: u64, period_ms: u64, burst: u64) -> Rule {
    Rule {
        algorithm,
        limit,
        period_ms,
        burst,
        max_delay_ms: None,
        lease_ms: 60_000,
        calendar: None,
    }
}

fn delayed(mut r: Rule, max_delay_ms: u64) -> Rule {
    r.max_delay_ms = Some(max_delay_ms);
    r
}

/// A key in the shape the limiter builds: `<prefix>{<hash>}:<policy>:<algorithm>`.
fn key(tag: &str, policy: &str, r: &Rule) -> String {
    format!("t:{{{tag}}}:{policy}:{}", r.algorithm.name())
}

fn check(key: &str, rule: Rule, cost: u64, enforce: bool, lease: u64) -> Check {
    Check {
        key: key.to_owned(),
        rule,
        cost,
        enforce,
        lease,
        ban_ms: 0,
    }
}

/// A fixed-seed generator (PCG-style LCG): the same sequences on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// How many mismatches a test may put down to a slow call before it fails: a few, or one in
/// twenty of its calls on a loaded machine, so most of every sequence is still compared.
const SLOW_CALL_ALLOWANCE: u32 = 5;
const SLOW_CALL_SHARE: u32 = 20;

/// How far ahead of the wall clock a group of concurrent requests is timed: a batch call
/// that takes no longer than this finds no key that Redis expired before the test's time
/// says it may.
const BATCH_MARGIN_MS: u64 = 10;

/// The memory backend and a Redis backend fed the same calls.
///
/// One mismatch is not the backends' fault: Redis expires a key by the real clock, a TTL
/// after the call that set it ran. The test clock keeps ahead of the wall clock, but a call
/// runs a little after its time was read; when those delays use up the lead, a key can be
/// gone from Redis that the test clock still counts. Such a call taints the keys: a
/// mismatch then is reported and the twin moves both backends to fresh keys (a new
/// generation) instead of failing, a few times per test. A loss can also go unseen for a
/// while (a settlement on a key Redis lost, a bucket a fraction short that rounds alike),
/// so random walks call `fresh_keys_if_tainted` between steps.
struct Twin {
    memory: MemoryBackend,
    redis: RedisBackend,
    generation: std::cell::Cell<u32>,
    excused: std::cell::Cell<u32>,
    calls: std::cell::Cell<u32>,
    /// The greatest lead of the test clock over the wall clock (µs) at the start of any
    /// Redis call on the current generation's keys.
    greatest_lead_us: std::cell::Cell<i128>,
    /// Whether a call on the current generation's keys ended with the lead used up.
    tainted: std::cell::Cell<bool>,
    origin: Instant,
    origin_ms: u64,
}

impl Twin {
    fn new(redis: RedisBackend) -> Twin {
        Twin {
            memory: MemoryBackend::new(1_000_000),
            redis,
            generation: std::cell::Cell::new(0),
            excused: std::cell::Cell::new(0),
            calls: std::cell::Cell::new(0),
            greatest_lead_us: std::cell::Cell::new(i128::MIN),
            tainted: std::cell::Cell::new(false),
            origin: Instant::now(),
            origin_ms: wall_ms(),
        }
    }

    /// How far test time `now` is ahead of the wall clock, in µs.
    fn lead_us(&self, now: u64) -> i128 {
        let wall_us = self.origin_ms as i128 * 1000 + self.origin.elapsed().as_micros() as i128;
        now as i128 * 1000 - wall_us
    }

    /// Notes a Redis call starting at test time `now`.
    fn calling(&self, now: u64) {
        self.calls.set(self.calls.get() + 1);
        let lead = self.lead_us(now);
        self.greatest_lead_us
            .set(self.greatest_lead_us.get().max(lead));
    }

    /// Notes a Redis call at test time `now` ending: a key set by an earlier call can have
    /// expired in Redis before `now` if the wall clock moved at least a millisecond more
    /// since that call started than the test clock did (a key with a TTL of t ms set at
    /// test time s lives until t ms after its call started by the wall clock), that is if
    /// the lead fell a millisecond below what it was at the start of any call before.
    fn called(&self, now: u64) {
        if self.lead_us(now) <= self.greatest_lead_us.get().saturating_sub(1000) {
            self.tainted.set(true);
        }
    }

    /// Puts a mismatch down to a slow call (`why`, at `context`), within the allowance.
    fn excuse(&self, why: &str, context: String) {
        self.excused.set(self.excused.get() + 1);
        assert!(
            self.excused.get() <= SLOW_CALL_ALLOWANCE.max(self.calls.get() / SLOW_CALL_SHARE),
            "too many mismatches after slow calls; the last {why} at {context}"
        );
        eprintln!("note: redis and memory differ {why} at {context}; continuing on fresh keys");
        self.fresh_keys();
    }

    fn fresh_keys(&self) {
        self.generation.set(self.generation.get() + 1);
        self.greatest_lead_us.set(i128::MIN);
        self.tainted.set(false);
    }

    /// Moves to fresh keys if Redis may have lost one the test clock still counts.
    fn fresh_keys_if_tainted(&self) {
        if self.tainted.get() {
            self.fresh_keys();
        }
    }

    /// `key` in the current generation (the hash tag, and so the slot, stays the same).
    fn scoped(&self, key: &str) -> String {
        match self.generation.get() {
            0 => key.to_owned(),
            g => format!("{key}~{g}"),
        }
    }

    fn generation(&self) -> u32 {
        self.generation.get()
    }

    /// For each phase (a rule and a number of requests), how many cost-1 requests on `key`
    /// at `now` both backends admitted: the rule changes between phases as an override does.
    async fn admitted_in_phases(&self, key: &str, now: u64, phases: &[(Rule, u32)]) -> Vec<u32> {
        let mut passed = Vec::new();
        for &(r, n) in phases {
            let mut admitted = 0;
            for i in 0..n {
                let ctx = || format!("{r:?} request {i}");
                if self.decide(&[check(key, r, 1, true, 0)], now, &ctx).await[0].allowed {
                    admitted += 1;
                }
            }
            passed.push(admitted);
        }
        passed
    }

    async fn decide(
        &self,
        checks: &[Check],
        now: u64,
        context: &dyn Fn() -> String,
    ) -> Vec<Verdict> {
        let checks: Vec<Check> = checks
            .iter()
            .map(|c| Check {
                key: self.scoped(&c.key),
                ..c.clone()
            })
            .collect();
        self.calling(now);
        let got = self
            .redis
            .decide(&checks, now)
            .await
            .unwrap_or_else(|e| panic!("redis backend failed ({e}) at {}", context()));
        self.called(now);
        let want = self
            .memory
            .decide(&checks, now)
            .await
            .expect("memory backend");
        if got != want && self.tainted.get() {
            self.excuse(
                "after the wall clock outran the test clock (a key's last millisecond)",
                format!("{}: redis {got:?}, memory {want:?}", context()),
            );
            return want;
        }
        assert_eq!(
            got,
            want,
            "redis (left) and memory (right) differ at {}",
            context()
        );
        want
    }

    /// Decides `requests` (checks, now) on Redis all at once, queued in this order, so the
    /// backend sends them in as few batch calls as it can; and on memory one after another
    /// in the same order. Every request's verdicts must agree, with the allowance of
    /// `decide` for a call slower than `BATCH_MARGIN_MS`.
    async fn decide_together(
        &self,
        requests: &[(Vec<Check>, u64)],
        context: &dyn Fn() -> String,
    ) -> Vec<Vec<Verdict>> {
        let requests: Vec<(Vec<Check>, u64)> = requests
            .iter()
            .map(|(checks, now)| {
                let checks = checks
                    .iter()
                    .map(|c| Check {
                        key: self.scoped(&c.key),
                        ..c.clone()
                    })
                    .collect();
                (checks, *now)
            })
            .collect();
        let started = Instant::now();
        if let Some(first) = requests.iter().map(|(_, now)| *now).min() {
            self.calling(first);
        }
        let mut calls: Vec<_> = requests
            .iter()
            .map(|(checks, now)| self.redis.decide(checks, *now))
            .collect();
        let mut got: Vec<Option<Result<Vec<Verdict>, BackendError>>> =
            calls.iter().map(|_| None).collect();
        // Every call polled in order until done: the first round queues them all, in this
        // order, before the first is sent.
        std::future::poll_fn(|cx| {
            let mut pending = false;
            for (call, got) in calls.iter_mut().zip(got.iter_mut()) {
                if got.is_none() {
                    match call.as_mut().poll(cx) {
                        Poll::Ready(verdicts) => *got = Some(verdicts),
                        Poll::Pending => pending = true,
                    }
                }
            }
            if pending {
                Poll::Pending
            } else {
                Poll::Ready(())
            }
        })
        .await;
        let took = started.elapsed();
        let got: Vec<Vec<Verdict>> = got
            .into_iter()
            .map(|g| {
                g.expect("polled until done")
                    .unwrap_or_else(|e| panic!("redis backend failed ({e}) at {}", context()))
            })
            .collect();
        let mut want = Vec::with_capacity(requests.len());
        for (checks, now) in &requests {
            want.push(
                self.memory
                    .decide(checks, *now)
                    .await
                    .expect("memory backend"),
            );
        }
        if got != want && took >= Duration::from_millis(BATCH_MARGIN_MS) {
            self.excuse(&format!("after a {took:?} batch"), context());
            return want;
        }
        for (n, ((checks, now), (got, want))) in
            requests.iter().zip(got.iter().zip(&want)).enumerate()
        {
            assert_eq!(
                got,
                want,
                "redis (left) and memory (right) differ for request {n} of {} ({checks:?} at {now}) at {}",
                requests.len(),
                context()
            );
        }
        want
    }

    /// Settles the same adjustments on both (what they did shows in the next decisions).
    async fn adjust(&self, adjustments: &[Adjustment], now: u64) {
        let adjustments: Vec<Adjustment> = adjustments
            .iter()
            .map(|a| Adjustment {
                check: Check {
                    key: self.scoped(&a.check.key),
                    ..a.check.clone()
                },
                ..a.clone()
            })
            .collect();
        self.calling(now);
        self.redis
            .adjust(&adjustments, now)
            .await
            .expect("redis adjust");
        self.called(now);
        self.memory
            .adjust(&adjustments, now)
            .await
            .expect("memory adjust");
    }

    /// Renews on both; they must agree on whether the lease was live.
    async fn renew(&self, key: &str, lease: u64, lease_ms: u64, now: u64) -> bool {
        let key = self.scoped(key);
        let memory = self
            .memory
            .renew(&key, lease, lease_ms, now)
            .await
            .expect("memory renew");
        self.calling(now);
        let redis = self
            .redis
            .renew(&key, lease, lease_ms, now)
            .await
            .expect("redis renew");
        self.called(now);
        assert_eq!(
            redis, memory,
            "redis (left) and memory (right) renew {key} {lease}"
        );
        memory
    }

    async fn release(&self, key: &str, lease: u64) {
        let key = self.scoped(key);
        self.memory
            .release(&key, lease)
            .await
            .expect("memory release");
        self.redis
            .release(&key, lease)
            .await
            .expect("redis release");
    }
}

/// The rules every algorithm is held to: fractional rates (3 per second, and 10 per
/// millisecond), burst ≠ limit, a long period, and for token_bucket/gcra the delay mode.
/// (No 1 ms period: its states live a millisecond, which a loaded machine cannot time.)
fn rules_for(algorithm: Algorithm) -> Vec<Rule> {
    let mut rules = vec![
        rule(algorithm, 10, 1_000, 10),
        rule(algorithm, 3, 1_000, 5),
        rule(algorithm, 7, 60_000, 2),
        rule(algorithm, 1_000, 100, 500),
        rule(algorithm, 5, 250, 1),
    ];
    if matches!(algorithm, Algorithm::TokenBucket | Algorithm::Gcra) {
        rules.push(delayed(rule(algorithm, 10, 1_000, 1), 250));
        rules.push(delayed(rule(algorithm, 3, 1_000, 2), 1_500));
    }
    if algorithm == Algorithm::Concurrency {
        rules = vec![rule(algorithm, 1, 1_000, 1), rule(algorithm, 3, 1_000, 3)];
        for r in &mut rules {
            r.lease_ms = 500;
        }
    }
    rules
}

/// The next time in a random walk: often the same or a little later, sometimes exactly
/// at (or next to) a window boundary, sometimes after a long idle.
fn step_time(rng: &mut Rng, now: u64, period: u64) -> u64 {
    match rng.below(20) {
        0..=2 => now,
        3..=12 => now + rng.below(period / 4 + 1),
        13..=15 => now + rng.below(period + 1),
        16 | 17 => {
            let end = now - now % period + period;
            end - 1 + rng.below(3)
        }
        18 => now + period * (2 + rng.below(3)),
        _ => now + 86_400_000 * (1 + rng.below(2)),
    }
}

fn step_cost(rng: &mut Rng, limit: u64) -> u64 {
    match rng.below(10) {
        0 => 0,
        1..=5 => 1,
        6 | 7 => 2,
        8 => 3,
        _ => limit + 1,
    }
}

/// One step of a random walk on `k` under `r` at `now`: for concurrency with leases held,
/// now and then the release of one; else a check costing `cost(rng)`, decided on both
/// backends, its lease kept when admitted.
#[allow(clippy::too_many_arguments)]
async fn walk_step(
    twin: &Twin,
    k: &str,
    r: Rule,
    rng: &mut Rng,
    now: u64,
    step: u64,
    held: &mut Vec<u64>,
    cost: impl FnOnce(&mut Rng) -> u64,
) {
    let concurrency = r.algorithm == Algorithm::Concurrency;
    if concurrency && !held.is_empty() && rng.below(3) == 0 {
        let lease = held.swap_remove(rng.below(held.len() as u64) as usize);
        twin.release(k, lease).await;
        return;
    }
    let cost = cost(rng);
    let c = check(k, r, cost, true, step + 1);
    let v = twin
        .decide(std::slice::from_ref(&c), now, &|| {
            format!("{r:?} step {step} now {now} cost {cost}")
        })
        .await;
    if concurrency && v[0].allowed {
        held.push(step + 1);
    }
}

/// Every algorithm, every rule, a seeded random walk of single checks.
#[tokio::test]
async fn single_checks_match_on_random_sequences() {
    let server = RedisServer::start();
    let twin = Twin::new(connect(config::Backend::Redis(server.url()), ClockSource::Local).await);
    let mut rng = Rng(0x5eed);
    for algorithm in Algorithm::ALL {
        for (n, r) in rules_for(algorithm).into_iter().enumerate() {
            let k = key(&format!("walk{n}"), "p", &r);
            let mut clock = TestClock::new();
            let mut held: Vec<u64> = Vec::new();
            for step in 0..400u64 {
                twin.fresh_keys_if_tainted();
                let now = clock.to(step_time(&mut rng, clock.sim, r.period_ms));
                let cost = |rng: &mut Rng| step_cost(rng, r.limit);
                walk_step(&twin, &k, r, &mut rng, now, step, &mut held, cost).await;
            }
        }
    }
}

/// Charges settled from responses (DESIGN §12): every algorithm a response may charge, a
/// random walk of decisions each followed, now or a little later, by its settlement: a
/// refund of part or all of what it held (at the time it was charged, also once its window
/// has moved on), or a charge of more, up to twice the limit (a debt the next decisions
/// must show). Both backends must then decide every later request alike.
#[tokio::test]
async fn settled_charges_match_on_random_sequences() {
    let server = RedisServer::start();
    let twin = Twin::new(connect(config::Backend::Redis(server.url()), ClockSource::Local).await);
    let mut rng = Rng(0xad1_5eed);
    let metered = [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::SlidingLog,
        Algorithm::TokenBucket,
        Algorithm::Gcra,
    ];
    for algorithm in metered {
        for (n, r) in rules_for(algorithm).into_iter().enumerate() {
            let k = key(&format!("settle{n}"), "p", &r);
            let mut clock = TestClock::new();
            for step in 0..300u64 {
                twin.fresh_keys_if_tainted();
                let charged_at = clock.to(step_time(&mut rng, clock.sim, r.period_ms));
                let held = 1 + rng.below(3);
                let c = check(&k, r, held, true, 0);
                let context = || format!("{r:?} step {step} at {charged_at} holding {held}");
                let v = twin
                    .decide(std::slice::from_ref(&c), charged_at, &context)
                    .await;
                if !v[0].allowed {
                    continue;
                }
                // The response ends now or later (sometimes in the next window).
                let now = match rng.below(4) {
                    0 => charged_at,
                    1 | 2 => clock.to(charged_at + rng.below(r.period_ms / 2 + 1)),
                    _ => clock.to(charged_at + r.period_ms),
                };
                let cost = match rng.below(4) {
                    0 => 0,
                    1 => held,
                    2 => rng.below(held + 1),
                    _ => held + 1 + rng.below(2 * r.limit),
                };
                let amount = cost as i64 - held as i64;
                if amount != 0 {
                    let adjustment = Adjustment {
                        check: c,
                        charged_at,
                        amount,
                    };
                    twin.adjust(&[adjustment], now).await;
                }
                // Observe right after: the settlement must read alike on both.
                let probe = check(&k, r, 0, true, 0);
                twin.decide(&[probe], now, &|| {
                    format!("{} then settling {amount}", context())
                })
                .await;
            }
        }
    }
}

/// A response that cost more than was held leaves a debt: the key's next request waits it
/// out on every algorithm a response may charge, on both backends.
#[tokio::test]
async fn a_debt_delays_the_next_requests() {
    let server = RedisServer::start();
    let twin = Twin::new(connect(config::Backend::Redis(server.url()), ClockSource::Local).await);
    let mut clock = TestClock::new();
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::SlidingLog,
        Algorithm::TokenBucket,
        Algorithm::Gcra,
    ] {
        let r = rule(algorithm, 10, 1_000, 10);
        let k = key("debt", "p", &r);
        let at = clock.now();
        let c = check(&k, r, 1, true, 0);
        let v = twin
            .decide(std::slice::from_ref(&c), at, &|| format!("{algorithm:?}"))
            .await;
        assert!(v[0].allowed);
        // It cost 25: 24 more than held, 15 past the limit.
        let debt = Adjustment {
            check: c.clone(),
            charged_at: at,
            amount: 24,
        };
        twin.adjust(&[debt], at).await;
        let v = twin
            .decide(std::slice::from_ref(&c), at, &|| {
                format!("{algorithm:?} after")
            })
            .await;
        assert!(
            !v[0].allowed,
            "{algorithm:?}: the next request must wait out the debt"
        );
        assert_eq!(v[0].remaining, 0);
        // token_bucket and gcra: 15 units past the limit at 10 per second is 1.5 s more.
        if matches!(algorithm, Algorithm::TokenBucket | Algorithm::Gcra) {
            assert!(v[0].retry_after_ms >= 1_500, "{algorithm:?}: {:?}", v[0]);
        }
    }
}

/// Window boundaries, cost 0, cost over the limit, and long idle, for every algorithm.
#[tokio::test]
async fn edge_cases_match() {
    let server = RedisServer::start();
    let twin = Twin::new(connect(config::Backend::Redis(server.url()), ClockSource::Local).await);
    let mut clock = TestClock::new();
    for algorithm in Algorithm::ALL {
        let r = rule(algorithm, 3, 1_000, 3);
        let k = key("edge", "p", &r);
        let start = clock.now() + 100;
        let end = start - start % 1_000 + 1_000;
        let plan: [(u64, u64); 14] = [
            (end - 1, 2),
            (end - 1, 1),
            (end - 1, 1),
            (end, 1),
            (end, 0),
            (end + 1, 2),
            (end + 1, 4),
            (end + 999, 1),
            (end + 1_000, 3),
            (end + 1_000, 1),
            (end + 2_000, 0),
            (end + 3_500, 1),
            (end + 86_400_000, 3),
            (end + 86_400_000 + 1, 1),
        ];
        for (i, (at, cost)) in plan.into_iter().enumerate() {
            let now = clock.to(at);
            let c = check(&k, r, cost, true, i as u64 + 1);
            twin.decide(&[c], now, &|| {
                format!("{algorithm:?} step {i} now {now} cost {cost}")
            })
            .await;
        }
    }
}

/// Random batches of 2–4 checks over several algorithms, enforce and shadow mixed, some of
/// cost 0: the all-or-nothing rule must charge exactly the same on both.
#[tokio::test]
async fn batches_match_all_or_nothing() {
    let server = RedisServer::start();
    let twin = Twin::new(connect(config::Backend::Redis(server.url()), ClockSource::Local).await);
    let pool: Vec<(String, Rule)> = Algorithm::ALL
        .into_iter()
        .enumerate()
        .flat_map(|(i, algorithm)| {
            let tight = rule(algorithm, 2 + i as u64 % 3, 1_000, 3);
            let loose = rule(algorithm, 20, 1_000, 20);
            [
                (key(&format!("b{i}"), "tight", &tight), tight),
                (key(&format!("b{i}"), "loose", &loose), loose),
            ]
        })
        .collect();
    let mut rng = Rng(7);
    let mut clock = TestClock::new();
    let mut leases: Vec<(String, u64)> = Vec::new();
    for step in 0..600u64 {
        let now = clock.to(step_time(&mut rng, clock.sim, 1_000).min(clock.sim + 5_000));
        if !leases.is_empty() && rng.below(4) == 0 {
            let (k, lease) = leases.swap_remove(rng.below(leases.len() as u64) as usize);
            twin.release(&k, lease).await;
        }
        let size = 2 + rng.below(3) as usize;
        let mut chosen: Vec<usize> = Vec::new();
        while chosen.len() < size {
            let i = rng.below(pool.len() as u64) as usize;
            if !chosen.contains(&i) {
                chosen.push(i);
            }
        }
        let checks: Vec<Check> = chosen
            .iter()
            .enumerate()
            .map(|(j, &i)| {
                let (k, r) = &pool[i];
                check(
                    k,
                    *r,
                    [0, 1, 1, 2][rng.below(4) as usize],
                    rng.below(4) != 0,
                    step * 10 + j as u64 + 1,
                )
            })
            .collect();
        let verdicts = twin
            .decide(&checks, now, &|| format!("batch {step} now {now}"))
            .await;
        let passed = checks
            .iter()
            .zip(&verdicts)
            .all(|(c, v)| v.allowed || !c.enforce);
        for (c, v) in checks.iter().zip(&verdicts) {
            if passed && v.allowed && c.rule.algorithm == Algorithm::Concurrency {
                leases.push((c.key.clone(), c.lease));
            }
        }
    }
}

/// Successful script calls (FCALL, EVALSHA and EVAL) a server has run: a first call
/// answered NOSCRIPT or "Function not found" (then loaded and sent again) does not count.
fn script_calls(server: &RedisServer) -> u64 {
    let stats = server.cli(&["INFO", "commandstats"]);
    let field = |line: &str, name: &str| -> u64 {
        line.split([':', ','])
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
            .unwrap_or(0)
    };
    stats
        .lines()
        .filter(|l| {
            l.starts_with("cmdstat_fcall:")
                || l.starts_with("cmdstat_evalsha:")
                || l.starts_with("cmdstat_eval:")
        })
        .map(|l| field(l, "calls") - field(l, "failed_calls"))
        .sum()
}

/// `size` requests of random checks from `pool` (one check mostly, some of two or three;
/// enforce, shadow or banning; cost 0 to over the limit), timed from `clock` plus
/// `BATCH_MARGIN_MS`, a few milliseconds apart now and then.
fn concurrent_requests(
    rng: &mut Rng,
    clock: &mut TestClock,
    pool: &[(String, Rule)],
    size: usize,
    lease: &mut u64,
) -> Vec<(Vec<Check>, u64)> {
    let mut at = clock.now() + BATCH_MARGIN_MS;
    let requests = (0..size)
        .map(|_| {
            if rng.below(4) == 0 {
                at += rng.below(30);
            }
            let count = match rng.below(10) {
                0 | 1 => 2,
                2 => 3,
                _ => 1,
            };
            let mut chosen: Vec<usize> = Vec::new();
            while chosen.len() < count {
                let i = rng.below(pool.len() as u64) as usize;
                if !chosen.contains(&i) {
                    chosen.push(i);
                }
            }
            let checks = chosen
                .iter()
                .map(|&i| {
                    let (k, r) = &pool[i];
                    *lease += 1;
                    let c = check(k, *r, step_cost(rng, 2), rng.below(5) != 0, *lease);
                    match rng.below(6) {
                        0 if c.enforce => banning(c, 1_500),
                        _ => c,
                    }
                })
                .collect();
            (checks, at)
        })
        .collect();
    clock.to(at);
    requests
}

/// Concurrent requests go to Redis in batch calls, each request decided all or nothing on
/// its own, in order: groups of up to 64 at once give the same verdicts as the memory
/// backend deciding them one after another, and each group is one script call.
#[tokio::test]
async fn concurrent_requests_batched_match_one_by_one() {
    let server = RedisServer::start();
    let twin = Twin::new(connect(config::Backend::Redis(server.url()), ClockSource::Local).await);
    let mut pool: Vec<(String, Rule)> = Algorithm::ALL
        .into_iter()
        .enumerate()
        .flat_map(|(i, algorithm)| {
            let mut tight = rule(algorithm, 3 + i as u64 % 3, 1_000, 4);
            let loose = rule(algorithm, 40, 1_000, 40);
            tight.lease_ms = 800;
            [
                (key(&format!("c{i}"), "tight", &tight), tight),
                (key(&format!("c{i}"), "loose", &loose), loose),
            ]
        })
        .collect();
    let delay = delayed(rule(Algorithm::Gcra, 10, 1_000, 2), 300);
    pool.push((key("cd", "delay", &delay), delay));
    let mut rng = Rng(0xba7c4);
    let mut clock = TestClock::new();
    let mut lease = 0;
    let mut held: Vec<(String, u64)> = Vec::new();
    for group in 0..60 {
        while !held.is_empty() && rng.below(3) != 0 {
            let (k, lease) = held.swap_remove(rng.below(held.len() as u64) as usize);
            twin.release(&k, lease).await;
        }
        let size = if group % 6 == 0 {
            64
        } else {
            2 + rng.below(40) as usize
        };
        let requests = concurrent_requests(&mut rng, &mut clock, &pool, size, &mut lease);
        let before = script_calls(&server);
        let verdicts = twin
            .decide_together(&requests, &|| format!("group {group}"))
            .await;
        assert_eq!(
            script_calls(&server) - before,
            1,
            "group {group} of {size} requests: one script call"
        );
        for ((checks, _), verdicts) in requests.iter().zip(&verdicts) {
            let passed = checks
                .iter()
                .zip(verdicts)
                .all(|(c, v)| v.allowed || !c.enforce);
            for (c, v) in checks.iter().zip(verdicts) {
                if passed && v.allowed && c.cost > 0 && c.rule.algorithm == Algorithm::Concurrency {
                    held.push((c.key.clone(), c.lease));
                }
            }
        }
    }
}

/// A Cluster batches per slot: concurrent requests on three slots, each request's checks
/// on one, give the same verdicts as one after another, in one script call per slot.
#[tokio::test]
async fn cluster_batches_per_slot_match_one_by_one() {
    let cluster = RedisCluster::start();
    let twin = Twin::new(
        connect(
            config::Backend::Cluster(cluster.seeds()),
            ClockSource::Local,
        )
        .await,
    );
    let tags = ["alpha", "beta", "gamma"];
    let pools: Vec<Vec<(String, Rule)>> = tags
        .iter()
        .map(|tag| {
            Algorithm::ALL
                .into_iter()
                .filter(|a| *a != Algorithm::Concurrency)
                .enumerate()
                .map(|(i, algorithm)| {
                    let r = rule(algorithm, 3 + i as u64 % 4, 1_000, 4);
                    (key(tag, &format!("p{i}"), &r), r)
                })
                .collect()
        })
        .collect();
    let mut rng = Rng(0xc105);
    let mut clock = TestClock::new();
    let mut lease = 0;
    for group in 0..40 {
        let size = 2 + rng.below(50) as usize;
        let mut requests = Vec::with_capacity(size);
        for _ in 0..size {
            let pool = &pools[rng.below(3) as usize];
            let mut one = concurrent_requests(&mut rng, &mut clock, pool, 1, &mut lease);
            requests.append(&mut one);
        }
        let calls = || cluster.nodes().iter().map(script_calls).sum::<u64>();
        let before = calls();
        twin.decide_together(&requests, &|| format!("cluster group {group}"))
            .await;
        assert!(
            calls() - before <= 3,
            "group {group} of {size} requests: one script call per slot"
        );
    }
}

/// A request of cost 0 only observes, on both backends alike: never denied or delayed, it
/// charges nothing (takes no concurrency slot) and reports the current state, also when the
/// policy is full, booked ahead (delay) or queued (leaky_bucket), alone or in a batch that
/// is charged or denied.
#[tokio::test]
async fn cost_zero_only_observes() {
    let server = RedisServer::start();
    let twin = Twin::new(connect(config::Backend::Redis(server.url()), ClockSource::Local).await);
    let mut clock = TestClock::new();
    let mut rules: Vec<Rule> = Algorithm::ALL
        .into_iter()
        .map(|a| rule(a, 3, 60_000, 2))
        .collect();
    rules.push(delayed(rule(Algorithm::TokenBucket, 10, 1_000, 1), 500));
    rules.push(delayed(rule(Algorithm::Gcra, 10, 1_000, 1), 500));
    let mut lease = 0;
    for (n, r) in rules.into_iter().enumerate() {
        let tag = format!("zero{n}");
        let (k, fresh, full) = (
            key(&tag, "p", &r),
            key(&tag, "fresh", &r),
            key(&tag, "full", &r),
        );
        let mut decide = async |checks: &[(&str, u64)], what: &str| {
            let now = clock.now();
            let checks: Vec<Check> = checks
                .iter()
                .map(|&(k, cost)| {
                    lease += 1;
                    check(k, r, cost, true, lease)
                })
                .collect();
            twin.decide(&checks, now, &|| format!("{r:?} {what} at {now}"))
                .await
        };
        let observed = |v: Verdict, what: &str| {
            assert!(
                v.allowed && v.wait_ms == 0 && v.retry_after_ms == 0,
                "{r:?} {what}: {v:?}"
            );
        };
        observed(decide(&[(&k, 0)], "empty").await[0], "empty");
        // Fill `k` and `full` until a request of cost 1 is denied.
        for (target, name) in [(&k, "fill"), (&full, "fill other")] {
            let mut admitted = 0;
            while decide(&[(target, 1)], name).await[0].allowed {
                admitted += 1;
                assert!(admitted < 50, "{r:?} never fills");
            }
        }
        observed(decide(&[(&k, 0)], "full").await[0], "full");
        let v = decide(&[(&k, 0), (&fresh, 1)], "charged batch").await;
        observed(v[0], "charged batch");
        let v = decide(&[(&fresh, 0), (&k, 0), (&full, 1)], "denied batch").await;
        observed(v[0], "denied batch");
        observed(v[1], "denied batch");
        // Nothing was charged: the next requests see what they would have seen.
        decide(&[(&k, 1)], "after").await;
        decide(&[(&fresh, 1)], "after").await;
        decide(&[(&k, 0)], "after").await;
    }
}

/// The all-or-nothing rule spelled out: a denying enforce check charges nothing; a denying
/// shadow check blocks nothing and is not charged itself.
#[tokio::test]
async fn a_denied_batch_charges_nothing_and_shadow_never_blocks() {
    let server = RedisServer::start();
    let twin = Twin::new(connect(config::Backend::Redis(server.url()), ClockSource::Local).await);
    let wide = rule(Algorithm::SlidingLog, 10, 1_000, 10);
    let narrow = rule(Algorithm::Gcra, 1, 1_000, 1);
    let (a, b) = (key("x", "wide", &wide), key("x", "narrow", &narrow));
    let ctx = || "all-or-nothing".to_owned();
    let mut clock = TestClock::new();
    let t0 = clock.now();
    let both = [check(&a, wide, 1, true, 0), check(&b, narrow, 1, true, 0)];
    assert!(twin.decide(&both, t0, &ctx).await.iter().all(|v| v.allowed));
    let second = twin.decide(&both, clock.now(), &ctx).await;
    assert!(second[0].allowed && !second[1].allowed);
    let alone = twin.decide(&both[..1], clock.now(), &ctx).await;
    assert_eq!(alone[0].remaining, 8, "the denied batch charged `wide`");

    let shadow = [check(&a, wide, 1, true, 0), check(&b, narrow, 1, false, 0)];
    let v = twin.decide(&shadow, clock.now(), &ctx).await;
    assert!(v[0].allowed && !v[1].allowed);
    assert_eq!(v[0].remaining, 7, "a shadow denial blocked the batch");
    // A shadow check that allows is charged with the batch.
    let free = rule(Algorithm::SlidingLog, 2, 60_000, 2);
    let c = key("x", "free", &free);
    let shadow = [check(&a, wide, 1, true, 0), check(&c, free, 1, false, 0)];
    let v = twin.decide(&shadow, clock.now(), &ctx).await;
    assert!(v[0].allowed && v[1].allowed);
    let v = twin.decide(&shadow[1..], clock.now(), &ctx).await;
    assert_eq!(
        (v[0].allowed, v[0].remaining),
        (true, 0),
        "the allowing shadow check was not charged"
    );
}

#[tokio::test]
async fn concurrency_acquire_release_and_lease_expiry_match() {
    let server = RedisServer::start();
    let twin = Twin::new(connect(config::Backend::Redis(server.url()), ClockSource::Local).await);
    let mut r = rule(Algorithm::Concurrency, 2, 1_000, 2);
    r.lease_ms = 5_000;
    let k = key("c", "inflight", &r);
    let ctx = || "concurrency".to_owned();
    let acquire = |lease| [check(&k, r, 1, true, lease)];
    let mut clock = TestClock::new();
    assert_eq!(
        twin.decide(&acquire(1), clock.now(), &ctx).await[0].remaining,
        1
    );
    let t3 = clock.now();
    assert!(twin.decide(&acquire(3), t3, &ctx).await[0].allowed);
    assert!(!twin.decide(&acquire(5), clock.now(), &ctx).await[0].allowed);
    twin.release(&k, 1).await;
    assert!(twin.decide(&acquire(7), clock.to(t3 + 100), &ctx).await[0].allowed);
    assert!(!twin.decide(&acquire(9), clock.to(t3 + 4_999), &ctx).await[0].allowed);
    // Lease 3 expires at t3 + 5000; lease 7 holds on.
    let v = twin.decide(&acquire(11), clock.to(t3 + 5_001), &ctx).await;
    assert_eq!((v[0].allowed, v[0].remaining), (true, 0));
    twin.release(&k, 7).await;
    twin.release(&k, 11).await;
    twin.release(&k, 11).await;
    if twin.generation() == 0 {
        assert_eq!(
            server.cli(&["exists", &k]),
            "0",
            "the last release deletes the set"
        );
    }
}

/// Renewal moves a live lease's expiry on, on both backends alike, and never brings back a
/// released or expired lease.
#[tokio::test]
async fn concurrency_renewal_matches() {
    let server = RedisServer::start();
    let twin = Twin::new(connect(config::Backend::Redis(server.url()), ClockSource::Local).await);
    let mut r = rule(Algorithm::Concurrency, 1, 1_000, 1);
    r.lease_ms = 2_000;
    let k = key("r", "inflight", &r);
    let ctx = || "concurrency renewal".to_owned();
    let acquire = |lease| [check(&k, r, 1, true, lease)];
    let mut clock = TestClock::new();
    let t0 = clock.now();
    assert!(twin.decide(&acquire(1), t0, &ctx).await[0].allowed);
    assert!(twin.renew(&k, 1, 2_000, clock.to(t0 + 1_500)).await);
    // Lease 1 would have expired at t0 + 2000; renewed, it holds until t0 + 3500.
    assert!(!twin.decide(&acquire(3), clock.to(t0 + 2_500), &ctx).await[0].allowed);
    assert!(
        !twin.renew(&k, 3, 2_000, clock.now()).await,
        "never admitted"
    );
    if clock.now() < t0 + 3_400 {
        let ttl: i64 = server.cli(&["pttl", &twin.scoped(&k)]).parse().unwrap();
        assert!(
            ttl > 1_000,
            "the key lives as long as its renewed lease: {ttl}"
        );
    }
    // Past its renewed expiry the lease is gone, and renewing does not bring it back.
    let late = clock.to(t0 + 3_600);
    assert!(!twin.renew(&k, 1, 2_000, late).await, "expired");
    assert!(twin.decide(&acquire(5), clock.now(), &ctx).await[0].allowed);
    twin.release(&k, 5).await;
    assert!(!twin.renew(&k, 5, 2_000, clock.now()).await, "released");
    assert!(twin.decide(&acquire(7), clock.now(), &ctx).await[0].allowed);
}

/// SCRIPT FLUSH mid-sequence (as after a Redis restart): the next call reloads and retries.
#[tokio::test]
async fn noscript_reloads_and_retries() {
    let server = RedisServer::start();
    let twin = Twin::new(connect(config::Backend::Redis(server.url()), ClockSource::Local).await);
    let mut rng = Rng(99);
    let r = rule(Algorithm::TokenBucket, 3, 1_000, 5);
    let k = key("flush", "p", &r);
    let mut clock = TestClock::new();
    for step in 0..60 {
        if step % 20 == 10 {
            assert_eq!(server.cli(&["script", "flush"]), "OK");
        }
        let now = clock.to(step_time(&mut rng, clock.sim, 1_000).min(clock.sim + 2_000));
        let c = check(&k, r, 1, true, 0);
        twin.decide(&[c], now, &|| format!("step {step} after SCRIPT FLUSH"))
            .await;
    }
}

/// Redis down when sluice starts: connect still succeeds, calls fail fast, and once Redis
/// is back (even restarted empty, without the script) calls succeed again.
#[tokio::test]
async fn starts_without_redis_and_recovers() {
    let mut server = RedisServer::start();
    server.kill();
    let started = Instant::now();
    let backend = connect(config::Backend::Redis(server.url()), ClockSource::Local).await;
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "connect blocked on a dead Redis"
    );
    let r = rule(Algorithm::FixedWindow, 5, 1_000, 5);
    let c = [check(&key("down", "p", &r), r, 1, true, 0)];
    let failed = tokio::time::timeout(Duration::from_secs(3), backend.decide(&c, wall_ms())).await;
    assert!(
        matches!(failed, Ok(Err(_)) | Err(_)),
        "a dead Redis decided: {failed:?}"
    );
    assert!(!backend.ping().await);

    server.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Ok(v)) =
            tokio::time::timeout(Duration::from_secs(1), backend.decide(&c, wall_ms())).await
        {
            assert!(v[0].allowed);
            break;
        }
        assert!(Instant::now() < deadline, "the backend did not reconnect");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(backend.ping().await);

    // A restart under a live connection: it reconnects and reloads the script by itself.
    server.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    while backend.decide(&c, wall_ms()).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "the backend did not recover from a restart"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The longest any state of `r` can need to live (ms), for requests of at most `max_cost`.
fn ttl_bound(r: &Rule, max_cost: u64) -> u64 {
    let per_unit = r.period_ms.div_ceil(r.limit);
    let delay = r.max_delay_ms.unwrap_or(0);
    match r.algorithm {
        Algorithm::FixedWindow | Algorithm::SlidingLog => r.period_ms,
        Algorithm::SlidingWindow => 2 * r.period_ms,
        Algorithm::TokenBucket | Algorithm::Gcra => r.burst * per_unit + delay + 1,
        Algorithm::LeakyBucket => (r.burst + max_cost) * per_unit + 1,
        Algorithm::Concurrency => r.lease_ms,
    }
}

/// Every key gets a TTL no longer than its state needs, and they all go away.
/// Uses `clock = "redis"` (scripts read TIME), so it also covers that path.
#[tokio::test]
async fn every_key_expires() {
    let server = RedisServer::start();
    let backend = connect(config::Backend::Redis(server.url()), ClockSource::Redis).await;
    let mut rng = Rng(3);
    let mut rules: Vec<Rule> = Algorithm::ALL
        .into_iter()
        .flat_map(|a| [rule(a, 5, 150, 3), rule(a, 3, 200, 5)])
        .collect();
    rules.push(delayed(rule(Algorithm::TokenBucket, 5, 200, 2), 100));
    rules.push(delayed(rule(Algorithm::Gcra, 5, 200, 2), 100));
    for r in &mut rules {
        r.lease_ms = 300;
    }
    const MAX_COST: u64 = 2;
    // Each key and the longest its state may live.
    let mut bounds: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
    for step in 0..300u64 {
        let mut checks: Vec<Check> = Vec::new();
        for j in 0..1 + rng.below(3) {
            let n = rng.below(rules.len() as u64) as usize;
            let r = rules[n];
            let k = key(&format!("leak{}", rng.below(4)), &format!("r{n}"), &r);
            if checks.iter().all(|c| c.key != k) {
                bounds.insert(k.clone(), ttl_bound(&r, MAX_COST));
                checks.push(check(
                    &k,
                    r,
                    rng.below(MAX_COST + 1),
                    rng.below(5) != 0,
                    step * 10 + j + 1,
                ));
            }
        }
        let verdicts = backend.decide(&checks, 0).await.expect("decide");
        for (c, v) in checks.iter().zip(&verdicts) {
            if c.rule.algorithm == Algorithm::Concurrency && v.allowed && rng.below(2) == 0 {
                backend.release(&c.key, c.lease).await.expect("release");
            }
        }
        if step % 50 == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let mut con = server.connection();
    let keys: Vec<String> = redis::cmd("KEYS").arg("t:*").query(&mut con).expect("KEYS");
    assert!(
        keys.len() > 20,
        "the workload left too few keys to judge: {keys:?}"
    );
    for k in &keys {
        // -1: no TTL (a leak); -2: expired since KEYS listed it; 0: expiring this millisecond.
        let ttl: i64 = redis::cmd("PTTL").arg(k).query(&mut con).expect("PTTL");
        assert!(ttl != -1, "{k} has no TTL");
        let bound = bounds[k.strip_suffix(":total").unwrap_or(k)];
        assert!(
            ttl <= bound as i64,
            "{k} lives {ttl} ms, longer than its state can need ({bound} ms)"
        );
    }
    let longest = bounds.values().copied().max().unwrap_or(0);
    let deadline = wall_ms() + longest + 2_000;
    loop {
        let left: Vec<String> = keys
            .iter()
            .filter(|k| {
                redis::cmd("EXISTS")
                    .arg(*k)
                    .query::<i64>(&mut con)
                    .expect("EXISTS")
                    == 1
            })
            .cloned()
            .collect();
        let scanned: Vec<String> = redis::cmd("KEYS").arg("t:*").query(&mut con).expect("KEYS");
        if left.is_empty() && scanned.is_empty() {
            break;
        }
        assert!(
            wall_ms() < deadline,
            "keys outlived their TTL: {left:?} {scanned:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `redis://user:password@host:port/db`: an ACL user limited to the key prefix, and a db.
#[tokio::test]
async fn acl_user_password_and_db_come_from_the_url() {
    let server = RedisServer::start_with(&["--requirepass", "admin-pw"]);
    let admin = ["-a", "admin-pw", "--no-auth-warning"];
    let setuser = [
        &admin[..],
        &[
            "acl",
            "setuser",
            "sluice",
            "on",
            ">sluice-pw",
            "~t:*",
            "+@all",
        ],
    ]
    .concat();
    assert_eq!(server.cli(&setuser), "OK");
    let url = format!("redis://sluice:sluice-pw@127.0.0.1:{}/2", server.port());
    let twin = Twin::new(connect(config::Backend::Redis(url), ClockSource::Local).await);
    let mut clock = TestClock::new();
    for algorithm in Algorithm::ALL {
        let r = rule(algorithm, 2, 1_000, 2);
        let k = key("acl", "p", &r);
        for step in 0..3 {
            let now = clock.to(clock.sim + 10);
            twin.decide(&[check(&k, r, 1, true, step + 1)], now, &|| {
                format!("{algorithm:?} {step}")
            })
            .await;
        }
        let scoped = twin.scoped(&k);
        let exists = [&admin[..], &["-n", "2", "exists", &scoped]].concat();
        assert_eq!(server.cli(&exists), "1", "{algorithm:?}: state is in db 2");
    }
}

/// Sentinel: the backend asks Sentinel for the master and decides there.
#[tokio::test]
async fn sentinel_finds_the_master() {
    let master = RedisServer::start();
    let sentinel = RedisSentinel::start(&master, "sluice-master");
    let backend = config::Backend::Sentinel {
        master: "sluice-master".into(),
        nodes: vec![sentinel.url()],
    };
    let twin = Twin::new(connect(backend, ClockSource::Local).await);
    let r = rule(Algorithm::Gcra, 3, 1_000, 2);
    let k = key("s", "p", &r);
    let mut clock = TestClock::new();
    for step in 0..10u64 {
        let now = clock.to(clock.sim + 150);
        twin.decide(&[check(&k, r, 1, true, 0)], now, &|| {
            format!("sentinel step {step}")
        })
        .await;
    }
    assert_eq!(
        master.cli(&["exists", &twin.scoped(&k)]),
        "1",
        "state lives on the master"
    );
}

/// A 3-master cluster: batches whose keys sit on different slots keep the all-or-nothing
/// rule, and when concurrent requests race between the read-only pass and the charge, the
/// charges of the losing requests are refunded exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_batches_across_slots_match_and_refund() {
    let cluster = RedisCluster::start();
    let seeds = cluster.seeds();
    let slot = |k: &str| cluster.cli(&["cluster", "keyslot", k]);
    let backend = Arc::new(connect(config::Backend::Cluster(seeds), ClockSource::Local).await);
    let twin = Twin::new(
        connect(
            config::Backend::Cluster(cluster.seeds()),
            ClockSource::Local,
        )
        .await,
    );

    // Sequential batches over three tags on three slots, compared call by call.
    let tags = ["alpha", "beta", "gamma"];
    let pool: Vec<(String, Rule)> = Algorithm::ALL
        .into_iter()
        .enumerate()
        .map(|(i, algorithm)| {
            let r = rule(algorithm, 2 + i as u64 % 4, 1_000, 3);
            (key(tags[i % 3], "p", &r), r)
        })
        .collect();
    let slots: std::collections::HashSet<String> = pool.iter().map(|(k, _)| slot(k)).collect();
    assert_eq!(
        slots.len(),
        3,
        "the test keys should spread over three slots"
    );
    let mut rng = Rng(11);
    let mut clock = TestClock::new();
    for step in 0..200u64 {
        let now = clock.to(step_time(&mut rng, clock.sim, 1_000).min(clock.sim + 3_000));
        let mut chosen: Vec<usize> = Vec::new();
        while chosen.len() < 3 {
            let i = rng.below(pool.len() as u64) as usize;
            if !chosen.contains(&i) {
                chosen.push(i);
            }
        }
        let checks: Vec<Check> = chosen
            .iter()
            .map(|&i| {
                check(
                    &pool[i].0,
                    pool[i].1,
                    u64::from(rng.below(6) != 0),
                    rng.below(5) != 0,
                    step * 10 + i as u64 + 1,
                )
            })
            .collect();
        let verdicts = twin
            .decide(&checks, now, &|| format!("cluster batch {step}"))
            .await;
        for (c, v) in checks.iter().zip(&verdicts) {
            if c.rule.algorithm == Algorithm::Concurrency && v.allowed {
                twin.release(&c.key, c.lease).await;
            }
        }
    }

    // Races: 48 requests at once against [wide on one slot, narrow (10) on another].
    // Exactly 10 pass; `wide` must then hold exactly 10 charges, whatever was refunded.
    for (n, algorithm) in Algorithm::ALL.into_iter().enumerate() {
        let wide = rule(algorithm, 100, 60_000, 100);
        let narrow = rule(Algorithm::FixedWindow, 10, 60_000, 10);
        let wide_key = key(&format!("race{n}"), "wide", &wide);
        let narrow_key = key(&format!("other{n}"), "narrow", &narrow);
        assert_ne!(slot(&wide_key), slot(&narrow_key));
        // A minute-long window that has just begun: nothing expires during the race.
        let begun = clock.now() / 60_000 * 60_000 + 61_000;
        let now = clock.to(begun);
        let handles: Vec<_> = (0..48u64)
            .map(|i| {
                let backend = backend.clone();
                let checks = vec![
                    check(&wide_key, wide, 1, true, 1_000 + i),
                    check(&narrow_key, narrow, 1, true, 0),
                ];
                tokio::spawn(
                    async move { backend.decide(&checks, now).await.expect("race decide") },
                )
            })
            .collect();
        let mut passed = 0;
        for handle in handles {
            let v = handle.await.expect("race task");
            if v.iter().all(|v| v.allowed) {
                passed += 1;
            }
        }
        assert_eq!(passed, 10, "{algorithm:?}: all or nothing across slots");
        let memory = MemoryBackend::new(1_000);
        for i in 0..10 {
            memory
                .decide(&[check(&wide_key, wide, 1, true, 5_000 + i)], now)
                .await
                .expect("memory");
        }
        let probe = [check(&wide_key, wide, 1, true, 9_999)];
        let want = memory.decide(&probe, now).await.expect("memory probe");
        let got = backend.decide(&probe, now).await.expect("redis probe");
        assert_eq!(
            got, want,
            "{algorithm:?}: charges left behind after the race"
        );
    }
}

fn banning(mut c: Check, ban_ms: u64) -> Check {
    c.ban_ms = ban_ms;
    c
}

/// Overrides change a check's numbers, never its key: one key decided with numbers that
/// change from call to call (tiers, a limit raised or lowered mid-window, delay mode on
/// and off) gives the same verdicts on both backends.
#[tokio::test]
async fn changing_numbers_on_one_key_match() {
    let server = RedisServer::start();
    let twin = Twin::new(connect(config::Backend::Redis(server.url()), ClockSource::Local).await);
    let mut rng = Rng(0x0e11);
    for algorithm in Algorithm::ALL {
        let mut tiers = vec![
            rule(algorithm, 3, 1_000, 3),
            rule(algorithm, 10, 1_000, 20),
            rule(algorithm, 20, 1_000, 20),
            rule(algorithm, 5, 1_000, 2),
        ];
        // One period for all tiers: a state stored under a shorter period expires earlier
        // (its TTL), and Redis expires keys by the wall clock, which the manual clock runs
        // ahead of; both backends expire it at the same real moment, but this test's clock
        // cannot show that.
        // A bucket's state expires when its units have drained at the limit it was written
        // with: one limit for all tiers (as one period above); bursts and delay mode change.
        if matches!(
            algorithm,
            Algorithm::TokenBucket | Algorithm::Gcra | Algorithm::LeakyBucket
        ) {
            tiers = vec![
                rule(algorithm, 3, 1_000, 3),
                rule(algorithm, 3, 1_000, 20),
                rule(algorithm, 3, 1_000, 2),
            ];
            if algorithm != Algorithm::LeakyBucket {
                tiers.push(delayed(rule(algorithm, 3, 1_000, 3), 500));
            }
        }
        for t in &mut tiers {
            t.lease_ms = 500;
        }
        let k = key("tiers", "p", &tiers[0]);
        let mut clock = TestClock::new();
        let mut held: Vec<u64> = Vec::new();
        for step in 0..400u64 {
            twin.fresh_keys_if_tainted();
            let r = tiers[rng.below(tiers.len() as u64) as usize];
            let now = clock.to(step_time(&mut rng, clock.sim, 1_000).min(clock.sim + 3_000));
            let cost = |rng: &mut Rng| step_cost(rng, 3).min(4);
            walk_step(&twin, &k, r, &mut rng, now, step, &mut held, cost).await;
        }
    }
}

/// A raised limit acts at once on the count so far: the same state, more room, on every
/// algorithm that counts (the buckets keep units used, not tokens or a time: #43 item 2).
#[tokio::test]
async fn a_raised_limit_admits_exactly_the_difference_at_once() {
    let server = RedisServer::start();
    let twin = Twin::new(connect(config::Backend::Redis(server.url()), ClockSource::Local).await);
    let mut clock = TestClock::new();
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::SlidingWindow,
        Algorithm::TokenBucket,
        Algorithm::Gcra,
        Algorithm::LeakyBucket,
    ] {
        // The buckets and the log keep their units under a longer period too (rescaled:
        // the Lua scripts' arithmetic is held to the memory backend's here).
        let windowed = matches!(algorithm, Algorithm::FixedWindow | Algorithm::SlidingWindow);
        let period = if windowed { 3_600_000 } else { 7_200_000 };
        let (low, high) = (
            rule(algorithm, 3, 3_600_000, 3),
            rule(algorithm, 5, period, 5),
        );
        let k = key("raise", "p", &low);
        let now = clock.now();
        let passed = twin
            .admitted_in_phases(&k, now, &[(low, 5), (high, 5), (low, 1)])
            .await;
        // 3 with the low limit, exactly the difference when raised, none when lowered (a
        // leaky_bucket queues one more than its burst).
        let first = if algorithm == Algorithm::LeakyBucket {
            4
        } else {
            3
        };
        assert_eq!(passed, [first, 2, 0], "{algorithm:?}");
    }
}

/// A longer period keeps a window's count: the minute's 3 count in the hour that holds
/// it, on both backends alike (#43 item 2).
#[tokio::test]
async fn a_longer_period_keeps_a_windows_count() {
    let server = RedisServer::start();
    let twin = Twin::new(connect(config::Backend::Redis(server.url()), ClockSource::Local).await);
    let mut clock = TestClock::new();
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindow] {
        let (minute, hour) = (
            rule(algorithm, 3, 60_000, 3),
            rule(algorithm, 5, 3_600_000, 5),
        );
        let k = key("longer", "p", &minute);
        let now = clock.now();
        let passed = twin
            .admitted_in_phases(&k, now, &[(minute, 4), (hour, 4)])
            .await;
        assert_eq!(passed, [3, 2], "{algorithm:?}");
    }
}

/// Bans: a key its policy rejects is rejected for `ban` without asking the algorithm (the
/// window may turn meanwhile), with the ban's rest as retry-after, then passes again; on
/// both backends alike, alone or in batches with shadow checks (which ban nobody).
#[tokio::test]
async fn bans_match() {
    let server = RedisServer::start();
    let twin = Twin::new(connect(config::Backend::Redis(server.url()), ClockSource::Local).await);
    let mut rng = Rng(0xba4);
    for algorithm in Algorithm::ALL {
        let mut r = rule(algorithm, 3, 500, 3);
        r.lease_ms = 400;
        let k = key("ban", "p", &r);
        let mut clock = TestClock::new();
        let mut banned = 0;
        for step in 0..250u64 {
            twin.fresh_keys_if_tainted();
            let now = clock.to(step_time(&mut rng, clock.sim, 500).min(clock.sim + 3_000));
            let cost = step_cost(&mut rng, 3);
            let c = banning(check(&k, r, cost, true, step + 1), 1_200);
            let v = twin
                .decide(std::slice::from_ref(&c), now, &|| {
                    format!("{r:?} step {step} now {now} cost {cost}")
                })
                .await;
            if v[0].banned {
                banned += 1;
                assert!(!v[0].allowed && v[0].retry_after_ms <= 1_200, "{v:?}");
            }
        }
        assert!(
            banned > 10,
            "{algorithm:?}: too few banned calls ({banned}) to judge"
        );
    }
    // Batches: banning enforce checks beside shadow checks and plain ones.
    let pool: Vec<(String, Rule, bool, u64)> = Algorithm::ALL
        .into_iter()
        .filter(|a| *a != Algorithm::Concurrency)
        .enumerate()
        .flat_map(|(i, a)| {
            let r = rule(a, 2, 1_000, 2);
            [
                (key(&format!("bb{i}"), "banning", &r), r, true, 2_000),
                (key(&format!("bb{i}"), "shadow", &r), r, false, 0),
                (key(&format!("bb{i}"), "plain", &r), r, true, 0),
            ]
        })
        .collect();
    let mut clock = TestClock::new();
    for step in 0..400u64 {
        let now = clock.to(step_time(&mut rng, clock.sim, 1_000).min(clock.sim + 2_000));
        let mut chosen: Vec<usize> = Vec::new();
        while chosen.len() < 1 + rng.below(3) as usize {
            let i = rng.below(pool.len() as u64) as usize;
            if !chosen.contains(&i) {
                chosen.push(i);
            }
        }
        let checks: Vec<Check> = chosen
            .iter()
            .map(|&i| {
                let (k, r, enforce, ban) = &pool[i];
                banning(check(k, *r, 1, *enforce, 0), *ban)
            })
            .collect();
        let verdicts = twin
            .decide(&checks, now, &|| format!("ban batch {step} now {now}"))
            .await;
        for (c, v) in checks.iter().zip(&verdicts) {
            assert!(c.ban_ms > 0 || !v.banned, "banned without a ban: {c:?}");
        }
    }
}

/// Ban keys expire with their ban: a TTL of exactly `ban`, none left after it.
#[tokio::test]
async fn ban_keys_expire_with_the_ban() {
    let server = RedisServer::start();
    let backend = connect(config::Backend::Redis(server.url()), ClockSource::Redis).await;
    let r = rule(Algorithm::Gcra, 1, 60_000, 1);
    let k = key("banttl", "p", &r);
    let c = banning(check(&k, r, 1, true, 0), 700);
    let verdicts: Vec<Verdict> = {
        let mut out = Vec::new();
        for _ in 0..3 {
            out.push(
                backend
                    .decide(std::slice::from_ref(&c), 0)
                    .await
                    .expect("decide")[0],
            );
        }
        out
    };
    assert!(verdicts[0].allowed);
    assert!(!verdicts[1].allowed && !verdicts[1].banned);
    assert!(verdicts[2].banned, "{verdicts:?}");
    let mut con = server.connection();
    let ttl: i64 = redis::cmd("PTTL")
        .arg(format!("{k}:ban"))
        .query(&mut con)
        .expect("PTTL");
    assert!(ttl > 0 && ttl <= 700, "ban key PTTL {ttl}");
    tokio::time::sleep(Duration::from_millis(800)).await;
    let left: i64 = redis::cmd("EXISTS")
        .arg(format!("{k}:ban"))
        .query(&mut con)
        .expect("EXISTS");
    assert_eq!(left, 0, "the ban key outlived its ban");
    // The ban is over; the gcra state (a minute) still denies, but as the algorithm.
    let v = backend
        .decide(std::slice::from_ref(&c), 0)
        .await
        .expect("decide")[0];
    assert!(!v.allowed && !v.banned, "{v:?}");
}

/// Across cluster slots a denial is found by a peek: the ban is set all the same, and
/// both backends agree call by call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_bans_across_slots_match() {
    let cluster = RedisCluster::start();
    let twin = Twin::new(
        connect(
            config::Backend::Cluster(cluster.seeds()),
            ClockSource::Local,
        )
        .await,
    );
    let r = rule(Algorithm::FixedWindow, 2, 1_000, 2);
    let (a, b) = (key("alpha", "ban", &r), key("beta", "plain", &r));
    assert_ne!(
        cluster.cli(&["cluster", "keyslot", &a]),
        cluster.cli(&["cluster", "keyslot", &b])
    );
    let checks = [
        banning(check(&a, r, 1, true, 0), 1_500),
        check(
            &b,
            rule(Algorithm::FixedWindow, 100, 1_000, 100),
            1,
            true,
            0,
        ),
    ];
    let mut clock = TestClock::new();
    let mut banned = 0;
    for step in 0..40u64 {
        let now = clock.to(clock.sim + 100);
        let v = twin
            .decide(&checks, now, &|| {
                format!("cluster ban step {step} now {now}")
            })
            .await;
        banned += usize::from(v[0].banned);
    }
    assert!(banned > 5, "the ban never held across slots ({banned})");
}

/// DESIGN §11 on both backends, through the limiter layer: `max_failures` bans an address
/// at the same invalid credential (the `limit`-th), for the same time, and a policy keyed on
/// the consumer with `on_missing = "client_ip"` counts verified consumers by name and
/// anonymous clients by address alike.
#[tokio::test]
async fn auth_failure_bans_and_consumer_keys_match() {
    use sluice::auth::Identity;
    use sluice::clock::ManualClock;
    use sluice::key::RequestFacts;
    use sluice::limiter::Limiter;
    use sluice::metrics::Metrics;

    let server = RedisServer::start();
    let config = |backend: &str| {
        let text = format!(
            "[server]\nlisten = [\"127.0.0.1:8080\"]\n[limiter]\n{backend}\nclock = \"local\"\n\
             deny_cache = 0\n[auth]\nmax_failures = {{ limit = 3, period = \"1m\", ban = \"30s\" }}\n\
             [policies.per_consumer]\nalgorithm = \"fixed_window\"\nlimit = 2\nperiod = \"1m\"\n\
             key = [\"consumer\"]\non_missing = \"client_ip\"\n[[routes]]\nname = \"r\"\n\
             auth = \"optional\"\nrespond = {{ status = 200 }}\npolicies = [\"per_consumer\"]\n"
        );
        sluice::config::parse("t.toml", &text).unwrap_or_else(|e| panic!("{e}"))
    };
    let memory = config("backend = \"memory\"");
    let redis = config(&format!("backend = \"redis\"\nurl = \"{}\"", server.url()));
    let start = wall_ms();
    let mut outcomes: Vec<Vec<String>> = Vec::new();
    for cfg in [&memory, &redis] {
        let clock = Arc::new(ManualClock::new(start));
        let limiter = Limiter::new(cfg, None, &[], clock.clone(), Arc::new(Metrics::new()))
            .await
            .expect("limiter");
        let failures = cfg
            .policies
            .iter()
            .position(|p| p.name == "auth_failures")
            .expect("max_failures adds its policy");
        let headers = http::HeaderMap::new();
        let acme = Identity {
            consumer: Some("acme".into()),
            plan: Some("free".into()),
            claims: None,
        };
        let anonymous = Identity::anonymous();
        let facts = |ip: &str, identity| RequestFacts {
            client_ip: ip.parse().expect("test IP"),
            method: "GET",
            host: "",
            path: "/",
            query: None,
            headers: &headers,
            route: "r",
            client_cert: None,
            identity,
            request_bound: None,
        };
        let mut seen = Vec::new();
        // Three invalid credentials from one address: the third bans it.
        for i in 0..4 {
            clock.set(start + i * 10);
            let ban = limiter
                .auth_failed(&cfg.policies, failures, &facts("203.0.113.9", &anonymous))
                .await;
            seen.push(format!("failure {i}: ban {ban:?}"));
        }
        // The same address is refused before any credential; another is not.
        let banned =
            |ip: &str| limiter.auth_banned(&cfg.policies[failures], ip.parse().expect("IP"));
        seen.push(format!("banned: {}", banned("203.0.113.9").is_some()));
        seen.push(format!(
            "other banned: {}",
            banned("203.0.113.10").is_some()
        ));
        // Two per consumer, two per anonymous address, each counted apart.
        for (ip, identity) in [
            ("198.51.100.1", &acme),
            ("198.51.100.2", &acme),
            ("198.51.100.1", &anonymous),
            ("198.51.100.1", &acme),
            ("198.51.100.1", &anonymous),
            ("198.51.100.2", &anonymous),
            ("198.51.100.1", &anonymous),
        ] {
            let outcome = limiter
                .decide(0, &cfg.policies, &[0], &facts(ip, identity))
                .await;
            let v = outcome.policies[0].verdict.expect("decided");
            seen.push(format!(
                "{ip} {:?}: {} {}",
                identity.consumer, v.allowed, v.remaining
            ));
        }
        outcomes.push(seen);
    }
    assert_eq!(outcomes[0], outcomes[1], "memory and Redis differ");
    let seen = &outcomes[0];
    // The ban comes with the limit-th failure and lasts 30 s.
    assert_eq!(seen[0], "failure 0: ban None");
    assert_eq!(seen[1], "failure 1: ban None");
    assert!(seen[2].starts_with("failure 2: ban Some("), "{seen:?}");
    assert_eq!(seen[4], "banned: true");
    assert_eq!(seen[5], "other banned: false");
    let allowed: Vec<bool> = seen[6..].iter().map(|s| s.contains(": true ")).collect();
    assert_eq!(
        allowed,
        [true, true, true, false, true, true, false],
        "{seen:?}"
    );
}

/// A fixed window whose period a reload or a live override lengthens, where the new window
/// starts where the old one did: the key keeps counting, and its TTL moves to the new
/// window's end. A write that kept the key's TTL (`SET … KEEPTTL`, cheaper) would let it
/// expire at the old window's end and count from 0 again: over the limit.
#[tokio::test]
async fn a_lengthened_window_keeps_its_count_until_its_own_end() {
    let server = RedisServer::start();
    let redis = connect(config::Backend::Redis(server.url()), ClockSource::Local).await;
    // One second into an hour: the windows of 1 min and of 1 h both start at the hour.
    let hour = 3_600_000;
    let at = (wall_ms() / hour + 1) * hour + 1_000;
    let (short, long) = (
        rule(Algorithm::FixedWindow, 10, 60_000, 10),
        rule(Algorithm::FixedWindow, 10, hour, 10),
    );
    let k = key("lengthened", "p", &short);
    for (r, now) in [(short, at), (long, at + 1)] {
        let v = redis
            .decide(&[check(&k, r, 4, true, 0)], now)
            .await
            .expect("decided");
        assert!(v[0].allowed, "{v:?}");
    }
    let v = redis
        .decide(&[check(&k, long, 4, true, 0)], at + 2)
        .await
        .expect("decided");
    assert!(
        !v[0].allowed,
        "8 of 10 counted, 4 more must be refused: {v:?}"
    );
    let ttl: u64 = server.cli(&["PTTL", &k]).trim().parse().expect("a TTL");
    assert!(
        ttl > 60_000,
        "the key must live to the 1 h window's end, not the 1 min one's: PTTL {ttl}"
    );
}

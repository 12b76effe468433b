//! The limiter's Lua code: its text, how it is called, and the KEYS/ARGV and reply of one call.
//!
//! Assembly: `lua/` keeps one file per algorithm. The text is `common.lua` (the
//! conventions and the call's state), the algorithm files (each defines one `local`
//! function named after its algorithm that decides, charges or refunds one check), a
//! generated line naming them (`ALGORITHM` and `NAME` when there is one, else an
//! `ALGORITHMS` table), and last `decide.lua`, which defines `decide(keys, argv)`: it parses
//! ARGV and runs the checks all or nothing. Every file opens with its contract;
//! `decide.lua`'s is the one a caller sees.
//!
//! Two forms of it (DESIGN §18, issue #42):
//! - The function library (Redis 7 and later): every algorithm, `decide` registered as
//!   function `sluice_<hash>` by `FUNCTION LOAD`, called by `FCALL`. Its top level runs
//!   once, at load: no closure or table is built again per call, and parsed rules stay
//!   cached between calls. The name carries the hash of the text, so instances of two
//!   versions each call their own. A server without it ("Function not found": restarted
//!   without persistence, flushed, a failover to a node that never had it) gets it loaded
//!   again, and the call is retried once.
//! - The script (EVALSHA; NOSCRIPT loads it, as redis-rs does): the same text ending in
//!   `return decide(KEYS, ARGV)`, one per set of algorithms (a script's top level runs on
//!   every call, so it defines only what its call can use; at most 2^7 sets, each built and
//!   hashed on first use). sluice falls back to it, for the rest of the process, when the
//!   server has no functions (Redis < 7 answers FCALL or FUNCTION with "unknown command")
//!   or refuses them to sluice's user (NOPERM), and logs that once.
//!
//! `bench/lua_cost.sh` builds both texts as these functions do; `bench/lua_zipf.py`
//! measures the server CPU of each.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use redis::aio::ConnectionLike;
use redis::{FromRedisValue, RedisError, RedisResult, Script, ScriptInvocation, ToRedisArgs};

use crate::auth::consumers::{Changed, ConsumerChange, RuntimeConsumer};
use crate::config::Algorithm;
use crate::limiter::algorithm::Verdict;
use crate::limiter::backend::{Adjustment, BackendError, Check};

const COMMON: &str = include_str!("../../../lua/common.lua");
const ENTRY: &str = include_str!("../../../lua/decide.lua");

/// Each algorithm's file, in `Algorithm::ALL` order.
const FILES: [&str; 7] = [
    include_str!("../../../lua/fixed_window.lua"),
    include_str!("../../../lua/sliding_window.lua"),
    include_str!("../../../lua/sliding_log.lua"),
    include_str!("../../../lua/token_bucket.lua"),
    include_str!("../../../lua/gcra.lua"),
    include_str!("../../../lua/leaky_bucket.lua"),
    include_str!("../../../lua/concurrency.lua"),
];

/// A set of algorithms as bits in `Algorithm::ALL` order.
type AlgorithmSet = usize;
const EVERY_ALGORITHM: AlgorithmSet = (1 << FILES.len()) - 1;

fn bit(algorithm: Algorithm) -> AlgorithmSet {
    1 << Algorithm::ALL
        .iter()
        .position(|a| *a == algorithm)
        .unwrap_or(0)
}

/// The text for the algorithms in `set` up to and with `decide.lua` (which defines
/// `decide(keys, argv)` and calls nothing).
fn body(set: AlgorithmSet) -> String {
    // leaky_bucket uses the arithmetic that gcra.lua defines.
    let files = if set & bit(Algorithm::LeakyBucket) != 0 {
        set | bit(Algorithm::Gcra)
    } else {
        set
    };
    let mut text = String::with_capacity(24 * 1024);
    text.push_str(COMMON);
    for (i, file) in FILES.iter().enumerate() {
        if files & (1 << i) != 0 {
            text.push('\n');
            text.push_str(file);
        }
    }
    let names: Vec<&str> = Algorithm::ALL
        .iter()
        .enumerate()
        .filter(|(i, _)| set & (1 << i) != 0)
        .map(|(_, algorithm)| algorithm.name())
        .collect();
    // One algorithm (most calls): no table, built again on every call, to look it up.
    text.push_str("\nlocal ALGORITHM, NAME, ALGORITHMS = ");
    if let [name] = names[..] {
        text.push_str(&format!("{name}, '{name}', nil\n"));
    } else {
        text.push_str("nil, nil, {");
        for name in names {
            text.push_str(&format!(" {name} = {name},"));
        }
        text.push_str(" }\n");
    }
    text.push_str(ENTRY);
    text
}

/// The script text for the algorithms in `set`.
fn source(set: AlgorithmSet) -> String {
    let mut text = body(set);
    text.push_str("\nreturn decide(KEYS, ARGV)\n");
    text
}

/// The function library (every algorithm) and its function's name, `sluice_` and the
/// first 16 hex digits of the SHA-1 of its body, which also names the library.
fn library() -> &'static (String, String) {
    static LIBRARY: OnceLock<(String, String)> = OnceLock::new();
    LIBRARY.get_or_init(|| {
        let body = body(EVERY_ALGORITHM);
        let name = format!("sluice_{}", &Script::new(&body).get_hash()[..16]);
        let text =
            format!("#!lua name={name}\n{body}\nredis.register_function('{name}', decide)\n");
        (text, name)
    })
}

/// Whether calls go by FCALL: until a server shows it has no functions for sluice.
static FUNCTIONS: AtomicBool = AtomicBool::new(true);

/// Whether `e` says the server has no such command (Redis < 7) or refuses it to the user.
fn unsupported(e: &RedisError) -> bool {
    let text = e.to_string().to_ascii_lowercase();
    text.contains("unknown command") || text.contains("noperm")
}

/// Calls go by EVALSHA from now on.
fn without_functions(e: &RedisError) {
    if FUNCTIONS.swap(false, Ordering::Relaxed) {
        log::warn!(
            "redis limiter: the server runs no Redis functions for sluice ({e}); deciding by \
             EVALSHA instead, which costs the server more CPU per decision (Redis 7 or later \
             with FUNCTION and FCALL allowed avoids it)"
        );
    }
}

/// Loads the function library (on every master of a cluster: redis-rs sends FUNCTION
/// LOAD to all), replacing one of the same name and text.
async fn load_library(conn: &mut impl ConnectionLike) -> RedisResult<()> {
    redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(&library().0)
        .query_async::<redis::Value>(conn)
        .await
        .map(|_| ())
}

/// Loads what decisions call: the function library, or where the server has no functions,
/// the script that holds every algorithm (either way, checks the server takes it).
pub(crate) async fn load(conn: &mut impl ConnectionLike) -> RedisResult<()> {
    if FUNCTIONS.load(Ordering::Relaxed) {
        match load_library(conn).await {
            Err(e) if unsupported(&e) => without_functions(&e),
            other => return other,
        }
    }
    full_script().load_async(conn).await.map(|_| ())
}

/// One call of `decide.lua`: its keys and arguments, sent by FCALL or EVALSHA.
#[derive(Debug, Default)]
pub(crate) struct Call {
    /// The algorithms its checks use (which script, for EVALSHA).
    set: AlgorithmSet,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl Call {
    fn new(set: AlgorithmSet) -> Call {
        Call {
            set,
            ..Call::default()
        }
    }

    fn key(&mut self, key: impl ToRedisArgs) -> &mut Call {
        self.keys.extend(key.to_redis_args());
        self
    }

    fn arg(&mut self, arg: impl ToRedisArgs) -> &mut Call {
        self.args.extend(arg.to_redis_args());
        self
    }

    /// Runs the call: FCALL, loading the library first where the server lacks it, or
    /// EVALSHA where the server has no functions.
    pub(crate) async fn invoke<T: FromRedisValue>(
        &self,
        conn: &mut impl ConnectionLike,
    ) -> RedisResult<T> {
        if FUNCTIONS.load(Ordering::Relaxed) {
            match self.fcall().query_async(conn).await {
                Err(e) if e.to_string().contains("Function not found") => {
                    match load_library(conn).await {
                        Ok(()) => return self.fcall().query_async(conn).await,
                        Err(e) if unsupported(&e) => without_functions(&e),
                        Err(e) => return Err(e),
                    }
                }
                Err(e) if unsupported(&e) => without_functions(&e),
                result => return result,
            }
        }
        let mut call = script(self.set).prepare_invoke();
        call.key(&self.keys).arg(&self.args);
        call.invoke_async(conn).await
    }

    fn fcall(&self) -> redis::Cmd {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(&library().1)
            .arg(self.keys.len())
            .arg(&self.keys)
            .arg(&self.args);
        cmd
    }
}

/// The script for the algorithms in `set`, built and hashed once.
fn script(set: AlgorithmSet) -> &'static Script {
    static SCRIPTS: [OnceLock<Script>; EVERY_ALGORITHM + 1] =
        [const { OnceLock::new() }; EVERY_ALGORITHM + 1];
    SCRIPTS[set & EVERY_ALGORITHM].get_or_init(|| Script::new(&source(set)))
}

/// The script that holds every algorithm: loaded at connect, where the server has no
/// functions, to check it takes it.
fn full_script() -> &'static Script {
    script(EVERY_ALGORITHM)
}

/// Reply integers per check, after `now`: allowed (1, 0, or 2 for banned), remaining,
/// reset_ms, and delay_ms (the wait when allowed, the retry-after when denied).
const REPLY_FIELDS: usize = 4;

/// A call's reply of integers: an array of them, or (decide, peek, batch) one string of
/// them packed big-endian, eight bytes each (cheaper for Redis to write and for redis-rs to
/// read than array elements).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Integers(pub Vec<i64>);

impl redis::FromRedisValue for Integers {
    fn from_redis_value(value: redis::Value) -> Result<Self, redis::ParsingError> {
        let redis::Value::BulkString(bytes) = value else {
            return Vec::from_redis_value(value).map(Integers);
        };
        if bytes.len() % 8 != 0 {
            return Err(format!("a packed reply of {} bytes", bytes.len()).into());
        }
        let integer = |b: &[u8]| {
            let mut be = [0; 8];
            be.copy_from_slice(b);
            i64::from_be_bytes(be)
        };
        Ok(Integers(bytes.chunks_exact(8).map(integer).collect()))
    }
}

/// What one call does with its checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Evaluate all, charge all that allowed if every enforce check allowed.
    Decide,
    /// Evaluate only.
    Peek,
}

/// A `Decide` or `Peek` reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reply {
    /// The time the script decided at (Redis TIME, or the `now` it was given).
    pub now: u64,
    /// Whether the checks that allowed were charged.
    pub charged: bool,
    pub verdicts: Vec<Verdict>,
}

/// One call for `checks`: ARGV is the mode (for a decide, with each check's enforce flag),
/// now, then two fields per check, its rule and its cost (see `lua/decide.lua`). `now` is
/// `None` when the script should read Redis TIME.
pub(crate) fn invocation<'c>(
    mode: Mode,
    checks: impl IntoIterator<Item = &'c Check>,
    now: Option<u64>,
) -> Call {
    let checks: Vec<&Check> = checks.into_iter().collect();
    let mut call = Call::new(checks.iter().fold(0, |set, c| set | bit(c.rule.algorithm)));
    // Checks that ban (enforced, `ban_ms` > 0) take flag "2", their ban key after every
    // state key, and their `ban_ms` after every check's fields.
    let banning = checks.iter().any(|c| bans(c));
    match mode {
        Mode::Decide => call.arg(flags("decide", &checks)),
        Mode::Peek if !banning => call.arg("peek"),
        Mode::Peek => call.arg(flags("peek", &checks)),
    };
    call.arg(now.map(|n| n.to_string()).unwrap_or_default());
    push_checks(&mut call, &checks, banning, now);
    call
}

/// One "adjust" call settling `adjustments` (`now` as for `invocation`): ARGV is "adjust",
/// now, then per adjustment its check's rule, the amount and the time of the charge it
/// adjusts. The reply is `{now}`.
pub(crate) fn adjust_invocation<'a>(
    adjustments: impl IntoIterator<Item = &'a Adjustment>,
    now: Option<u64>,
) -> Call {
    let adjustments: Vec<&Adjustment> = adjustments.into_iter().collect();
    let set = adjustments
        .iter()
        .fold(0, |set, a| set | bit(a.check.rule.algorithm));
    let mut call = Call::new(set);
    call.arg("adjust")
        .arg(now.map(|n| n.to_string()).unwrap_or_default());
    for adjustment in adjustments {
        // A refund's calendar window is that of its charge.
        let of = (adjustment.amount < 0).then_some(adjustment.charged_at);
        call.key(&adjustment.check.key)
            .arg(rule_text(&adjustment.check, now, of))
            .arg(adjustment.amount)
            .arg(adjustment.charged_at);
    }
    call
}

/// One request's checks and its `now` (as for `invocation`), in a batch.
pub(crate) type Request<'c> = (&'c [Check], Option<u64>);

/// One call deciding several requests in order, each all or nothing exactly as its own
/// `invocation(Mode::Decide, ..)` would: ARGV is "batch", then "" when the script should
/// read TIME (once, for all) or "each" when every request brings its `now` (all or none
/// do), then per request its decide mode, its now with "each", its fields and its bans;
/// after a request, "=" and a count N when the N requests after it send the same mode,
/// fields and bans (only their keys, and with "each" their nows, which follow, are theirs).
/// KEYS are each request's keys then its ban keys, request after request.
pub(crate) fn batch_invocation(requests: &[Request<'_>]) -> Call {
    let set = requests
        .iter()
        .flat_map(|(checks, _)| checks.iter())
        .fold(0, |set, c| set | bit(c.rule.algorithm));
    let mut call = Call::new(set);
    let each = requests.iter().any(|(_, now)| now.is_some());
    call.arg("batch").arg(if each { "each" } else { "" });
    let mut at = 0;
    while at < requests.len() {
        let (checks, now) = requests[at];
        let run = requests[at + 1..]
            .iter()
            .take_while(|(next, _)| same_fields(next, checks))
            .count();
        let refs: Vec<&Check> = checks.iter().collect();
        call.arg(flags("decide", &refs));
        if each {
            call.arg(now.unwrap_or_default());
        }
        push_checks(&mut call, &refs, true, now);
        if run > 0 {
            call.arg("=").arg(run);
            for &(checks, now) in &requests[at + 1..=at + run] {
                if each {
                    call.arg(now.unwrap_or_default());
                }
                push_keys(&mut call, checks);
            }
        }
        at += 1 + run;
    }
    call
}

/// A "=" request's keys: its checks', then the ban keys of those that ban.
fn push_keys(call: &mut Call, checks: &[Check]) {
    for check in checks {
        call.key(&check.key);
    }
    for check in checks.iter().filter(|c| bans(c)) {
        call.key(ban_key(&check.key));
    }
}

/// Whether checks `a` send the same mode, fields and bans as checks `b` (their keys aside).
fn same_fields(a: &[Check], b: &[Check]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(a, b)| {
            (a.rule, a.cost, a.enforce, a.lease, a.ban_ms)
                == (b.rule, b.cost, b.enforce, b.lease, b.ban_ms)
                // A calendar check's fields hold its request's time (`rule_text`).
                && a.rule.calendar.is_none()
        })
}

/// `mode` then each check's flag: "2" enforced and banning, "1" enforced, "0" a shadow.
fn flags(mode: &str, checks: &[&Check]) -> String {
    let mut text = String::with_capacity(mode.len() + checks.len());
    text.push_str(mode);
    text.extend(checks.iter().map(|c| match (c.enforce, bans(c)) {
        (true, true) => '2',
        (true, false) => '1',
        _ => '0',
    }));
    text
}

/// A check's rule as one argument, its five fields separated by spaces: algorithm, limit,
/// period, burst, max_delay ("" when requests over the limit are rejected). The library
/// parses each text once and keeps it (`lua/decide.lua`).
///
/// Concurrency sends lease_ms and the lease id in the places of burst and max_delay. A
/// calendar fixed_window (DESIGN §20) sends instead, in the places of period, burst and
/// max_delay: minus the length of its window, the window's start, and the proxy's time
/// (`now`, or the system clock's when the script reads TIME), which the script decides it
/// at; the window is the one that time falls in, or `of` (a refund's charge).
fn rule_text(check: &Check, now: Option<u64>, of: Option<u64>) -> String {
    let rule = &check.rule;
    let name = rule.algorithm.name();
    if let Some(calendar) = rule.calendar {
        let now = now.unwrap_or_else(crate::clock::unix_ms);
        let (start, end) = crate::limiter::calendar::window(calendar, of.unwrap_or(now));
        return format!("{name} {} -{} {start} {now}", rule.limit, end - start);
    }
    if rule.algorithm == Algorithm::Concurrency {
        return format!(
            "{name} {} {} {} {}",
            rule.limit, rule.period_ms, rule.lease_ms, check.lease
        );
    }
    let max_delay = rule.max_delay_ms.map(|d| d.to_string()).unwrap_or_default();
    format!(
        "{name} {} {} {} {max_delay}",
        rule.limit, rule.period_ms, rule.burst
    )
}

/// Every check's key, rule and cost; with `banning`, then the ban key and the ban of every
/// check that bans.
fn push_checks(call: &mut Call, checks: &[&Check], banning: bool, now: Option<u64>) {
    for check in checks {
        call.key(&check.key)
            .arg(rule_text(check, now, None))
            .arg(check.cost);
    }
    if banning {
        for check in checks.iter().filter(|c| bans(c)) {
            call.key(ban_key(&check.key)).arg(check.ban_ms);
        }
    }
}

/// Whether `check` bans its key when denied.
fn bans(check: &Check) -> bool {
    check.enforce && check.ban_ms > 0
}

/// Where the ban of the key `key` lives: next to its state, in the same cluster slot.
pub(crate) fn ban_key(key: &str) -> String {
    format!("{key}:ban")
}

/// Frees concurrency lease `lease` under `key`.
pub(crate) fn release_invocation(key: &str, lease: u64) -> Call {
    let mut call = Call::new(bit(Algorithm::Concurrency));
    call.key(key).arg("release").arg("").arg(lease);
    call
}

/// Makes concurrency lease `lease` under `key`, if still live, expire `lease_ms` after now
/// (`now` as for `invocation`). The reply is `{now, 1}` if the lease was live, else
/// `{now, 0}`.
pub(crate) fn renew_invocation(key: &str, lease: u64, lease_ms: u64, now: Option<u64>) -> Call {
    let mut call = Call::new(bit(Algorithm::Concurrency));
    call.key(key)
        .arg("renew")
        .arg(now.map(|n| n.to_string()).unwrap_or_default())
        .arg(lease)
        .arg(lease_ms);
    call
}

/// `lua/prefetch.lua` for `algorithm`: common.lua, the algorithm's file, the line naming
/// it, then the entry point that takes units ahead (DESIGN §19). Built and hashed once.
fn prefetch_script(algorithm: Algorithm) -> &'static Script {
    static SCRIPTS: [OnceLock<Script>; FILES.len()] = [const { OnceLock::new() }; FILES.len()];
    let at = Algorithm::ALL
        .iter()
        .position(|a| *a == algorithm)
        .unwrap_or(0);
    SCRIPTS[at].get_or_init(|| {
        let name = algorithm.name();
        Script::new(&format!(
            "{COMMON}\n{}\nlocal ALGORITHM, NAME, ALGORITHMS = {name}, '{name}', nil\n{}",
            FILES[at],
            include_str!("../../../lua/prefetch.lua")
        ))
    })
}

/// One "prefetch" call (`lua/prefetch.lua`) for `check`'s key: take up to `want` units
/// (at least `check.cost`), giving back `back` units of the take made at `back_at`. `now`
/// as for `invocation`. The reply is `{now, granted, remaining, reset_ms, delay_ms,
/// returned}`.
pub(crate) fn prefetch_invocation(
    check: &Check,
    want: u64,
    back: u64,
    back_at: u64,
    now: Option<u64>,
) -> ScriptInvocation<'static> {
    let mut call = prefetch_script(check.rule.algorithm).prepare_invoke();
    call.arg("prefetch")
        .arg(now.map(|n| n.to_string()).unwrap_or_default());
    let rule = &check.rule;
    call.key(&check.key)
        .arg(rule.algorithm.name())
        .arg(rule.limit)
        .arg(rule.period_ms)
        .arg(rule.burst)
        .arg("");
    if bans(check) {
        call.key(ban_key(&check.key));
    }
    call.arg(want.max(check.cost))
        .arg(check.cost)
        .arg(back)
        .arg(back_at);
    call
}

/// `lua/consumer.lua`: one change to the runtime consumers, a compare-and-set because Redis
/// runs it whole. A script of its own, loaded on first use: it shares nothing with the
/// limiter's.
fn consumer_script() -> &'static Script {
    static SCRIPT: OnceLock<Script> = OnceLock::new();
    SCRIPT.get_or_init(|| Script::new(include_str!("../../../lua/consumer.lua")))
}

/// Makes `change` to the runtime consumers in the hash `hash`; the reply is read by
/// `decode_consumer`.
pub(crate) fn consumer_invocation(
    hash: &str,
    change: &ConsumerChange,
) -> ScriptInvocation<'static> {
    let mut call = consumer_script().prepare_invoke();
    call.key(hash);
    match change {
        ConsumerChange::Put { name, plan } => {
            call.arg("put").arg(name).arg(plan.as_deref().unwrap_or(""));
        }
        ConsumerChange::Delete { name } => {
            call.arg("delete").arg(name);
        }
        ConsumerChange::AddKey { name, key } => {
            call.arg("add_key").arg(name).arg(&key.id).arg(&key.digest);
        }
        ConsumerChange::RevokeKey { name, id } => {
            call.arg("revoke_key").arg(name).arg(id);
        }
    }
    call
}

/// Reads `lua/consumer.lua`'s reply `{status, consumer}`.
pub(crate) fn decode_consumer(status: i64, consumer: &str) -> Result<Changed, BackendError> {
    match status {
        1 if consumer.is_empty() => Ok(Changed::Done(None)),
        1 => serde_json::from_str::<RuntimeConsumer>(consumer)
            .map(|c| Changed::Done(Some(c)))
            .map_err(|e| BackendError::Script(format!("consumer.lua wrote {consumer:?}: {e}"))),
        0 => Ok(Changed::NoConsumer),
        2 => Ok(Changed::NoKey),
        other => Err(BackendError::Script(format!(
            "consumer.lua: unknown status {other}"
        ))),
    }
}

/// Reads the reply of a `mode` call (`Decide` or `Peek`) for checks with these enforce
/// flags, in the order they were passed.
pub(crate) fn decode(reply: &[i64], mode: Mode, enforce: &[bool]) -> Result<Reply, BackendError> {
    let checks = enforce.len();
    expect_len(reply, checks)?;
    let verdicts = verdicts(&reply[1..])?;
    // The script charges exactly when this holds.
    let charged = mode == Mode::Decide
        && verdicts
            .iter()
            .zip(enforce)
            .all(|(v, enforce)| v.allowed || !enforce);
    Ok(Reply {
        now: whole(reply[0])?,
        charged,
        verdicts,
    })
}

/// Reads the reply of a `batch_invocation`: each request's verdicts, for requests of
/// `sizes` checks each, in order.
pub(crate) fn decode_batch(
    reply: &[i64],
    sizes: impl ExactSizeIterator<Item = usize> + Clone,
) -> Result<Vec<Vec<Verdict>>, BackendError> {
    expect_len(reply, sizes.clone().sum())?;
    let mut rest = &reply[1..];
    let mut requests = Vec::with_capacity(sizes.len());
    for size in sizes {
        let (mine, after) = rest.split_at(REPLY_FIELDS * size);
        requests.push(verdicts(mine)?);
        rest = after;
    }
    Ok(requests)
}

/// A reply's length: `now`, then `REPLY_FIELDS` per check.
fn expect_len(reply: &[i64], checks: usize) -> Result<(), BackendError> {
    if reply.len() == 1 + REPLY_FIELDS * checks {
        return Ok(());
    }
    Err(BackendError::Script(format!(
        "expected {} integers for {checks} checks, got {}",
        1 + REPLY_FIELDS * checks,
        reply.len()
    )))
}

fn whole(n: i64) -> Result<u64, BackendError> {
    u64::try_from(n).map_err(|_| BackendError::Script(format!("negative value {n} in reply")))
}

/// The verdicts of `REPLY_FIELDS` integers each.
fn verdicts(fields: &[i64]) -> Result<Vec<Verdict>, BackendError> {
    fields
        .chunks_exact(REPLY_FIELDS)
        .map(|v| {
            // 1: allowed; 0: denied; 2: denied by a standing ban.
            let (allowed, delay) = (v[0] == 1, whole(v[3])?);
            Ok(Verdict {
                allowed,
                remaining: whole(v[1])?,
                reset_ms: whole(v[2])?,
                retry_after_ms: if allowed { 0 } else { delay },
                wait_ms: if allowed { delay } else { 0 },
                banned: v[0] == 2,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Algorithm;
    use crate::limiter::algorithm::Rule;

    #[test]
    fn consumer_replies_read_as_the_change_came_out() {
        let json = r#"{"name":"acme","plan":null,"keys":[{"id":"k1","digest":"ab"}]}"#;
        let Ok(Changed::Done(Some(c))) = decode_consumer(1, json) else {
            panic!("a consumer")
        };
        assert_eq!((c.name.as_str(), c.plan, c.keys.len()), ("acme", None, 1));
        // cjson would write an empty list as `{}`: the script writes `[]` itself.
        let empty = r#"{"name":"acme","plan":"gold","keys":[]}"#;
        assert!(matches!(
            decode_consumer(1, empty),
            Ok(Changed::Done(Some(_)))
        ));
        assert_eq!(decode_consumer(1, ""), Ok(Changed::Done(None)));
        assert_eq!(decode_consumer(0, ""), Ok(Changed::NoConsumer));
        assert_eq!(decode_consumer(2, ""), Ok(Changed::NoKey));
        assert!(decode_consumer(3, "").is_err());
        assert!(decode_consumer(1, "{}").is_err());
    }

    #[test]
    fn a_script_holds_exactly_the_algorithms_of_its_set() {
        let all = source(EVERY_ALGORITHM);
        // How each algorithm file defines its algorithm.
        let defines = |algorithm: Algorithm| match algorithm {
            Algorithm::LeakyBucket => "local leaky_bucket = gcra".to_owned(),
            _ => format!("local function {}(", algorithm.name()),
        };
        for algorithm in Algorithm::ALL {
            assert!(all.contains(&defines(algorithm)), "{algorithm:?}");
            let one = source(bit(algorithm));
            assert!(
                one.contains(&format!(
                    "local ALGORITHM, NAME, ALGORITHMS = {0}, '{0}', nil\n",
                    algorithm.name()
                )),
                "{algorithm:?}"
            );
            let others = Algorithm::ALL.iter().filter(|a| **a != algorithm);
            for other in
                others.filter(|a| !(algorithm == Algorithm::LeakyBucket && **a == Algorithm::Gcra))
            {
                assert!(
                    !one.contains(&defines(*other)),
                    "{algorithm:?} has {other:?}"
                );
            }
        }
        assert!(source(bit(Algorithm::LeakyBucket)).contains(&defines(Algorithm::Gcra)));
        assert!(all.contains(" gcra = gcra, leaky_bucket = leaky_bucket, "));
        assert!(all.trim_end().ends_with("return decide(KEYS, ARGV)"));
        let (text, name) = library();
        assert!(text.starts_with(&format!("#!lua name={name}\n")));
        assert!(text.ends_with(&format!("redis.register_function('{name}', decide)\n")));
        assert_eq!(name.len(), "sluice_".len() + 16);
        assert_ne!(
            script(bit(Algorithm::Gcra)).get_hash(),
            full_script().get_hash()
        );
        assert_eq!(full_script().get_hash().len(), 40);
    }

    /// `bench/lua_cost.sh` measures the scripts it builds itself; they must be these.
    #[test]
    fn the_benchmark_builds_the_same_scripts() {
        let bench = concat!(env!("CARGO_MANIFEST_DIR"), "/bench/lua_cost.sh");
        for algorithm in Algorithm::ALL {
            let out = std::process::Command::new("bash")
                .args([bench, "--script", algorithm.name()])
                .output()
                .expect("bash runs bench/lua_cost.sh");
            assert!(out.status.success(), "{algorithm:?}: {out:?}");
            assert!(
                out.stdout == source(bit(algorithm)).as_bytes(),
                "{algorithm:?}: bench/lua_cost.sh builds another script than source()"
            );
        }
        let out = std::process::Command::new("bash")
            .args([bench, "--library"])
            .output()
            .expect("bash runs bench/lua_cost.sh");
        assert!(
            out.status.success() && out.stdout == library().0.as_bytes(),
            "bench/lua_cost.sh builds another library than library()"
        );
    }

    #[test]
    fn checks_become_keys_and_two_fields_each() {
        let check = Check {
            key: "s:{h}:p:gcra".into(),
            rule: Rule {
                algorithm: Algorithm::Gcra,
                limit: 3,
                period_ms: 1_000,
                burst: 5,
                max_delay_ms: Some(250),
                lease_ms: 60_000,
                calendar: None,
            },
            cost: 2,
            enforce: false,
            lease: 0,
            ban_ms: 0,
        };
        let adjustment = Adjustment {
            check: check.clone(),
            charged_at: 42,
            amount: -2,
        };
        let packed = adjust_invocation([&adjustment, &adjustment], Some(7));
        // mode, now, then three fields per adjustment.
        assert_eq!((packed.args.len(), packed.keys.len()), (8, 2));
        assert_eq!(packed.args[2], b"gcra 3 1000 5 250");
        // A banning check: its ban key after the state keys, its ban after the fields.
        let banning = Check {
            enforce: true,
            ban_ms: 9_000,
            ..check.clone()
        };
        let call = invocation(Mode::Decide, [&check, &banning], Some(7));
        assert_eq!((call.args.len(), call.keys.len()), (7, 3));
        assert_eq!(call.args[0], b"decide02");
        // One check to decide: four arguments (each costs Redis a Lua string and more).
        let call = invocation(Mode::Decide, [&check], None);
        assert_eq!(
            call.args,
            [&b"decide0"[..], b"", b"gcra 3 1000 5 250", b"2"]
        );
        assert_eq!(call.keys.len(), 1);
    }

    #[test]
    fn a_batch_carries_each_request_as_its_mode_its_fields_and_its_bans() {
        let check = Check {
            key: "s:{h}:p:gcra".into(),
            rule: Rule {
                algorithm: Algorithm::Gcra,
                limit: 3,
                period_ms: 1_000,
                burst: 5,
                max_delay_ms: None,
                lease_ms: 60_000,
                calendar: None,
            },
            cost: 1,
            enforce: true,
            lease: 0,
            ban_ms: 0,
        };
        let banning = Check {
            key: "s:{h}:q:gcra".into(),
            ban_ms: 9_000,
            ..check.clone()
        };
        let one = [check.clone()];
        let two = [check.clone(), banning];
        // "batch", now; then per request its mode, two fields per check and its bans.
        let call = batch_invocation(&[(&one, None), (&two, None)]);
        assert_eq!((call.args.len(), call.keys.len()), (11, 4));
        // With the caller's clock, every request brings its now.
        let call = batch_invocation(&[(&one, Some(5)), (&two, Some(6))]);
        assert_eq!((call.args.len(), call.keys.len()), (13, 4));
        // Requests with the fields of the one before: "=", their count, their nows; their
        // keys.
        let other = [
            Check {
                key: "s:{i}:q:gcra".into(),
                ..two[0].clone()
            },
            Check {
                key: "s:{i}:r:gcra".into(),
                ..two[1].clone()
            },
        ];
        let call = batch_invocation(&[
            (&one, Some(5)),
            (&two, Some(6)),
            (&other, Some(7)),
            (&other, Some(8)),
        ]);
        assert_eq!((call.args.len(), call.keys.len()), (17, 10));
        assert_eq!(call.args[13..], [&b"="[..], b"2", b"7", b"8"]);
        // The script holds every algorithm of the batch.
        let window = Check {
            rule: Rule {
                algorithm: Algorithm::FixedWindow,
                ..check.rule
            },
            ..check.clone()
        };
        let mixed = batch_invocation(&[(&one, None), (std::slice::from_ref(&window), None)]);
        assert_eq!(
            mixed.set,
            bit(Algorithm::Gcra) | bit(Algorithm::FixedWindow)
        );
        assert_eq!(flags("decide", &[&two[0], &two[1], &window]), "decide121");
    }

    #[test]
    fn a_batch_reply_splits_into_each_requests_verdicts() {
        let reply = [99, 1, 4, 300, 0, 0, 0, 0, 1000, 2, 0, 500, 500];
        let requests = decode_batch(&reply, [1, 2].into_iter()).expect("valid reply");
        assert_eq!(requests.len(), 2);
        assert_eq!(
            requests[0],
            [Verdict {
                allowed: true,
                remaining: 4,
                reset_ms: 300,
                ..Verdict::default()
            }]
        );
        assert_eq!(requests[1].len(), 2);
        assert!(!requests[1][0].allowed && requests[1][0].retry_after_ms == 1000);
        assert!(requests[1][1].banned && requests[1][1].retry_after_ms == 500);
        assert!(decode_batch(&reply, [1, 1].into_iter()).is_err());
        assert!(decode_batch(&reply, [2, 2].into_iter()).is_err());
        assert!(decode_batch(&[99, 1, -4, 0, 0], [1].into_iter()).is_err());
    }

    #[test]
    fn integers_come_as_an_array_or_packed() {
        use redis::{FromRedisValue, Value};
        let array = Value::Array(vec![Value::Int(1_764_000_000_000), Value::Int(-3)]);
        let mut packed = 1_764_000_000_000_i64.to_be_bytes().to_vec();
        packed.extend((-3_i64).to_be_bytes());
        for value in [array, Value::BulkString(packed)] {
            assert_eq!(
                Integers::from_redis_value(value).expect("integers"),
                Integers(vec![1_764_000_000_000, -3])
            );
        }
        assert!(Integers::from_redis_value(Value::BulkString(vec![0; 12])).is_err());
    }

    #[test]
    fn replies_decode_to_verdicts() {
        let reply = decode(
            &[99, 1, 4, 300, 100, 0, 0, 0, 1000],
            Mode::Decide,
            &[false, false],
        )
        .expect("valid reply");
        assert_eq!(reply.now, 99);
        assert!(reply.charged);
        assert_eq!(
            reply.verdicts,
            [
                Verdict {
                    allowed: true,
                    remaining: 4,
                    reset_ms: 300,
                    retry_after_ms: 0,
                    wait_ms: 100,
                    banned: false,
                },
                Verdict {
                    allowed: false,
                    remaining: 0,
                    reset_ms: 0,
                    retry_after_ms: 1000,
                    wait_ms: 0,
                    banned: false,
                },
            ]
        );
        let charged = |mode, enforce: &[bool]| {
            decode(&[99, 1, 4, 300, 100, 0, 0, 0, 1000], mode, enforce)
                .expect("valid reply")
                .charged
        };
        assert!(
            !charged(Mode::Decide, &[false, true]),
            "an enforced check denied"
        );
        assert!(!charged(Mode::Peek, &[false, false]));
        assert!(decode(&[99, 1, 1], Mode::Decide, &[true]).is_err());
        assert!(decode(&[99, 1, -4, 0, 0], Mode::Decide, &[true]).is_err());
    }
}

//! The limiter's Lua scripts: their text, their SHAs, and the KEYS/ARGV and reply of one call.
//!
//! Assembly: Redis runs one script per call, but `lua/` keeps one file per algorithm. A
//! script is `common.lua` (the conventions, no code), the algorithm files a call needs
//! (each defines one `local` function named after its algorithm that decides, charges or
//! refunds one check), a generated line naming them (`ALGORITHM` and `NAME` when there is
//! one, else an `ALGORITHMS` table), and last `decide.lua`, the entry point that parses
//! ARGV and runs them all or nothing. Every file opens with its contract; `decide.lua`'s is
//! the one a caller sees.
//!
//! Why one script per set of algorithms rather than one for all: Redis runs a script's
//! top level on every call, so every function defined there is made again on every call;
//! a script defines only what its call can use. At most 2^7 sets exist; each is built and
//! hashed once, on first use, and called by its SHA. `bench/lua_cost.sh` measures the
//! server CPU of each algorithm's script.

use std::sync::OnceLock;

use redis::{Script, ScriptInvocation};

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

/// The script text for the algorithms in `set`.
fn source(set: AlgorithmSet) -> String {
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

/// The script for the algorithms in `set`, built and hashed once.
fn script(set: AlgorithmSet) -> &'static Script {
    static SCRIPTS: [OnceLock<Script>; EVERY_ALGORITHM + 1] =
        [const { OnceLock::new() }; EVERY_ALGORITHM + 1];
    SCRIPTS[set & EVERY_ALGORITHM].get_or_init(|| Script::new(&source(set)))
}

/// The script that holds every algorithm: loaded at connect to check the server takes it.
pub(crate) fn full_script() -> &'static Script {
    script(EVERY_ALGORITHM)
}

/// Reply integers per check, after `now`: allowed (1, 0, or 2 for banned), remaining,
/// reset_ms, and delay_ms (the wait when allowed, the retry-after when denied).
const REPLY_FIELDS: usize = 4;

/// A script's reply of integers: an array of them, or, from a batch, one string of them
/// packed big-endian, eight bytes each (cheaper to read than hundreds of array elements).
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
/// now, then six fields per check (see `lua/decide.lua`). `now` is `None` when the script
/// should read Redis TIME.
pub(crate) fn invocation<'c>(
    mode: Mode,
    checks: impl IntoIterator<Item = &'c Check>,
    now: Option<u64>,
) -> ScriptInvocation<'static> {
    let checks: Vec<&Check> = checks.into_iter().collect();
    let set = checks.iter().fold(0, |set, c| set | bit(c.rule.algorithm));
    let mut call = script(set).prepare_invoke();
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
/// now, then per adjustment its check's first five fields, the amount and the time of the
/// charge it adjusts. The reply is `{now}`.
pub(crate) fn adjust_invocation<'a>(
    adjustments: impl IntoIterator<Item = &'a Adjustment>,
    now: Option<u64>,
) -> ScriptInvocation<'static> {
    let adjustments: Vec<&Adjustment> = adjustments.into_iter().collect();
    let set = adjustments
        .iter()
        .fold(0, |set, a| set | bit(a.check.rule.algorithm));
    let mut call = script(set).prepare_invoke();
    call.arg("adjust")
        .arg(now.map(|n| n.to_string()).unwrap_or_default());
    for adjustment in adjustments {
        // A refund's calendar window is that of its charge.
        let of = (adjustment.amount < 0).then_some(adjustment.charged_at);
        push_rule(&mut call, &adjustment.check, now, of);
        call.arg(adjustment.amount).arg(adjustment.charged_at);
    }
    call
}

/// One request's checks and its `now` (as for `invocation`), in a batch.
pub(crate) type Request<'c> = (&'c [Check], Option<u64>);

/// One call deciding several requests in order, each all or nothing exactly as its own
/// `invocation(Mode::Decide, ..)` would: ARGV is "batch", then "" when the script should
/// read TIME (once, for all) or "each" when every request brings its `now` (all or none
/// do), then per request its decide mode, its now with "each", its fields and its bans, or
/// "=" and its now when they are those of the request before it; KEYS are each request's
/// keys then its ban keys, request after request.
pub(crate) fn batch_invocation(requests: &[Request<'_>]) -> ScriptInvocation<'static> {
    let set = requests
        .iter()
        .flat_map(|(checks, _)| checks.iter())
        .fold(0, |set, c| set | bit(c.rule.algorithm));
    let mut call = script(set).prepare_invoke();
    let each = requests.iter().any(|(_, now)| now.is_some());
    call.arg("batch").arg(if each { "each" } else { "" });
    let mut before: &[Check] = &[];
    for &(checks, now) in requests {
        if same_fields(checks, before) {
            call.arg("=");
            if each {
                call.arg(now.unwrap_or_default());
            }
            for check in checks {
                call.key(&check.key);
            }
            for check in checks.iter().filter(|c| bans(c)) {
                call.key(ban_key(&check.key));
            }
        } else {
            let checks: Vec<&Check> = checks.iter().collect();
            call.arg(flags("decide", &checks));
            if each {
                call.arg(now.unwrap_or_default());
            }
            push_checks(&mut call, &checks, true, now);
        }
        before = checks;
    }
    call
}

/// Whether checks `a` send the same mode, fields and bans as checks `b` (their keys aside).
fn same_fields(a: &[Check], b: &[Check]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(a, b)| {
            (a.rule, a.cost, a.enforce, a.lease, a.ban_ms)
                == (b.rule, b.cost, b.enforce, b.lease, b.ban_ms)
                // A calendar check's fields hold its request's time (`push_rule`).
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

/// Every check's key and six fields; with `banning`, then the ban key and the ban of every
/// check that bans.
/// A check's key and its first five fields: algorithm, limit, period, burst, max_delay.
///
/// A calendar fixed_window (DESIGN §20) sends instead, in the places of period, burst and
/// max_delay: minus the length of its window, the window's start, and the proxy's time
/// (`now`, or the system clock's when the script reads TIME), which the script decides it
/// at; the window is the one that time falls in, or `of` (a refund's charge).
fn push_rule(
    call: &mut ScriptInvocation<'static>,
    check: &Check,
    now: Option<u64>,
    of: Option<u64>,
) {
    let rule = &check.rule;
    call.key(&check.key)
        .arg(rule.algorithm.name())
        .arg(rule.limit);
    if let Some(calendar) = rule.calendar {
        let now = now.unwrap_or_else(crate::clock::unix_ms);
        let (start, end) = crate::limiter::calendar::window(calendar, of.unwrap_or(now));
        call.arg(-((end - start) as i64)).arg(start).arg(now);
        return;
    }
    call.arg(rule.period_ms);
    if rule.algorithm == Algorithm::Concurrency {
        // In the places of burst and max_delay, which concurrency has no use for.
        call.arg(rule.lease_ms).arg(check.lease);
    } else {
        call.arg(rule.burst)
            .arg(rule.max_delay_ms.map(|d| d.to_string()).unwrap_or_default());
    }
}

fn push_checks(
    call: &mut ScriptInvocation<'static>,
    checks: &[&Check],
    banning: bool,
    now: Option<u64>,
) {
    for check in checks {
        push_rule(call, check, now, None);
        call.arg(check.cost);
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
pub(crate) fn release_invocation(key: &str, lease: u64) -> ScriptInvocation<'static> {
    let mut call = script(bit(Algorithm::Concurrency)).prepare_invoke();
    call.key(key).arg("release").arg("").arg(lease);
    call
}

/// Makes concurrency lease `lease` under `key`, if still live, expire `lease_ms` after now
/// (`now` as for `invocation`). The reply is `{now, 1}` if the lease was live, else
/// `{now, 0}`.
pub(crate) fn renew_invocation(
    key: &str,
    lease: u64,
    lease_ms: u64,
    now: Option<u64>,
) -> ScriptInvocation<'static> {
    let mut call = script(bit(Algorithm::Concurrency)).prepare_invoke();
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
        assert!(all.trim_end().ends_with("return reply"));
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
    }

    #[test]
    fn checks_become_keys_and_six_fields_each() {
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
        let text = format!("{packed:?}");
        assert!(
            // mode, now, then seven fields per adjustment.
            text.contains("args: 16") && text.contains("keys: 2"),
            "{text}"
        );
        // A banning check: its ban key after the state keys, its ban after the fields.
        let banning = Check {
            enforce: true,
            ban_ms: 9_000,
            ..check.clone()
        };
        let text = format!(
            "{:?}",
            invocation(Mode::Decide, [&check, &banning], Some(7))
        );
        assert!(
            text.contains("args: 15") && text.contains("keys: 3"),
            "{text}"
        );
        // One check to decide: eight arguments, so Redis grows ARGV no further.
        let text = format!("{:?}", invocation(Mode::Decide, [&check], None));
        assert!(
            text.contains("args: 8") && text.contains("keys: 1"),
            "{text}"
        );
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
        // "batch", now; then per request its mode, six fields per check and its bans.
        let text = format!("{:?}", batch_invocation(&[(&one, None), (&two, None)]));
        assert!(
            text.contains("args: 23") && text.contains("keys: 4"),
            "{text}"
        );
        // With the caller's clock, every request brings its now.
        let text = format!(
            "{:?}",
            batch_invocation(&[(&one, Some(5)), (&two, Some(6))])
        );
        assert!(
            text.contains("args: 25") && text.contains("keys: 4"),
            "{text}"
        );
        // A request with the fields of the one before sends "=" (and its now) and its keys.
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
        let text = format!(
            "{:?}",
            batch_invocation(&[(&one, Some(5)), (&two, Some(6)), (&other, Some(7))])
        );
        assert!(
            text.contains("args: 27") && text.contains("keys: 7"),
            "{text}"
        );
        // The script holds every algorithm of the batch.
        let window = Check {
            rule: Rule {
                algorithm: Algorithm::FixedWindow,
                ..check.rule
            },
            ..check.clone()
        };
        let mixed = batch_invocation(&[(&one, None), (std::slice::from_ref(&window), None)]);
        let set = bit(Algorithm::Gcra) | bit(Algorithm::FixedWindow);
        assert!(
            format!("{mixed:?}").contains(script(set).get_hash()),
            "{mixed:?}"
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

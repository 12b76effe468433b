//! The limiter's Lua scripts: their text, their SHAs, and the KEYS/ARGV and reply of one call.
//!
//! Assembly: Redis runs one script per call, but `lua/` keeps one file per algorithm. A
//! script is `common.lua` (integer helpers), the algorithm files a call needs (each defines
//! one `local` table of functions: `decide` reads, `store` charges, `refund` undoes one
//! charge), a generated `ALGORITHMS` table naming them, and last `decide.lua`, the entry
//! point that parses ARGV and runs them all or nothing. Every file opens with its contract;
//! `decide.lua`'s is the one a caller sees.
//!
//! Why one script per set of algorithms rather than one for all: Redis runs a script's
//! top level on every call, and defining all seven algorithms' functions there tripled the
//! server CPU of a one-policy decision. At most 2^7 sets exist; each is built and hashed
//! once, on first use, and called by its SHA.

use std::sync::OnceLock;

use redis::{Script, ScriptInvocation};

use super::algorithm::Verdict;
use super::backend::{BackendError, Check};
use crate::config::Algorithm;

const COMMON: &str = include_str!("../../lua/common.lua");
const ENTRY: &str = include_str!("../../lua/decide.lua");

/// Each algorithm's file, in `Algorithm::ALL` order.
const FILES: [&str; 7] = [
    include_str!("../../lua/fixed_window.lua"),
    include_str!("../../lua/sliding_window.lua"),
    include_str!("../../lua/sliding_log.lua"),
    include_str!("../../lua/token_bucket.lua"),
    include_str!("../../lua/gcra.lua"),
    include_str!("../../lua/leaky_bucket.lua"),
    include_str!("../../lua/concurrency.lua"),
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
    text.push_str("\nlocal ALGORITHMS = {");
    for (i, algorithm) in Algorithm::ALL.iter().enumerate() {
        if set & (1 << i) != 0 {
            text.push_str(&format!(" {0} = {0},", algorithm.name()));
        }
    }
    text.push_str(" }\n");
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

/// Reply integers per check, after the two header integers (now, charged).
const REPLY_FIELDS: usize = 5;

/// What one call does with its checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Evaluate all, charge all that allowed if every enforce check allowed.
    Decide,
    /// Evaluate only.
    Peek,
    /// Undo one charge of every check, made at `charged_at` (the `now` that call replied).
    Refund { charged_at: u64 },
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

/// One call for `checks`: ARGV is mode, now, charged_at, then nine fields per check (see
/// `lua/decide.lua`). `now` is `None` when the script should read Redis TIME.
pub(crate) fn invocation<'c>(
    mode: Mode,
    checks: impl IntoIterator<Item = &'c Check>,
    now: Option<u64>,
) -> ScriptInvocation<'static> {
    let checks: Vec<&Check> = checks.into_iter().collect();
    let set = checks.iter().fold(0, |set, c| set | bit(c.rule.algorithm));
    let mut call = script(set).prepare_invoke();
    let (name, charged_at) = match mode {
        Mode::Decide => ("decide", String::new()),
        Mode::Peek => ("peek", String::new()),
        Mode::Refund { charged_at } => ("refund", charged_at.to_string()),
    };
    call.arg(name)
        .arg(now.map(|n| n.to_string()).unwrap_or_default())
        .arg(charged_at);
    for check in checks {
        let rule = &check.rule;
        call.key(&check.key)
            .arg(rule.algorithm.name())
            .arg(rule.limit)
            .arg(rule.period_ms)
            .arg(rule.burst)
            .arg(rule.max_delay_ms.map(|d| d.to_string()).unwrap_or_default())
            .arg(rule.lease_ms)
            .arg(check.cost)
            .arg(if check.enforce { "1" } else { "0" })
            .arg(check.lease);
    }
    call
}

/// Frees concurrency lease `lease` under `key`.
pub(crate) fn release_invocation(key: &str, lease: u64) -> ScriptInvocation<'static> {
    let mut call = script(bit(Algorithm::Concurrency)).prepare_invoke();
    call.key(key).arg("release").arg("").arg("").arg(lease);
    call
}

/// Reads a `Decide`/`Peek` reply for `checks` checks.
pub(crate) fn decode(reply: &[i64], checks: usize) -> Result<Reply, BackendError> {
    if reply.len() != 2 + REPLY_FIELDS * checks {
        return Err(BackendError::Script(format!(
            "expected {} integers for {checks} checks, got {}",
            2 + REPLY_FIELDS * checks,
            reply.len()
        )));
    }
    let whole = |n: i64| {
        u64::try_from(n).map_err(|_| BackendError::Script(format!("negative value {n} in reply")))
    };
    let verdicts = reply[2..]
        .chunks_exact(REPLY_FIELDS)
        .map(|v| {
            Ok(Verdict {
                allowed: v[0] == 1,
                remaining: whole(v[1])?,
                reset_ms: whole(v[2])?,
                retry_after_ms: whole(v[3])?,
                wait_ms: whole(v[4])?,
            })
        })
        .collect::<Result<Vec<_>, BackendError>>()?;
    Ok(Reply {
        now: whole(reply[0])?,
        charged: reply[1] == 1,
        verdicts,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Algorithm;
    use crate::limiter::algorithm::Rule;

    #[test]
    fn a_script_holds_exactly_the_algorithms_of_its_set() {
        let all = source(EVERY_ALGORITHM);
        for algorithm in Algorithm::ALL {
            assert!(
                all.contains(&format!("local {} = {{}}", algorithm.name())),
                "{algorithm:?}"
            );
            let one = source(bit(algorithm));
            assert!(
                one.contains(&format!(" {0} = {0},", algorithm.name())),
                "{algorithm:?}"
            );
            let others = Algorithm::ALL.iter().filter(|a| **a != algorithm);
            for other in
                others.filter(|a| !(algorithm == Algorithm::LeakyBucket && **a == Algorithm::Gcra))
            {
                assert!(
                    !one.contains(&format!("local {} = {{}}", other.name())),
                    "{algorithm:?} has {other:?}"
                );
            }
        }
        assert!(source(bit(Algorithm::LeakyBucket)).contains("local function tat_decide"));
        assert!(all.trim_end().ends_with("return reply"));
        assert_ne!(
            script(bit(Algorithm::Gcra)).get_hash(),
            full_script().get_hash()
        );
        assert_eq!(full_script().get_hash().len(), 40);
    }

    #[test]
    fn checks_become_keys_and_nine_fields_each() {
        let check = Check {
            key: "s:{h}:p:gcra".into(),
            rule: Rule {
                algorithm: Algorithm::Gcra,
                limit: 3,
                period_ms: 1_000,
                burst: 5,
                max_delay_ms: Some(250),
                lease_ms: 60_000,
            },
            cost: 2,
            enforce: false,
            lease: 0,
        };
        let packed = invocation(Mode::Refund { charged_at: 42 }, [&check, &check], Some(7));
        let text = format!("{packed:?}");
        assert!(
            text.contains("args: 21") && text.contains("keys: 2"),
            "{text}"
        );
    }

    #[test]
    fn replies_decode_to_verdicts() {
        let reply = decode(&[99, 1, 1, 4, 300, 0, 100, 0, 0, 0, 1000, 0], 2).expect("valid reply");
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
                    wait_ms: 100
                },
                Verdict {
                    allowed: false,
                    remaining: 0,
                    reset_ms: 0,
                    retry_after_ms: 1000,
                    wait_ms: 0
                },
            ]
        );
        assert!(decode(&[99, 1, 1], 1).is_err());
        assert!(decode(&[99, 1, 1, -4, 0, 0, 0], 1).is_err());
    }
}

//! The limiter's Lua script: its text, its SHA, and the KEYS/ARGV and reply of one call.
//!
//! Assembly: Redis runs one script per call, but `lua/` keeps one file per algorithm. The
//! script is their concatenation, fixed at build time with `include_str!`:
//! `common.lua` (integer helpers), the seven algorithm files (each defines one `local`
//! table of functions: `decide` reads, `store` charges, `refund` undoes one charge), and
//! last `decide.lua`, the entry point that parses ARGV and runs them all or nothing. Every
//! file opens with its contract; `decide.lua`'s is the one a caller sees. One text means one
//! SHA to load and call with EVALSHA.

use std::sync::LazyLock;

use redis::{Script, ScriptInvocation};

use super::algorithm::Verdict;
use super::backend::{BackendError, Check};

/// The whole script, in dependency order.
pub(crate) const SOURCE: &str = concat!(
    include_str!("../../lua/common.lua"),
    "\n",
    include_str!("../../lua/fixed_window.lua"),
    "\n",
    include_str!("../../lua/sliding_window.lua"),
    "\n",
    include_str!("../../lua/sliding_log.lua"),
    "\n",
    include_str!("../../lua/token_bucket.lua"),
    "\n",
    include_str!("../../lua/gcra.lua"),
    "\n",
    include_str!("../../lua/leaky_bucket.lua"),
    "\n",
    include_str!("../../lua/concurrency.lua"),
    "\n",
    include_str!("../../lua/decide.lua"),
);

/// The script with its SHA1; `Script` calls EVALSHA and, on NOSCRIPT, loads it and retries once.
pub(crate) static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(SOURCE));

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
    let mut call = SCRIPT.prepare_invoke();
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
    let mut call = SCRIPT.prepare_invoke();
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
    fn every_algorithm_file_is_in_the_script_and_the_entry_point_is_last() {
        for algorithm in Algorithm::ALL {
            assert!(
                SOURCE.contains(&format!("local {} = {{}}", algorithm.name())),
                "{algorithm:?}"
            );
        }
        assert!(SOURCE.trim_end().ends_with("return reply"));
        assert_eq!(SCRIPT.get_hash().len(), 40);
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

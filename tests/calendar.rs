//! Calendar periods of fixed_window (DESIGN §20) through the real binary, on a faked
//! clock: libfaketime reads the time from a file the test rewrites (frozen between
//! rewrites), so every count, Retry-After and RateLimit `t=` is exact. Each case runs on
//! the memory backend, on Redis with `clock = "local"`, and on Redis with
//! `clock = "redis"` (a calendar window still follows the proxy's clock: Redis TIME here is
//! the real one, years away from the faked dates).

mod common;

use common::redis::RedisServer;
use common::{config, libfaketime, policy, Sluice, TempDir};

/// A sluice whose wall clock is whatever `set` last wrote (UTC), frozen in between.
struct Faked {
    sluice: Sluice,
    file: std::path::PathBuf,
    _dir: TempDir,
}

impl Faked {
    fn start(template: &str, at: &str) -> Faked {
        let dir = TempDir::new();
        let file = dir.0.join("now");
        std::fs::write(&file, at).expect("write the time");
        let lib = libfaketime();
        let env = [
            ("LD_PRELOAD", lib.as_str()),
            (
                "FAKETIME_TIMESTAMP_FILE",
                file.to_str().expect("utf-8 path"),
            ),
            ("FAKETIME_NO_CACHE", "1"),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
            ("TZ", "UTC"),
        ];
        let sluice = Sluice::start_with_env(template, &env);
        Faked {
            sluice,
            file,
            _dir: dir,
        }
    }

    /// Moves the clock to `at` ("YYYY-MM-DD hh:mm:ss", UTC).
    fn set(&self, at: &str) {
        std::fs::write(&self.file, at).expect("write the time");
    }

    /// (status, Retry-After, RateLimit's t=) of one request to `/c`.
    fn hit(&self) -> (u16, Option<u64>, Option<u64>) {
        let r = self.sluice.get("/c");
        let retry = r.header("retry-after").map(|v| v.parse().expect("seconds"));
        let t = r.header("ratelimit").map(|v| {
            v.split(";t=")
                .nth(1)
                .expect("t=")
                .trim()
                .parse()
                .expect("seconds")
        });
        (r.status, retry, t)
    }
}

/// The backends each case runs on: `[limiter]` lines, and the Redis server when there is one.
fn backends() -> Vec<(String, Option<RedisServer>)> {
    let mut out = vec![("backend = \"memory\"\ndeny_cache = 0".to_owned(), None)];
    for clock in ["local", "redis"] {
        let redis = RedisServer::start();
        let lines = format!(
            "backend = \"redis\"\nurl = \"{}\"\nclock = \"{clock}\"\ntimeout = \"2s\"\ndeny_cache = 0",
            redis.url()
        );
        out.push((lines, Some(redis)));
    }
    out
}

fn template(limiter: &str, limit: u64, period: &str, extra: &str) -> String {
    config(
        limiter,
        "",
        &policy("c", "fixed_window", limit, period, "", extra),
        &[("c", "\"c\"")],
    )
}

const DAY: u64 = 86_400;

#[test]
fn a_utc_month_resets_exactly_at_its_end() {
    for (limiter, redis) in backends() {
        let s = Faked::start(&template(&limiter, 3, "1mo", ""), "2026-03-31 23:59:50");
        assert_eq!(s.hit(), (200, None, Some(10)), "{limiter}");
        // The second request of the window.
        let policy_header = s.sluice.get("/c");
        assert_eq!(
            policy_header.header("ratelimit-policy"),
            Some("\"c\";q=3;w=2678400"),
            "{limiter}"
        );
        assert_eq!(s.hit(), (200, None, Some(10)), "{limiter}");
        assert_eq!(s.hit(), (429, Some(10), Some(10)), "{limiter}");
        s.set("2026-03-31 23:59:59");
        assert_eq!(s.hit(), (429, Some(1), Some(1)), "{limiter}");
        if let Some(redis) = &redis {
            // The key expires at the window's end, never later.
            let keys = redis.cli(&["KEYS", "*"]);
            let key = keys.lines().find(|k| k.contains(":c:")).expect("the key");
            let pttl: i64 = redis.cli(&["PTTL", key]).trim().parse().expect("a TTL");
            assert!(pttl > 0 && pttl <= 10_000, "{limiter}: PTTL {pttl}");
        }
        // April: 30 days from its first instant.
        s.set("2026-04-01 00:00:00");
        assert_eq!(s.hit(), (200, None, Some(30 * DAY)), "{limiter}");
        assert_eq!(s.hit(), (200, None, Some(30 * DAY)), "{limiter}");
        assert_eq!(s.hit(), (200, None, Some(30 * DAY)), "{limiter}");
        assert_eq!(s.hit(), (429, Some(30 * DAY), Some(30 * DAY)), "{limiter}");
    }
}

#[test]
fn a_berlin_day_of_the_spring_dst_change_lasts_23_hours() {
    let tz = "timezone = \"Europe/Berlin\"";
    for (limiter, _redis) in backends() {
        // 00:30 in Berlin (CET, UTC+1) on 2026-03-29: clocks go forward at 02:00, so the day
        // ends at 00:00 CEST = 22:00 UTC, 21h30 later.
        let s = Faked::start(&template(&limiter, 2, "1d", tz), "2026-03-28 23:30:00");
        assert_eq!(s.hit(), (200, None, Some(22 * 3600 + 1800)), "{limiter}");
        assert_eq!(s.hit(), (200, None, Some(22 * 3600 + 1800)), "{limiter}");
        assert_eq!(
            s.hit(),
            (429, Some(22 * 3600 + 1800), Some(22 * 3600 + 1800)),
            "{limiter}"
        );
        s.set("2026-03-29 21:59:59");
        assert_eq!(s.hit(), (429, Some(1), Some(1)), "{limiter}");
        // Midnight in Berlin: a new day of 24 hours (summer time throughout).
        s.set("2026-03-29 22:00:00");
        assert_eq!(s.hit(), (200, None, Some(DAY)), "{limiter}");
        assert_eq!(s.hit(), (200, None, Some(DAY)), "{limiter}");
        assert_eq!(s.hit(), (429, Some(DAY), Some(DAY)), "{limiter}");
    }
}

#[test]
fn a_berlin_month_ends_at_berlin_midnight_not_utc() {
    let tz = "timezone = \"Europe/Berlin\"";
    for (limiter, _redis) in backends() {
        // 23:59:58 CEST on 2026-03-31 is 21:59:58 UTC.
        let s = Faked::start(&template(&limiter, 1, "1mo", tz), "2026-03-31 21:59:58");
        assert_eq!(s.hit(), (200, None, Some(2)), "{limiter}");
        assert_eq!(s.hit(), (429, Some(2), Some(2)), "{limiter}");
        s.set("2026-03-31 22:00:00");
        // April in Berlin: 30 days of summer time.
        assert_eq!(s.hit(), (200, None, Some(30 * DAY)), "{limiter}");
        assert_eq!(s.hit(), (429, Some(30 * DAY), Some(30 * DAY)), "{limiter}");
        // A UTC month would still be March here: the same instant counts in April.
        s.set("2026-03-31 23:00:00");
        assert_eq!(
            s.hit(),
            (429, Some(30 * DAY - 3600), Some(30 * DAY - 3600)),
            "{limiter}"
        );
    }
}

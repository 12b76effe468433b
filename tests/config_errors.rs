//! One config file per kind of error under `tests/config/`, each with its exact messages
//! (the envoyproxy/ratelimit habit): `sluice check` must report every problem at FILE:LINE:COL
//! and exit 2.

use std::process::Command;

const SLUICE: &str = env!("CARGO_BIN_EXE_sluice");

/// (fixture, expected lines without the leading "FILE:")
const CASES: &[(&str, &[&str])] = &[
    (
        "calendar_reject.toml",
        &[
            "8:12: `timezone`: unknown time zone \"Mars/Olympus_Mons\" (expected an IANA name such as \"UTC\" or \"Europe/Berlin\")",
            "14:10: calendar periods (\"1w\", \"1mo\", and \"1d\" with a `timezone`) work with fixed_window only, not gcra",
            "21:1: `timezone` \"Europe/Berlin\" needs a calendar period (period = \"1d\", \"1w\" or \"1mo\")",
            "29:24: `body_file`: cannot read tests/config/no-such-reject.json: No such file or directory (os error 2)",
            "36:10: missing required key `body_file` in `reject` of [policies.untyped]",
            "36:12: `content_type` must be a non-empty header value",
            "48:1: a calendar period's overrides keep its windows: set `limit` only",
        ],
    ),
    (
        "metering.toml",
        &[
            "7:1: charging from the response works with fixed_window, sliding_window, sliding_log, token_bucket and gcra (concurrency counts requests in flight; leaky_bucket has already shaped the request)",
            "13:21: a status must be 100 to 599, or a range such as \"500-599\"",
            "13:25: a status must be 100 to 599, or a range such as \"500-599\"",
            "13:36: a status must be 100 to 599, or a range such as \"500-599\"",
            "19:1: `count` and `cost = { … }` cannot be used together: a policy charges either its statuses or its response's cost",
            "26:8: `cost` takes one of `header` and `usage`",
            "26:19: `header`: \"bad header\" is not a valid header name",
            "33:1: `reserve` 6 can never be admitted: it exceeds `burst` (5)",
            "34:1: `max_reserve` bounds `reserve = \"request\"` only",
            "40:1: `reserve` needs `cost = { header = … }` or `cost = { usage = … }`",
            "46:18: `usage`: unknown value \"mistral\" (expected one of: openai, anthropic, gemini)",
            "54:1: `max_reserve` 10 can never be admitted: it exceeds `burst` (5)",
            "61:1: `max_reserve` 4096 (its default) can never be admitted: it exceeds `burst` (5)",
            "67:38: `weights` weighs Anthropic's prompt-cache tokens: it takes `usage = \"anthropic\"`",
            "73:56: `cache_read` must be a number from 0 to 1000, found -1",
            "73:80: unknown key `cache` in `weights`",
        ],
    ),
    (
        "auth_jwt.toml",
        &[
            "7:24: `algorithms`: \"none\": unsigned tokens are never accepted (expected RS256, RS384, RS512, PS256, PS384, PS512, ES256, ES384, EdDSA, HS256, HS384, HS512)",
            "7:32: `algorithms`: \"XS256\": unknown algorithm (expected RS256, RS384, RS512, PS256, PS384, PS512, ES256, ES384, EdDSA, HS256, HS384, HS512)",
            "8:13: `jwks_file`: cannot read no-such-jwks.json: No such file or directory (os error 2)",
            "9:1: `consumer_prefix` \"\" (the default) is also that of issuer \"https://a.example/\": with two or more issuers of consumers = \"separate\" each needs a prefix of its own, none the start of another, so that no issuer can name another's consumers",
            "12:15: `algorithms`: HS256 needs `secret_file`; HMAC keys are never taken from a JWKS",
            "14:1: `consumer_prefix` \"\" (the default) is also that of issuer \"https://a.example/\": with two or more issuers of consumers = \"separate\" each needs a prefix of its own, none the start of another, so that no issuer can name another's consumers",
            "14:1: an issuer takes exactly one of `jwks_file`, `jwks_url` and `secret_file`",
            "16:1: `audiences` needs at least one audience",
            "18:1: `consumer_prefix` \"\" (the default) is also that of issuer \"https://a.example/\": with two or more issuers of consumers = \"separate\" each needs a prefix of its own, none the start of another, so that no issuer can name another's consumers",
            "21:24: `algorithms`: HS256 needs `secret_file`; HMAC keys are never taken from a JWKS",
            "22:1: an issuer takes exactly one of `jwks_file`, `jwks_url` and `secret_file`",
            "23:12: `jwks_url`: \"ftp://idp.example/jwks.json\" must be an http:// or https:// URL",
            "24:1: `consumer_prefix` \"\" (the default) is also that of issuer \"https://a.example/\": with two or more issuers of consumers = \"separate\" each needs a prefix of its own, none the start of another, so that no issuer can name another's consumers",
            "28:13: `jwks_file`: no usable key for ES256 among its 2 keys",
            "29:1: `consumer_prefix` \"\" (the default) is also that of issuer \"https://a.example/\": with two or more issuers of consumers = \"separate\" each needs a prefix of its own, none the start of another, so that no issuer can name another's consumers",
            "30:10: duplicate issuer \"https://a.example/\"",
        ],
    ),
    (
        "auth_jwt_prefix.toml",
        &[
            "15:19: `consumer_prefix` \"a:\" is also that of issuer \"https://a.example/\": with two or more issuers of consumers = \"separate\" each needs a prefix of its own, none the start of another, so that no issuer can name another's consumers",
            "16:13: `consumers`: unknown value \"same\" (expected one of: separate, match)",
            "22:19: `consumer_prefix` is for consumers = \"separate\" only: a \"match\" issuer's claim names a consumer of API keys as written",
            "29:19: `consumer_prefix` must not hold a control character",
            "31:1: `consumer_prefix` \"\" (the default) is the start of that of issuer \"https://a.example/\" (\"a:\"): with two or more issuers of consumers = \"separate\" each needs a prefix of its own, none the start of another, so that no issuer can name another's consumers",
        ],
    ),
    (
        "auth_consumers.toml",
        &[
            "4:32: `api_key`: \"path\" is not a header:NAME or query:NAME source",
            "5:19: `consumer_header`: \"bad header\" is not a valid header name",
            "6:16: missing required key `ban` in `max_failures`",
            "6:26: `limit` must be between 1 and 1000000, found 0",
            "10:84: `keys`: expected \"sha256:\" and 64 lowercase hex digits (the SHA-256 of the key, never the key itself)",
            "12:8: duplicate consumer name \"acme\"",
            "13:9: `keys`: expected \"sha256:\" and 64 lowercase hex digits (the SHA-256 of the key, never the key itself)",
            "16:9: duplicate key digest (each key belongs to one consumer)",
            "18:8: \"anonymous\" is the plan of requests without a consumer; no consumer may be named so",
            "19:8: `plan` must be a name other than \"anonymous\"",
            "21:8: a consumer name must not be an IP address (anonymous clients are keyed by theirs)",
        ],
    ),
    (
        "auth_routes.toml",
        &[
            "9:20: `key`: unknown key part \"claim:\" (expected client_ip, client_ip/N, header:NAME, query:NAME, cookie:NAME, path, method, host, route, client_cert, consumer, plan or claim:NAME)",
            "10:14: `on_missing`: unknown value \"clientip\" (expected one of: skip, deny, shared, client_ip)",
            "16:8: route \"api\" has `auth` but [auth] accepts no credentials (no `api_key` sources and no [[auth.jwt]])",
            "20:8: `auth`: unknown value \"sometimes\" (expected one of: off, optional, required)",
        ],
    ),
    (
        "edge_rules.toml",
        &[
            "3:14: `request_id`: \"x request id\" is not a valid header name",
            "6:10: `scheme`: unknown value \"ftp\" (expected one of: http, https)",
            "7:41: `status` must be between 300 and 399, found 200",
            "10:12: a redirect takes exactly one of `scheme` and `location`",
            "14:1: `strip_prefix` needs a `path_prefix`",
            "15:29: `request_headers`: \"bad header\" is not a valid header name",
            "15:58: `request_headers`: \"line\\nbreak\" is not a valid header value",
            "15:85: `request_headers`: \"x y\" is not a valid header name",
            "16:22: unknown key `sett` in `response_headers`",
            "21:1: a route takes exactly one of `upstream`, `respond` and `redirect`",
        ],
    ),
    (
        "bad_cidr.toml",
        &[
            "3:20: `trusted_proxies`: bad CIDR \"10.0.0.0/33\" (expected e.g. \"10.0.0.0/8\" or \"2001:db8::/32\")",
        ],
    ),
    (
        "client_addresses.toml",
        &[
            "3:27: `deny`: bad CIDR \"198.51.100.300\" (expected e.g. \"10.0.0.0/8\" or \"2001:db8::/32\")",
            "3:45: `deny`: bad CIDR \"2001:db8::/129\" (expected e.g. \"10.0.0.0/8\" or \"2001:db8::/32\")",
            "7:29: `client_ips`: bad CIDR \"10.0.0.0/x\" (expected e.g. \"10.0.0.0/8\" or \"2001:db8::/32\")",
            "11:1: `client_ips` needs at least one network (leave it out to match every address)",
        ],
    ),
    (
        "admin_settings.toml",
        &[
            "5:14: `token_file`: cannot read no-such-token-file: No such file or directory (os error 2)",
            "6:12: `top_keys` must be between 0 and 1000000, found -1",
        ],
    ),
    (
        "path_normalisation.toml",
        &[
            "3:17: `merge_slashes` must be a boolean, found a string",
            "4:19: `escaped_slashes`: unknown value \"decode\" (expected one of: keep, reject)",
        ],
    ),
    (
        "client_bounds.toml",
        &[
            "3:18: `header_timeout` must be at least 1ms",
            "4:16: `idle_timeout`: bad duration \"soon\" (expected a whole number and a unit: ms, s, m, h or d, e.g. \"250ms\", \"1m\")",
            "5:20: `max_request_body`: bad size \"10 MB\" (expected a whole number of bytes with an optional unit: B, KB, MB or GB, e.g. \"512KB\", \"10MB\")",
            "6:26: `max_connections_per_ip` must be between 0 and 4294967295, found -1",
            "9:20: `max_request_body`: bad size \"1TB\" (expected a whole number of bytes with an optional unit: B, KB, MB or GB, e.g. \"512KB\", \"10MB\")",
        ],
    ),
    (
        "bad_duration.toml",
        &[
            "6:10: `period`: bad duration \"10 minutes\" (expected a whole number and a unit: ms, s, m, h or d, e.g. \"250ms\", \"1m\")",
        ],
    ),
    (
        "bad_key.toml",
        &[
            "7:8: `key`: bad prefix length in \"client_ip/200\" (expected client_ip/1 to client_ip/128)",
            "7:25: `key`: unknown key part \"header:\" (expected client_ip, client_ip/N, header:NAME, query:NAME, cookie:NAME, path, method, host, route, client_cert, consumer, plan or claim:NAME)",
            "7:36: `key`: unknown key part \"cookies:x\" (expected client_ip, client_ip/N, header:NAME, query:NAME, cookie:NAME, path, method, host, route, client_cert, consumer, plan or claim:NAME)",
        ],
    ),
    (
        "bad_overrides.toml",
        &[
            "9:7: `ban`: bad duration \"soon\" (expected a whole number and a unit: ms, s, m, h or d, e.g. \"250ms\", \"1m\")",
            "11:51: `when`: bad CIDR \"10.0.0.0/33\" (expected e.g. \"10.0.0.0/8\" or \"2001:db8::/32\")",
            "11:67: `when`: unknown key part \"cookies:x\" (expected client_ip, client_ip/N, header:NAME, query:NAME, cookie:NAME, path, method, host, route, client_cert, consumer, plan or claim:NAME)",
            "15:1: `cost` 2 can never be admitted: it exceeds this override's `burst` (1)",
            "17:21: `when`: \"method\" needs at least one value",
            "18:9: `limit` must be at least 1, found 0",
            "19:1: an override needs at least one of `limit`, `period` and `burst`",
            "23:1: `limit` times `period` in ms must stay below 2^53",
            "24:1: `burst` times `period` in ms must stay below 2^53",
            "25:1: unknown key `plan` in [[policies.p.overrides]]",
            "26:1: missing required key `when` in [[policies.p.overrides]]",
            "34:1: a concurrency policy has no `period` to override",
        ],
    ),
    (
        "bad_listen.toml",
        &[
            "2:11: `listen`: bad address \"localhost\" (expected IP:PORT, e.g. \"127.0.0.1:8080\")",
        ],
    ),
    (
        "bad_redis_url.toml",
        &[
            "5:7: `url`: bad Redis URL \"http://127.0.0.1:6379\" (expected redis://[user:password@]host:port[/db] or rediss://...)",
        ],
    ),
    (
        "cost_too_high.toml",
        &[
            "9:1: `cost` 4 can never be admitted: it exceeds `burst` (3)",
            "15:1: `cost` 3 can never be admitted: it exceeds `limit` (2)",
        ],
    ),
    (
        "delay_unsupported.toml",
        &[
            "8:1: on_exceed = \"delay\" works with token_bucket and gcra only (leaky_bucket always delays)",
        ],
    ),
    (
        "duplicate_route.toml",
        &[
            "7:1: duplicate route name \"r\"",
        ],
    ),
    (
        "duplicate_upstream.toml",
        &[
            "5:12: duplicate key `a`",
        ],
    ),
    (
        "many_errors.toml",
        &[
            "3:1: missing required key `algorithm` in [policies.p]",
            "4:1: unknown key `algoritm` in [policies.p]",
            "5:9: `limit` must be at least 1, found -1",
            "6:10: `period`: bad duration \"0x\" (expected a whole number and a unit: ms, s, m, h or d, e.g. \"250ms\", \"1m\")",
            "7:8: `key`: unknown key part \"nope\" (expected client_ip, client_ip/N, header:NAME, query:NAME, cookie:NAME, path, method, host, route, client_cert, consumer, plan or claim:NAME)",
            "8:8: `mode`: unknown value \"loud\" (expected one of: enforce, shadow)",
        ],
    ),
    (
        "missing_routes.toml",
        &[
            "1:1: missing required key `routes` in the config",
        ],
    ),
    (
        "path_matchers.toml",
        &[
            "6:1: a route takes only one of `path`, `path_prefix` and `path_regex`",
            "10:14: `path_regex`: bad regex: error: unclosed character class",
        ],
    ),
    (
        "route_target.toml",
        &[
            "8:1: a route takes exactly one of `upstream`, `respond` and `redirect`",
            "9:1: a route needs exactly one of `upstream`, `respond` and `redirect`",
        ],
    ),
    (
        "syntax_error.toml",
        &[
            "1:8: unclosed table, expected `]`",
        ],
    ),
    (
        "upstream_tls.toml",
        &[
            "5:1: `ca_file` needs `tls = true`",
            "6:1: `client_cert` needs `tls = true`",
            "7:1: `client_key` needs `tls = true`",
            "11:11: `ca_file`: cannot read \"tests/config/no-such-ca.pem\": No such file or directory (os error 2)",
            "12:15: `client_cert`: cannot read \"tests/config/no-such-client.pem\": No such file or directory (os error 2)",
            "13:14: `client_key`: cannot read \"tests/config/no-such-client.key\": No such file or directory (os error 2)",
            "17:11: `ca_file`: no certificate in \"tests/config/upstream_tls.toml\" (expected PEM: -----BEGIN CERTIFICATE-----)",
            "18:15: `client_cert`: no certificate in \"tests/config/upstream_tls.toml\" (expected PEM: -----BEGIN CERTIFICATE-----)",
            "19:14: `client_key`: no private key in \"tests/config/upstream_tls.toml\" (expected PEM: PKCS#8, PKCS#1 or SEC1)",
            "23:1: `client_cert` needs `client_key`",
            "27:1: `client_key` needs `client_cert`",
        ],
    ),
    (
        "adaptive.toml",
        &[
            "6:13: `min_limit` 30 is above `max_limit` 10",
            "8:10: `window` must be at least 10ms (an update needs 10 samples)",
            "9:13: `tolerance` must be at least 1 (a multiple of the best latency), found 0.9",
            "11:31: share of plan \"free\" must be in (0, 1], found 0",
            "11:40: share of plan \"pro\" must be in (0, 1], found 1.5",
            "11:53: share of plan \"trial\" must be a number, found a string",
            "14:30: `initial_limit` 3000 is outside [min_limit, max_limit] = [4, 2000]",
            "14:52: unknown key `burst` in [upstreams.b.adaptive]",
        ],
    ),
    (
        "retries.toml",
        &[
            "5:24: `attempts` must be between 1 and 10, found 0",
            "5:44: `on`: unknown value \"500\" (expected one of: connect, reset, 502, 503, 504)",
            "5:61: `budget`: bad share \"120%\" (expected a whole percentage from 0% to 100%, e.g. \"20%\")",
            "5:69: unknown key `tries` in `retries` of [upstreams.a]",
            "8:24: `attempts` must be between 1 and 10, found 11",
            "8:28: `on` needs at least one of: connect, reset, 502, 503, 504",
            "8:46: `budget`: bad share \"20\" (expected a whole percentage from 0% to 100%, e.g. \"20%\")",
            "11:11: `retries` must be a table, e.g. { attempts = 2, on = [\"connect\", \"reset\"] }, found an integer",
        ],
    ),
    (
        "tls_certificates.toml",
        &[
            "2:1: [server] needs at least one address in `listen` or `tls_listen`",
            "5:13: `client_ca`: cannot read \"tests/config/no-such-ca.pem\": No such file or directory (os error 2)",
            "7:10: `hosts`: bad name \"*\" (expected \"api.example.com\" or \"*.example.com\")",
            "8:8: `cert`: cannot read \"tests/config/no-such.pem\": No such file or directory (os error 2)",
            "9:7: `key`: cannot read \"tests/config/no-such.key\": No such file or directory (os error 2)",
            "10:1: missing required key `cert` in [[certificates]]",
            "10:1: missing required key `key` in [[certificates]]",
            "11:10: `hosts`: \"API.example.com\" is already served by an earlier certificate",
            "12:1: unknown key `certs` in [[certificates]]",
        ],
    ),
    (
        "http2.toml",
        &[
            "2:1: `tls_listen` needs at least one [[certificates]] entry",
            "3:1: `h2c` applies to cleartext listeners: it needs an address in `listen`",
            "6:12: `protocol`: unknown value \"h3\" (expected one of: http1, h2)",
            "9:12: `protocol` must be a string, found an integer",
        ],
    ),
    (
        "tls_settings.toml",
        &[
            "2:1: `tls_listen` needs at least one [[certificates]] entry",
            "4:15: `min_version`: unknown value \"1.1\" (expected one of: 1.2, 1.3)",
            "5:1: `client_auth` other than \"off\" needs `client_ca`",
            "6:1: unknown key `ciphers` in [tls]",
        ],
    ),
    (
        "unknown_algorithm.toml",
        &[
            "4:13: `algorithm`: unknown value \"gcra_v2\" (expected one of: fixed_window, sliding_window, sliding_log, token_bucket, gcra, leaky_bucket, concurrency)",
        ],
    ),
    (
        "unknown_key.toml",
        &[
            "3:1: unknown key `listne` in [server]",
        ],
    ),
    (
        "unknown_references.toml",
        &[
            "5:12: unknown upstream \"api\"",
            "6:13: unknown policy \"missing\"",
        ],
    ),
    (
        "upstream_health.toml",
        &[
            "5:42: `path`: bad health check path \"healthz\" (expected a path starting with '/', e.g. \"/healthz\")",
            "5:63: `timeout`: bad duration \"1 s\" (expected a whole number and a unit: ms, s, m, h or d, e.g. \"250ms\", \"1m\")",
            "5:70: unknown key `method` in `health_check` of [upstreams.a]",
            "6:13: `max_fails` must be at least 1, found 0",
            "7:16: `fail_timeout` must be at least 1ms",
            "10:16: missing required key `interval` in `health_check` of [upstreams.b]",
            "10:25: `path`: bad health check path \"/ok here\" (expected a path starting with '/', e.g. \"/healthz\")",
            "10:37: `timeout` must be at least 1ms",
            "11:13: `max_fails` must be an integer, found a string",
            "12:1: unknown key `fail_timeouts` in [upstreams.b]",
        ],
    ),
    (
        "prefetch.toml",
        &[
            "8:1: `prefetch` works with fixed_window, sliding_window, token_bucket and gcra (a log, a queue and leases cannot be taken ahead)",
            "16:1: `prefetch` does not combine with on_exceed = \"delay\" (units taken ahead are admitted at once)",
            "22:20: `max` must be at least 1, found 0",
            "22:30: `hold` must be at least 1ms",
            "22:37: unknown key `other` in `prefetch`",
            "28:12: missing required key `max` in `prefetch`",
            "28:12: missing required key `hold` in `prefetch`",
            "35:1: `prefetch` does not combine with charging from the response (`count`, `cost = { … }`): a response's charge is settled on the key, not on units taken ahead",
        ],
    ),
    (
        "wrong_type.toml",
        &[
            "2:10: `listen` must be an array of strings, found a string",
            "3:11: `threads` must be an integer, found a string",
        ],
    ),
    (
        "zero_limit.toml",
        &[
            "5:9: `limit` must be at least 1, found 0",
        ],
    ),
    (
        "upstream_resolve.toml",
        &[
            "3:29: `resolvers`: bad address \"dns.example:53\" (expected IP:PORT, e.g. \"127.0.0.1:8080\")",
            "6:11: `resolve` must be at least 1s",
            "9:11: `resolve`: bad duration \"soon\" (expected a whole number and a unit: ms, s, m, h or d, e.g. \"250ms\", \"1m\")",
        ],
    ),
];

#[test]
fn every_bad_config_is_rejected_with_every_error_located() {
    for (name, expected) in CASES {
        let path = format!("tests/config/{name}");
        let out = Command::new(SLUICE)
            .args(["check", "--config", &path])
            .output()
            .expect("run sluice check");
        assert_eq!(out.status.code(), Some(2), "{name}: exit code");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let want: Vec<String> = expected.iter().map(|l| format!("{path}:{l}")).collect();
        let got: Vec<&str> = stderr.lines().collect();
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn every_fixture_is_covered() {
    let mut files: Vec<String> = std::fs::read_dir("tests/config")
        .expect("fixtures dir")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        // Configs only: JWKS files and consumer files are read by the configs.
        .filter(|name| name.ends_with(".toml"))
        .collect();
    files.sort();
    let mut named: Vec<String> = CASES.iter().map(|(n, _)| n.to_string()).collect();
    // Checked by consumer_file_errors_are_located_in_their_own_file.
    named.push("auth_consumer_files.toml".into());
    // Checked by ratelimit_file_errors_are_located_in_their_own_file.
    named.push("rls_prefetch.toml".into());
    named.sort();
    assert_eq!(files, named);
}

#[test]
fn run_refuses_a_bad_config_the_same_way() {
    let out = Command::new(SLUICE)
        .args(["run", "--config", "tests/config/unknown_references.toml"])
        .output()
        .expect("run sluice");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown upstream \"api\""));
}

#[test]
fn shipped_configs_pass_check() {
    for entry in std::fs::read_dir("conf").expect("conf dir") {
        let path = entry.expect("dir entry").path();
        if path.extension().is_some_and(|e| e == "toml") && !path.ends_with("tls.toml") {
            let out = Command::new(SLUICE)
                .arg("check")
                .arg("--config")
                .arg(&path)
                .output()
                .expect("run sluice");
            assert!(
                out.status.success(),
                "{}: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

/// conf/tls.toml names its certificate files relative to itself (tls/api.pem, tls/api.key),
/// and no key is ever committed: check an exact copy next to a throw-away certificate, as
/// `make check-configs` does.
#[test]
fn shipped_tls_example_passes_check_with_a_throw_away_certificate() {
    let dir = std::env::temp_dir().join(format!("sluice-tls-example-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("tls")).expect("temp dir");
    std::fs::copy("conf/tls.toml", dir.join("tls.toml")).expect("copy conf/tls.toml");
    let made = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
        ])
        .args(["-nodes", "-days", "30", "-subj", "/CN=api.example.com"])
        .args([
            "-addext",
            "subjectAltName=DNS:api.example.com,DNS:*.example.com",
        ])
        .args(["-keyout", "tls/api.key", "-out", "tls/api.pem"])
        .current_dir(&dir)
        .output()
        .expect("openssl is needed: apt-get install openssl");
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let out = Command::new(SLUICE)
        .arg("check")
        .arg("--config")
        .arg(dir.join("tls.toml"))
        .output()
        .expect("run sluice");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "conf/tls.toml: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_missing_file_is_an_error_not_a_panic() {
    let out = Command::new(SLUICE)
        .args(["check", "--config", "/nonexistent/sluice.toml"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr)
        .starts_with("/nonexistent/sluice.toml:1:1: cannot read config"));
}

/// `consumer_files`: problems inside a consumer file are located in that file, after the
/// config's own.
#[test]
fn consumer_file_errors_are_located_in_their_own_file() {
    let path = "tests/config/auth_consumer_files.toml";
    let out = Command::new(SLUICE)
        .args(["check", "--config", path])
        .output()
        .expect("run sluice check");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let got: Vec<&str> = stderr.lines().collect();
    assert_eq!(
        got,
        [
            "tests/config/auth_consumer_files.toml:4:41: `consumer_files`: no-such-dir/*.toml: cannot list tests/config/no-such-dir: No such file or directory (os error 2)",
            "tests/config/consumers.d/team.toml:3:8: duplicate consumer name \"acme\"",
            "tests/config/consumers.d/team.toml:4:9: `keys`: expected \"sha256:\" and 64 lowercase hex digits (the SHA-256 of the key, never the key itself)",
            "tests/config/consumers.d/team.toml:8:1: unknown key `plann` in [[consumers]]",
        ]
    );
}

/// `[rls]`: problems inside a ratelimit YAML file (here its `prefetch`, DESIGN §19) are
/// located in that file.
#[test]
fn ratelimit_file_errors_are_located_in_their_own_file() {
    let out = Command::new(SLUICE)
        .args(["check", "--config", "tests/config/rls_prefetch.toml"])
        .output()
        .expect("run sluice check");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let got: Vec<&str> = stderr.lines().collect();
    let file = "tests/config/ratelimit.d/prefetch.yaml";
    let want: Vec<String> = [
        "14:7: `prefetch` works with fixed_window, sliding_window, token_bucket and gcra, not sliding_log (a log cannot be taken ahead)",
        "19:38: unknown key `other` in `prefetch`",
        "19:24: `max` must be between 1 and 9007199254740992, found 0",
        "19:33: `hold` must be at least 1ms",
        "25:17: missing required key `max` in `prefetch`",
        "25:17: missing required key `hold` in `prefetch`",
        "32:14: `max` must be an integer",
        "33:15: `hold`: bad duration \"soon\" (expected a whole number and a unit: ms, s, m, h or d, e.g. \"250ms\")",
        "38:17: `prefetch` must be a mapping",
    ]
    .iter()
    .map(|l| format!("{file}:{l}"))
    .collect();
    assert_eq!(got, want);
}

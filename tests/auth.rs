//! Consumers, verified (DESIGN §11) end to end: API keys by digest, JWTs of every
//! algorithm from a JWKS file, a JWKS URL and an HMAC secret, forged and broken tokens,
//! limits and tiers keyed on the verified consumer, bans on repeated failures, runtime
//! consumers and keys through the admin API, alone and as a fleet on a real redis-server.
//! Every key and secret is generated when the test runs.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use common::echo::{upstream_saw, upstream_target, EchoUpstream};
use common::http::{self, Response};
use common::jwt::{self, claims, key_digest, now, JwksServer, Signer};
use common::redis::RedisServer;
use common::{policy, Sluice, TempDir};
use serde_json::{json, Value};

const ISS: &str = "https://idp.test/";
const AUD: &str = "api";
const ADMIN_TOKEN: &str = "admin-t0ken-for-auth-tests";
/// acme's API key (plan gold) and freebie's (plan free).
const KEY_ACME: &str = "sk_test_acme_7Hq2ZpW9xLmR4tVb";
const KEY_FREE: &str = "sk_test_free_3Nc8YdK1sJfQ6gUe";

// ---------------------------------------------------------------------------------------
// Configs.

/// The parts of a test config. Routes (all to the echo upstream): `/api/` with
/// `auth = "required"`, `/opt/` with `auth = "optional"`, `/open/` with auth off.
struct Conf<'a> {
    upstream: SocketAddr,
    server: &'a str,
    admin: &'a str,
    limiter: &'a str,
    /// `[auth]` with its keys, then any `[[auth.jwt]]` and `[[consumers]]`.
    auth: &'a str,
    policies: &'a str,
    /// The quoted policy names of `/api/`, `/opt/` and `/open/`.
    api: &'a str,
    opt: &'a str,
    open: &'a str,
    /// More tables at the end (e.g. more routes).
    extra: &'a str,
}

impl<'a> Conf<'a> {
    fn new(upstream: &EchoUpstream, auth: &'a str) -> Conf<'a> {
        Conf {
            upstream: upstream.addr,
            server: "access_log = \"off\"",
            admin: "",
            limiter: "",
            auth,
            policies: "",
            api: "",
            opt: "",
            open: "",
            extra: "",
        }
    }

    fn render(&self) -> String {
        format!(
            "[server]\nlisten = [\"{{listen}}\"]\n{server}\n[admin]\nlisten = \"{{admin}}\"\n{admin}\n[limiter]\n{limiter}\n{auth}\n{policies}\n[upstreams.up]\nservers = [\"{up}\"]\n\
             [[routes]]\nname = \"api\"\npath_prefix = \"/api/\"\nupstream = \"up\"\nauth = \"required\"\npolicies = [{api}]\n\
             [[routes]]\nname = \"opt\"\npath_prefix = \"/opt/\"\nupstream = \"up\"\nauth = \"optional\"\npolicies = [{opt}]\n\
             [[routes]]\nname = \"open\"\npath_prefix = \"/open/\"\nupstream = \"up\"\npolicies = [{open}]\n{extra}\n",
            server = self.server,
            admin = self.admin,
            limiter = self.limiter,
            auth = self.auth,
            policies = self.policies,
            up = self.upstream,
            api = self.api,
            opt = self.opt,
            open = self.open,
            extra = self.extra,
        )
    }

    fn start(&self) -> Sluice {
        Sluice::start(&self.render())
    }
}

/// `[[consumers]]` acme (plan gold, KEY_ACME) and freebie (plan free, KEY_FREE).
fn consumers() -> String {
    format!(
        "[[consumers]]\nname = \"acme\"\nplan = \"gold\"\nkeys = [\"{}\"]\n[[consumers]]\nname = \"freebie\"\nplan = \"free\"\nkeys = [\"{}\"]\n",
        key_digest(KEY_ACME),
        key_digest(KEY_FREE)
    )
}

/// Writes the JWK Set of `signers` to `dir` and returns an `[[auth.jwt]]` entry for issuer
/// ISS, audience AUD, the given algorithms and `extra` lines, reading it as `jwks_file`.
fn jwks_file_issuer(
    dir: &TempDir,
    signers: &[&Signer],
    algorithms: &[&str],
    extra: &str,
) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    let file = dir
        .0
        .join(format!("jwks-{}.json", N.fetch_add(1, Ordering::SeqCst)));
    std::fs::write(&file, jwt::jwks(signers).to_string()).expect("write the JWKS file");
    format!(
        "[[auth.jwt]]\nissuer = \"{ISS}\"\naudiences = [\"{AUD}\"]\nalgorithms = {}\njwks_file = \"{}\"\nplan_claim = \"plan\"\n{extra}\n",
        toml_list(algorithms),
        file.display()
    )
}

/// An `[[auth.jwt]]` entry for `issuer` reading its keys from `url`.
fn jwks_url_issuer(issuer: &str, url: &str, algorithms: &[&str], extra: &str) -> String {
    format!(
        "[[auth.jwt]]\nissuer = \"{issuer}\"\naudiences = [\"{AUD}\"]\nalgorithms = {}\njwks_url = \"{url}\"\nplan_claim = \"plan\"\n{extra}\n",
        toml_list(algorithms)
    )
}

fn toml_list(items: &[&str]) -> String {
    let quoted: Vec<String> = items.iter().map(|a| format!("\"{a}\"")).collect();
    format!("[{}]", quoted.join(", "))
}

fn admin_token_file(dir: &TempDir) -> String {
    let path = dir.0.join("admin-token");
    std::fs::write(&path, format!("{ADMIN_TOKEN}\n")).expect("write the admin token file");
    format!("token_file = \"{}\"", path.display())
}

// ---------------------------------------------------------------------------------------
// Requests and what they must get.

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

fn with_token(s: &Sluice, path: &str, token: &str) -> Response {
    s.get_with(path, &[("Authorization", &bearer(token))])
}

fn with_key(s: &Sluice, path: &str, key: &str) -> Response {
    s.get_with(path, &[("x-api-key", key)])
}

/// A token of ISS for AUD naming `sub`, valid for 5 minutes, with `extra` claims.
fn good(signer: &Signer, sub: &str, extra: Value) -> String {
    signer.sign(&claims(ISS, AUD, sub, 300, &extra))
}

fn admin(s: &Sluice, method: &str, path: &str, body: &str) -> Response {
    let auth = bearer(ADMIN_TOKEN);
    http::request(s.admin, method, path, &[("Authorization", &auth)], body)
}

/// A 401 as §11 makes it: the Bearer challenge (with `error="invalid_token"` when a
/// credential was presented), a problem+json body whose detail mentions `word`
/// (case-insensitive), and nowhere the credential itself.
fn assert_401(r: &Response, presented: Option<&str>, word: &str) {
    assert_eq!(r.status, 401, "{:?} {}", r.headers, r.body);
    let challenge = match presented {
        Some(_) => "Bearer realm=\"sluice\", error=\"invalid_token\"",
        None => "Bearer realm=\"sluice\"",
    };
    assert_eq!(r.header("www-authenticate"), Some(challenge), "{}", r.body);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let body: Value = serde_json::from_str(&r.body).expect("a JSON problem body");
    assert_eq!(body["type"], "about:blank", "{body}");
    assert_eq!(body["title"], "Unauthorized", "{body}");
    assert_eq!(body["status"], 401, "{body}");
    let detail = body["detail"]
        .as_str()
        .expect("a detail")
        .to_ascii_lowercase();
    assert!(
        detail.contains(&word.to_ascii_lowercase()),
        "detail {detail:?} should mention {word:?}"
    );
    if let Some(credential) = presented {
        // Long enough to mean something: a fragment like "a" would match by chance.
        if credential.len() >= 8 {
            assert!(
                !r.body.contains(credential),
                "the 401 echoes the credential: {}",
                r.body
            );
            assert!(
                r.headers.values().all(|v| !v.contains(credential)),
                "a header echoes the credential: {:?}",
                r.headers
            );
        }
    }
}

/// An answer that reached the upstream as `consumer` with `plan` ("": no plan, as for a
/// token without a plan claim: no x-consumer-plan header).
fn assert_as(r: &Response, consumer: Option<&str>, plan: &str) {
    assert_eq!(r.status, 200, "{:?} {}", r.headers, r.body);
    assert_eq!(
        upstream_saw(r, "x-consumer").as_deref(),
        consumer,
        "{}",
        r.body
    );
    let plan = Some(plan).filter(|p| !p.is_empty());
    assert_eq!(
        upstream_saw(r, "x-consumer-plan").as_deref(),
        plan,
        "{}",
        r.body
    );
}

fn auth_metric(s: &Sluice, result: &str, route: &str) -> f64 {
    s.metric(&format!(
        "sluice_auth_total{{result=\"{result}\",route=\"{route}\"}}"
    ))
}

// ---------------------------------------------------------------------------------------
// Tokens.

/// A valid token of each algorithm (ES256, RS256, PS256 and EdDSA from a JWKS file, HS256
/// from a secret file whose trailing newline is not part of the secret) reaches the upstream
/// as its issuer's `consumer_prefix` and its `sub`, with its `plan` claim as the plan; the
/// client's Authorization passes on.
#[test]
fn a_valid_token_of_each_algorithm_reaches_the_upstream_as_its_consumer() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let (es, rs, ps, ed) = (
        Signer::es256("es-1"),
        Signer::rs256("rs-1"),
        Signer::ps256("ps-1"),
        Signer::eddsa("ed-1"),
    );
    let secret = b"a-shared-hmac-secret-of-32-bytes";
    let hs = Signer::hs256("hs-1", secret);
    let secret_file = dir.0.join("hs.secret");
    std::fs::write(&secret_file, [&secret[..], b"\n"].concat()).expect("write secret");
    let auth = format!(
        "[auth]\n{}[[auth.jwt]]\nissuer = \"https://hs.test/\"\naudiences = [\"{AUD}\"]\nalgorithms = [\"HS256\"]\nsecret_file = \"{}\"\nplan_claim = \"plan\"\nconsumer_prefix = \"hs:\"\n",
        jwks_file_issuer(&dir, &[&es, &rs, &ps, &ed], &["ES256", "RS256", "PS256", "EdDSA"], "consumer_prefix = \"idp:\""),
        secret_file.display()
    );
    let s = Conf::new(&up, &auth).start();

    for signer in [&es, &rs, &ps, &ed] {
        let t = good(
            signer,
            &format!("user-{}", signer.alg),
            json!({"plan": "gold"}),
        );
        let r = with_token(&s, "/api/x", &t);
        assert_as(&r, Some(&format!("idp:user-{}", signer.alg)), "gold");
        assert_eq!(upstream_saw(&r, "authorization"), Some(bearer(&t)));
    }
    let t = hs.sign(&claims(
        "https://hs.test/",
        AUD,
        "user-HS256",
        300,
        &json!({"plan": "silver"}),
    ));
    assert_as(
        &with_token(&s, "/api/x", &t),
        Some("hs:user-HS256"),
        "silver",
    );
    // An `aud` list passes when it contains an allowed audience.
    let t = es.sign(&claims(
        ISS,
        AUD,
        "listed",
        300,
        &json!({"aud": ["other", AUD], "plan": "gold"}),
    ));
    assert_as(&with_token(&s, "/api/x", &t), Some("idp:listed"), "gold");

    assert_eq!(up.hits(), 6);
    assert_eq!(auth_metric(&s, "ok", "api"), 6.0, "{}", s.metrics());
}

/// `exp` and `nbf` are checked with the leeway on either side, must be numbers (as `iat`),
/// and `exp` must be there at all.
#[test]
fn time_claims_are_checked_within_the_leeway() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let es = Signer::es256("es-1");
    let auth = format!(
        "[auth]\n{}",
        jwks_file_issuer(&dir, &[&es], &["ES256"], "leeway = \"30s\"")
    );
    let s = Conf::new(&up, &auth).start();
    let t = now();
    let token = |extra: Value| es.sign(&claims(ISS, AUD, "u", 300, &extra));

    // Within the leeway.
    let r = with_token(&s, "/api/x", &token(json!({"exp": t - 10})));
    assert_eq!(r.status, 200, "expired 10 s ago, leeway 30 s: {}", r.body);
    let r = with_token(&s, "/api/x", &token(json!({"nbf": t + 10})));
    assert_eq!(r.status, 200, "valid in 10 s, leeway 30 s: {}", r.body);

    let expired = token(json!({"exp": t - 120}));
    assert_401(
        &with_token(&s, "/api/x", &expired),
        Some(&expired),
        "expired",
    );
    let early = token(json!({"nbf": t + 120}));
    assert_401(&with_token(&s, "/api/x", &early), Some(&early), "");
    for (what, extra) in [
        ("string exp", json!({"exp": (t + 300).to_string()})),
        ("no exp", json!({"exp": null})),
        ("string nbf", json!({"nbf": (t - 10).to_string()})),
        ("string iat", json!({"iat": t.to_string()})),
    ] {
        let bad = token(extra);
        let r = with_token(&s, "/api/x", &bad);
        assert_eq!(r.status, 401, "{what}: {}", r.body);
        assert_401(&r, Some(&bad), "");
    }
    assert_eq!(up.hits(), 2);
    assert_eq!(auth_metric(&s, "invalid", "api"), 6.0);
}

/// A verified token is remembered, but never past its `exp`: with no leeway, the same
/// token that passed is refused once it has expired.
#[test]
fn a_remembered_token_still_expires() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let es = Signer::es256("es-1");
    let auth = format!(
        "[auth]\n{}",
        jwks_file_issuer(&dir, &[&es], &["ES256"], "leeway = \"0s\"")
    );
    let s = Conf::new(&up, &auth).start();
    let token = es.sign(&claims(ISS, AUD, "brief", 2, &json!({})));
    let issued = Instant::now();
    assert_eq!(with_token(&s, "/api/x", &token).status, 200);
    assert_eq!(with_token(&s, "/api/x", &token).status, 200);
    let refused = s.wait_for(Duration::from_secs(6), || {
        with_token(&s, "/api/x", &token).status == 401
    });
    assert!(refused, "still accepted {:?} after issue", issued.elapsed());
    assert!(
        issued.elapsed() >= Duration::from_millis(900),
        "refused before it expired"
    );
    assert_401(&with_token(&s, "/api/x", &token), Some(&token), "expired");
}

/// A token for another audience, of an issuer not configured, or without `aud` or `iss`
/// is refused.
#[test]
fn a_wrong_audience_or_issuer_is_refused() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let es = Signer::es256("es-1");
    let auth = format!("[auth]\n{}", jwks_file_issuer(&dir, &[&es], &["ES256"], ""));
    let s = Conf::new(&up, &auth).start();

    let other_aud = es.sign(&claims(ISS, "billing", "u", 300, &json!({})));
    assert_401(
        &with_token(&s, "/api/x", &other_aud),
        Some(&other_aud),
        "audience",
    );
    let no_aud = es.sign(&claims(ISS, AUD, "u", 300, &json!({"aud": null})));
    assert_401(&with_token(&s, "/api/x", &no_aud), Some(&no_aud), "");
    let other_iss = es.sign(&claims("https://evil.test/", AUD, "u", 300, &json!({})));
    assert_401(&with_token(&s, "/api/x", &other_iss), Some(&other_iss), "");
    let no_iss = es.sign(&claims(ISS, AUD, "u", 300, &json!({"iss": null})));
    assert_401(&with_token(&s, "/api/x", &no_iss), Some(&no_iss), "");
    assert_eq!(up.hits(), 0);
    assert_eq!(
        with_token(&s, "/api/x", &good(&es, "u", json!({}))).status,
        200
    );
}

/// Forgeries never reach the upstream: `alg: none`, the HS256/RS256 confusion (an HMAC
/// keyed with the RSA public key in each encoding a verifier might use), a payload or header
/// altered under a real signature, a signature by another key under a listed `kid`, a key
/// type outside the issuer's allow-list, and plain garbage.
#[test]
fn forged_tokens_are_refused() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let (rs, es) = (Signer::rs256("rs-1"), Signer::es256("es-1"));
    // The set has an EC key too, but the issuer allows RS256 only.
    let auth = format!(
        "[auth]\n{}",
        jwks_file_issuer(&dir, &[&rs, &es], &["RS256"], "")
    );
    let s = Conf::new(&up, &auth).start();
    let genuine = good(&rs, "alice", json!({}));
    assert_as(&with_token(&s, "/api/x", &genuine), Some("alice"), "");
    let hits = up.hits();

    let mut forged: Vec<(&str, String, &str)> = Vec::new();
    let admin_claims = claims(ISS, AUD, "admin", 300, &json!({"plan": "gold"}));
    forged.push(("alg none", jwt::alg_none("rs-1", &admin_claims), ""));
    forged.push((
        "alg none, no kid",
        jwt::tampered_header(&jwt::alg_none("", &admin_claims), &json!({"alg": "none"})),
        "",
    ));
    let pem = rs.rsa_public_spki_pem();
    let pem_trimmed = String::from_utf8_lossy(&pem).trim_end().as_bytes().to_vec();
    let jwk = rs.jwk();
    for (what, secret) in [
        ("HS256 keyed with the SPKI PEM", pem.clone()),
        ("HS256 keyed with the SPKI PEM, no newline", pem_trimmed),
        ("HS256 keyed with the PKCS#1 DER", rs.rsa_public_pkcs1_der()),
        ("HS256 keyed with the JWK", jwk.to_string().into_bytes()),
        (
            "HS256 keyed with the JWK's n",
            jwk["n"].as_str().unwrap_or("").as_bytes().to_vec(),
        ),
    ] {
        forged.push((
            what,
            jwt::hmac_with_public_key(&rs, &secret, &admin_claims),
            "",
        ));
    }
    forged.push((
        "payload altered under alice's signature",
        jwt::tampered_payload(&genuine, &admin_claims),
        "signature",
    ));
    forged.push((
        "header altered (typ) under alice's signature",
        jwt::tampered_header(
            &genuine,
            &json!({"alg": "RS256", "kid": "rs-1", "typ": "at+jwt"}),
        ),
        "signature",
    ));
    let stranger = Signer::rs256("rs-1");
    forged.push((
        "another RSA key under kid rs-1",
        good(&stranger, "admin", json!({})),
        "signature",
    ));
    let es_token = good(&es, "mallory", json!({}));
    forged.push(("ES256, not in the allow-list", es_token, ""));
    forged.push((
        "ES256 signature relabelled RS256",
        jwt::token(&es, &json!({"alg": "RS256", "kid": "rs-1"}), &admin_claims),
        "",
    ));
    forged.push(("garbage", "not-a-jwt-at-all".to_owned(), ""));
    forged.push(("three garbage parts", "aaaa.bbbb.cccc".to_owned(), ""));
    forged.push((
        "truncated signature",
        genuine[..genuine.len() - 10].to_owned(),
        "",
    ));

    for (what, token, word) in &forged {
        let r = with_token(&s, "/api/x", token);
        assert_eq!(r.status, 401, "{what}: {}", r.body);
        assert_401(&r, Some(token), word);
    }
    assert_eq!(up.hits(), hits, "a forged token reached the upstream");
    assert_eq!(
        auth_metric(&s, "invalid", "api"),
        forged.len() as f64,
        "{}",
        s.metrics()
    );
}

// ---------------------------------------------------------------------------------------
// The JWKS URL.

/// A token whose `kid` is not in the set re-fetches the URL, but at most once per
/// `unknown_kid_refetch`: twenty such tokens cost at most one fetch, and a key added at the
/// provider meanwhile is not seen until the interval has passed.
#[test]
fn an_unknown_kid_refetches_the_url_at_most_once_per_interval() {
    let up = EchoUpstream::start();
    let (a, b) = (Signer::es256("key-a"), Signer::es256("key-b"));
    let jwks = JwksServer::start(jwt::jwks(&[&a]));
    let auth = format!(
        "[auth]\n{}",
        jwks_url_issuer(
            ISS,
            &jwks.url(),
            &["ES256"],
            "jwks_refresh = \"10m\"\nunknown_kid_refetch = \"1m\""
        )
    );
    let s = Conf::new(&up, &auth).start();
    assert!(
        s.wait_for(Duration::from_secs(10), || with_token(
            &s,
            "/api/x",
            &good(&a, "u", json!({}))
        )
        .status
            == 200),
        "a token of the served set never passed: {}",
        s.stderr()
    );
    let before = jwks.fetches();
    for _ in 0..20 {
        let t = good(&b, "u", json!({}));
        assert_401(&with_token(&s, "/api/x", &t), Some(&t), "");
    }
    // The one permitted re-fetch may still be on its way.
    std::thread::sleep(Duration::from_millis(500));
    let extra = jwks.fetches() - before;
    assert!(
        extra <= 1,
        "{extra} fetches for 20 requests with an unknown kid"
    );

    // b appears at the provider; within the interval sluice does not ask again.
    jwks.set(jwt::jwks(&[&a, &b]));
    let fetched = jwks.fetches();
    for _ in 0..5 {
        assert_eq!(
            with_token(&s, "/api/x", &good(&b, "u", json!({}))).status,
            401
        );
    }
    assert!(jwks.fetches() - fetched <= 1);
    assert_eq!(
        with_token(&s, "/api/x", &good(&a, "u", json!({}))).status,
        200
    );
}

/// A key rotation at the provider: a token signed with the new key is accepted on its
/// first use (its unknown `kid` re-fetches the set), and once the set no longer lists the
/// old key, new tokens of the old key are refused.
#[test]
fn a_rotated_key_is_picked_up_on_first_use() {
    let up = EchoUpstream::start();
    let (old, new) = (Signer::rs256("2025"), Signer::es256("2026"));
    let jwks = JwksServer::start(jwt::jwks(&[&old]));
    let auth = format!(
        "[auth]\n{}",
        jwks_url_issuer(
            ISS,
            &jwks.url(),
            &["RS256", "ES256"],
            "jwks_refresh = \"10m\"\nunknown_kid_refetch = \"1s\""
        )
    );
    let s = Conf::new(&up, &auth).start();
    assert!(s.wait_for(Duration::from_secs(10), || {
        with_token(&s, "/api/x", &good(&old, "u", json!({}))).status == 200
    }));
    jwks.set(jwt::jwks(&[&new]));
    let picked_up = s.wait_for(Duration::from_secs(5), || {
        with_token(&s, "/api/x", &good(&new, "rotated", json!({}))).status == 200
    });
    assert!(picked_up, "the new key was never accepted: {}", s.stderr());
    let t = good(&old, "u", json!({}));
    assert_401(&with_token(&s, "/api/x", &t), Some(&t), "");
}

/// The URL fails after a first fetch (503, then connections dropped unanswered): the last
/// good set stays in force through several failed refreshes, and /readyz stays 200.
#[test]
fn the_last_good_set_stays_while_the_url_fails() {
    let up = EchoUpstream::start();
    let a = Signer::eddsa("ed-1");
    let jwks = JwksServer::start(jwt::jwks(&[&a]));
    let auth = format!(
        "[auth]\n{}",
        jwks_url_issuer(ISS, &jwks.url(), &["EdDSA"], "jwks_refresh = \"1s\"")
    );
    let s = Conf::new(&up, &auth).start();
    assert!(s.wait_for(Duration::from_secs(10), || {
        with_token(&s, "/api/x", &good(&a, "u", json!({}))).status == 200
    }));
    for (how, fail) in [
        ("503", JwksServer::fail as fn(&JwksServer)),
        ("no answer", JwksServer::go_silent),
    ] {
        fail(&jwks);
        let failed_from = jwks.fetches();
        let refreshed = s.wait_for(Duration::from_secs(15), || {
            jwks.fetches() >= failed_from + 2
        });
        assert!(
            refreshed,
            "{how}: sluice stopped refreshing every second ({} fetches since): {}",
            jwks.fetches() - failed_from,
            s.stderr()
        );
        for _ in 0..3 {
            // Fresh tokens (new jti): checked against the set, not remembered.
            let r = with_token(&s, "/api/x", &good(&a, "still", json!({})));
            assert_eq!(r.status, 200, "{}", r.body);
        }
        assert_eq!(http::get(s.admin, "/readyz", &[]).status, 200);
    }
    jwks.up();
}

/// A JWKS URL that has never answered is sluice's problem, not the client's: its tokens
/// get 503 with a problem body, /readyz answers 503, API keys still work; once the URL
/// answers (retried every few seconds), tokens pass and /readyz is 200.
#[test]
fn a_jwks_url_never_fetched_gives_503_until_it_answers() {
    let up = EchoUpstream::start();
    let a = Signer::es256("es-1");
    let jwks = JwksServer::start_failing(jwt::jwks(&[&a]));
    let auth = format!(
        "[auth]\n{}{}",
        jwks_url_issuer(ISS, &jwks.url(), &["ES256"], ""),
        consumers()
    );
    let s = Conf::new(&up, &auth).start();
    assert!(
        s.wait_for(Duration::from_secs(10), || jwks.fetches() >= 1),
        "sluice never tried the URL"
    );

    let r = with_token(&s, "/api/x", &good(&a, "u", json!({})));
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let body: Value = serde_json::from_str(&r.body).expect("a problem body");
    assert_eq!(body["status"], 503, "{body}");
    assert_eq!(http::get(s.admin, "/readyz", &[]).status, 503);
    assert_as(&with_key(&s, "/api/x", KEY_ACME), Some("acme"), "gold");
    assert_eq!(
        auth_metric(&s, "unavailable", "api"),
        1.0,
        "{}",
        s.metrics()
    );
    assert_eq!(
        s.metric(&format!("sluice_jwks_up{{issuer=\"{ISS}\"}}")),
        0.0
    );
    assert_eq!(up.hits(), 1);
    // The log says what holds meanwhile: there is no last good set to keep.
    let log = format!("{}{}", s.stdout(), s.stderr());
    assert!(log.contains("no key set yet"), "{log}");
    assert!(!log.contains("keeping the last good set"), "{log}");

    jwks.up();
    let ready = s.wait_for(Duration::from_secs(15), || {
        http::get(s.admin, "/readyz", &[]).status == 200
    });
    assert!(ready, "/readyz still not 200 after the URL answered");
    assert_as(
        &with_token(&s, "/api/x", &good(&a, "late", json!({}))),
        Some("late"),
        "",
    );
    assert_eq!(
        s.metric(&format!("sluice_jwks_up{{issuer=\"{ISS}\"}}")),
        1.0
    );
}

// ---------------------------------------------------------------------------------------
// API keys.

/// No credential on a required route gets the bare challenge; a key is valid only as
/// listed (by header or query), and every near miss of a real key (a character changed,
/// cut short, extended, upper-cased, the digest itself) is an unknown key. Routes with
/// auth off ask for nothing.
#[test]
fn api_keys_are_matched_exactly() {
    let up = EchoUpstream::start();
    let auth = format!(
        "[auth]\napi_key = [\"header:x-api-key\", \"query:api_key\"]\n{}",
        consumers()
    );
    let s = Conf::new(&up, &auth).start();

    assert_401(&s.get("/api/x"), None, "");
    assert_eq!(auth_metric(&s, "missing", "api"), 1.0);
    assert_as(&with_key(&s, "/api/x", KEY_ACME), Some("acme"), "gold");
    assert_as(
        &s.get(&format!("/api/x?api_key={KEY_ACME}")),
        Some("acme"),
        "gold",
    );
    assert_as(&with_key(&s, "/api/x", KEY_FREE), Some("freebie"), "free");
    let r = s.get("/open/x");
    assert_eq!(r.status, 200);
    assert_eq!(upstream_saw(&r, "x-consumer"), None);

    let mut changed = KEY_ACME.to_owned();
    changed.pop();
    changed.push('c');
    let digest = key_digest(KEY_ACME);
    let near_misses = [
        ("unknown", "sk_test_nobody_0000000000000".to_owned()),
        ("last character changed", changed),
        ("prefix", KEY_ACME[..KEY_ACME.len() - 1].to_owned()),
        ("suffix", format!("{KEY_ACME}0")),
        ("upper case", KEY_ACME.to_ascii_uppercase()),
        ("lower case", KEY_ACME.to_ascii_lowercase()),
        ("the digest", digest.clone()),
        ("the bare hex", digest["sha256:".len()..].to_owned()),
        ("two keys", format!("{KEY_ACME},{KEY_FREE}")),
    ];
    let hits = up.hits();
    for (what, key) in &near_misses {
        let r = with_key(&s, "/api/x", key);
        assert_eq!(r.status, 401, "{what}: {}", r.body);
        assert_401(&r, Some(key), "API key");
        let r = s.get(&format!("/api/x?api_key={key}"));
        assert_eq!(r.status, 401, "{what} in the query: {}", r.body);
    }
    assert_eq!(up.hits(), hits);
    assert_eq!(
        s.metric("sluice_consumers{source=\"config\"}"),
        2.0,
        "{}",
        s.metrics()
    );
}

/// Every credential presented must be valid, and a key and a token that name different
/// consumers are refused; naming the same consumer they pass.
#[test]
fn a_key_and_a_token_must_name_the_same_consumer() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let es = Signer::es256("es-1");
    // Its tokens name the consumers of API keys (DESIGN §17).
    let auth = format!(
        "[auth]\n{}{}",
        jwks_file_issuer(&dir, &[&es], &["ES256"], "consumers = \"match\""),
        consumers()
    );
    let s = Conf::new(&up, &auth).start();
    let acme_token = good(&es, "acme", json!({"plan": "gold"}));
    let auth_header = bearer(&acme_token);
    let both = |key: &str| {
        s.get_with(
            "/api/x",
            &[("x-api-key", key), ("Authorization", &auth_header)],
        )
    };
    assert_as(&both(KEY_ACME), Some("acme"), "gold");
    assert_eq!(
        both(KEY_FREE).status,
        401,
        "acme's token with freebie's key"
    );
    assert_eq!(
        both("sk_made_up_key_123456").status,
        401,
        "a valid token with a bad key"
    );
    let expired = es.sign(&claims(ISS, AUD, "acme", -3600, &json!({})));
    let r = s.get_with(
        "/api/x",
        &[
            ("x-api-key", KEY_ACME),
            ("Authorization", &bearer(&expired)),
        ],
    );
    assert_eq!(
        r.status, 401,
        "a valid key with an expired token: {}",
        r.body
    );
    assert_eq!(up.hits(), 1);
}

/// A thousand made-up keys against a policy keyed on the consumer: all 401, none reaches
/// the upstream, and none creates limiter state (the memory backend's key count does not
/// move; /v1/top knows only the real consumer).
#[test]
fn a_thousand_made_up_keys_get_401_and_no_bucket() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let auth = format!("[auth]\n{}", consumers());
    let policies = policy(
        "per_consumer",
        "fixed_window",
        100,
        "1h",
        "\"consumer\"",
        "",
    );
    let token = admin_token_file(&dir);
    let conf = Conf {
        admin: &token,
        policies: &policies,
        api: "\"per_consumer\"",
        ..Conf::new(&up, &auth)
    };
    let s = conf.start();
    assert_eq!(with_key(&s, "/api/x", KEY_ACME).status, 200);
    let keys_before = s.metric("sluice_memory_keys");
    assert!(keys_before >= 1.0, "{}", s.metrics());

    let refused = AtomicUsize::new(0);
    thread::scope(|scope| {
        for t in 0..4 {
            let (s, refused) = (&s, &refused);
            scope.spawn(move || {
                for i in 0..250 {
                    let key = format!("sk_live_{t}_{i:04}_{:08x}", rand::random::<u32>());
                    let r = with_key(s, "/api/x", &key);
                    if r.status == 401 {
                        refused.fetch_add(1, Ordering::SeqCst);
                    } else {
                        panic!("made-up key {key}: {} {}", r.status, r.body);
                    }
                }
            });
        }
    });
    assert_eq!(refused.load(Ordering::SeqCst), 1000);
    assert_eq!(up.hits(), 1, "a made-up key reached the upstream");
    assert_eq!(auth_metric(&s, "invalid", "api"), 1000.0);
    let keys_after = s.metric("sluice_memory_keys");
    assert_eq!(
        keys_after, keys_before,
        "made-up keys created limiter state"
    );
    let top = admin(&s, "GET", "/v1/top/per_consumer?n=50", "");
    assert_eq!(top.status, 200, "{}", top.body);
    let list: Value = serde_json::from_str(&top.body).expect("top JSON");
    let keys: Vec<&Value> = list
        .as_array()
        .expect("a list")
        .iter()
        .map(|e| &e["key"])
        .collect();
    assert_eq!(keys, [&json!(["acme"])], "{}", top.body);
}

// ---------------------------------------------------------------------------------------
// Limits and tiers on the verified identity.

/// A free-plan consumer that claims gold every way a client can (x-plan, x-consumer,
/// x-consumer-plan headers, a `plan` query) is still limited at the free numbers, and the
/// upstream sees its real name and plan, none of the client's copies; a gold consumer gets
/// the gold numbers. On a route with auth off the client's copies are removed too.
#[test]
fn a_free_consumer_cannot_claim_gold() {
    let up = EchoUpstream::start();
    let auth = format!("[auth]\nstrip_headers = [\"x-plan\"]\n{}", consumers());
    let policies = policy("tiers", "fixed_window", 3, "1h", "\"consumer\"", "")
        + "[[policies.tiers.overrides]]\nwhen = { plan = \"gold\" }\nlimit = 10\n";
    let conf = Conf {
        policies: &policies,
        api: "\"tiers\"",
        ..Conf::new(&up, &auth)
    };
    let s = conf.start();
    let forged = [
        ("x-api-key", KEY_FREE),
        ("x-plan", "gold"),
        ("x-consumer", "acme"),
        ("x-consumer-plan", "gold"),
    ];
    let r = s.get_with("/api/x?plan=gold", &forged);
    assert_as(&r, Some("freebie"), "free");
    assert_eq!(upstream_saw(&r, "x-plan"), None, "strip_headers");
    assert_eq!(
        common::admitted_until_rejected(&s, "/api/x?plan=gold", &forged, "tiers", 3, 20),
        2
    );

    let gold = [("x-api-key", KEY_ACME)];
    assert_eq!(
        common::admitted_until_rejected(&s, "/api/x", &gold, "tiers", 10, 20),
        10
    );

    let r = s.get_with(
        "/open/x",
        &[
            ("x-plan", "gold"),
            ("x-consumer", "acme"),
            ("x-consumer-plan", "gold"),
        ],
    );
    assert_eq!(r.status, 200);
    for name in ["x-plan", "x-consumer", "x-consumer-plan"] {
        assert_eq!(
            upstream_saw(&r, name),
            None,
            "{name} reached the upstream on auth = off"
        );
    }
}

/// On an `auth = "optional"` route, clients without a credential are anonymous: limited
/// per address (`on_missing = "client_ip"`) at the `plan = "anonymous"` override's numbers,
/// sent upstream with that plan and no consumer; a consumer gets its own bucket; an invalid
/// credential is a 401, never anonymous.
#[test]
fn anonymous_clients_are_limited_per_address_on_optional_routes() {
    let up = EchoUpstream::start();
    let auth = format!("[auth]\n{}", consumers());
    let policies = policy(
        "per_consumer",
        "fixed_window",
        5,
        "1h",
        "\"consumer\"",
        "on_missing = \"client_ip\"",
    )
        + "[[policies.per_consumer.overrides]]\nwhen = { plan = \"anonymous\" }\nlimit = 2\n";
    let conf = Conf {
        server: "access_log = \"off\"\ntrusted_proxies = [\"127.0.0.1/32\"]",
        policies: &policies,
        opt: "\"per_consumer\"",
        ..Conf::new(&up, &auth)
    };
    let s = conf.start();
    let one = [("x-forwarded-for", "198.51.100.1")];
    let two = [("x-forwarded-for", "198.51.100.2")];
    assert_as(&s.get_with("/opt/x", &one), None, "anonymous");
    assert_eq!(
        common::admitted_until_rejected(&s, "/opt/x", &one, "per_consumer", 2, 10),
        1
    );
    assert_eq!(
        common::admitted_until_rejected(&s, "/opt/x", &two, "per_consumer", 2, 10),
        2
    );
    let keyed = [("x-forwarded-for", "198.51.100.1"), ("x-api-key", KEY_FREE)];
    assert_eq!(
        common::admitted_until_rejected(&s, "/opt/x", &keyed, "per_consumer", 5, 10),
        5
    );
    // An anonymous client cannot pose as a consumer either.
    let r = s.get_with(
        "/opt/x",
        &[("x-forwarded-for", "198.51.100.3"), ("x-consumer", "acme")],
    );
    assert_as(&r, None, "anonymous");

    let bad = "sk_made_up_but_presented_1";
    let r = s.get_with(
        "/opt/x",
        &[("x-forwarded-for", "198.51.100.4"), ("x-api-key", bad)],
    );
    assert_401(&r, Some(bad), "API key");
    assert_eq!(auth_metric(&s, "anonymous", "opt"), 7.0, "{}", s.metrics());
}

/// `hide_credentials = true` keeps the API key (header or query) and the bearer token from
/// the upstream, the rest of the request unchanged; by default they pass.
#[test]
fn hide_credentials_keeps_the_credential_from_the_upstream() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let es = Signer::es256("es-1");
    let issuer = jwks_file_issuer(&dir, &[&es], &["ES256"], "consumers = \"match\"");
    let keys = "api_key = [\"header:x-api-key\", \"query:api_key\"]\n";
    let hidden = format!(
        "[auth]\n{keys}hide_credentials = true\n{issuer}{}",
        consumers()
    );
    let shown = format!("[auth]\n{keys}{issuer}{}", consumers());
    let s = Conf::new(&up, &hidden).start();
    let plain = Conf::new(&up, &shown).start();
    let token = good(&es, "acme", json!({}));

    let by_header = |s: &Sluice| {
        s.get_with(
            "/api/x?page=2",
            &[("x-api-key", KEY_ACME), ("x-other", "kept")],
        )
    };
    let r = by_header(&s);
    assert_as(&r, Some("acme"), "gold");
    assert_eq!(upstream_saw(&r, "x-api-key"), None);
    assert_eq!(upstream_saw(&r, "x-other").as_deref(), Some("kept"));
    assert_eq!(upstream_target(&r), "/api/x?page=2");
    assert_eq!(
        upstream_saw(&by_header(&plain), "x-api-key").as_deref(),
        Some(KEY_ACME)
    );

    let r = with_token(&s, "/api/x", &token);
    assert_eq!(upstream_saw(&r, "x-consumer").as_deref(), Some("acme"));
    assert_eq!(upstream_saw(&r, "authorization"), None);
    assert_eq!(
        upstream_saw(&with_token(&plain, "/api/x", &token), "authorization"),
        Some(bearer(&token))
    );

    let by_query = |s: &Sluice| s.get(&format!("/api/x?page=2&api_key={KEY_ACME}"));
    let r = by_query(&s);
    assert_as(&r, Some("acme"), "gold");
    assert!(
        !upstream_target(&r).contains(KEY_ACME),
        "the query's API key reached the upstream: {}",
        upstream_target(&r)
    );
    assert!(
        upstream_target(&r).contains("page=2"),
        "{}",
        upstream_target(&r)
    );
    assert!(upstream_target(&by_query(&plain)).contains(KEY_ACME));
}

/// The access log names the verified consumer.
#[test]
fn the_access_log_names_the_consumer() {
    let up = EchoUpstream::start();
    let auth = format!("[auth]\n{}", consumers());
    let conf = Conf {
        server: "access_log = \"json\"",
        ..Conf::new(&up, &auth)
    };
    let s = conf.start();
    assert_eq!(with_key(&s, "/api/logged", KEY_ACME).status, 200);
    let logged = s.wait_for(Duration::from_secs(5), || {
        s.stdout().lines().any(|l| {
            serde_json::from_str::<Value>(l)
                .is_ok_and(|v| v["consumer"] == "acme" && v.to_string().contains("/api/logged"))
        })
    });
    assert!(
        logged,
        "no access log line with consumer acme: {}",
        s.stdout()
    );
    assert!(
        !s.stdout().contains(KEY_ACME),
        "the access log shows the API key"
    );
}

// ---------------------------------------------------------------------------------------
// Bans on repeated failures.

fn ban_auth() -> String {
    format!(
        "[auth]\nmax_failures = {{ limit = 3, period = \"1m\", ban = \"10m\" }}\n{}",
        consumers()
    )
}

/// A 429 of the auth_failures ban, counting down from 10 minutes.
fn assert_banned(r: &Response) {
    assert_eq!(r.status, 429, "{:?} {}", r.headers, r.body);
    let retry: u64 = r
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("Retry-After");
    assert!((590..=600).contains(&retry), "Retry-After {retry}");
    let body: Value = serde_json::from_str(&r.body).expect("a problem body");
    assert_eq!(
        body["violated-policies"],
        json!(["auth_failures"]),
        "{body}"
    );
}

/// `max_failures`: missing credentials are not failures; the third invalid credential from
/// an address still gets its 401, and from then on the address gets 429 whatever it
/// presents, valid key included; another address is unaffected.
#[test]
fn repeated_invalid_credentials_ban_the_address() {
    let up = EchoUpstream::start();
    let auth = ban_auth();
    let conf = Conf {
        server: "access_log = \"off\"\ntrusted_proxies = [\"127.0.0.1/32\"]",
        ..Conf::new(&up, &auth)
    };
    let s = conf.start();
    let from = |ip: &'static str, key: Option<&'static str>| {
        let mut h = vec![("x-forwarded-for", ip)];
        if let Some(k) = key {
            h.push(("x-api-key", k));
        }
        s.get_with("/api/x", &h)
    };
    for _ in 0..5 {
        assert_401(&from("203.0.113.7", None), None, "");
    }
    assert_eq!(from("203.0.113.7", Some(KEY_ACME)).status, 200);
    for (i, bad) in ["sk_bad_one_11111", "sk_bad_two_22222", "sk_bad_three_333"]
        .iter()
        .enumerate()
    {
        let r = from("203.0.113.7", Some(bad));
        assert_eq!(r.status, 401, "failure {}: {}", i + 1, r.body);
    }
    let hits = up.hits();
    assert_banned(&from("203.0.113.7", Some(KEY_ACME)));
    assert_banned(&from("203.0.113.7", Some("sk_bad_four_4444")));
    assert_banned(&from("203.0.113.7", None));
    assert_eq!(up.hits(), hits);
    assert_eq!(from("203.0.113.8", Some(KEY_ACME)).status, 200);
    assert!(auth_metric(&s, "banned", "api") >= 3.0, "{}", s.metrics());
}

/// An IPv6 client is banned by its network (`[server] ipv6_prefix`, 64 by default): the
/// rest of its /64 cannot keep guessing; the next /64 is another client. With 128, one
/// address is one client again.
#[test]
fn a_ban_covers_an_ipv6_clients_network() {
    let up = EchoUpstream::start();
    let auth = ban_auth();
    for (prefix, sibling_banned) in [("", true), ("ipv6_prefix = 128", false)] {
        let server =
            format!("access_log = \"off\"\ntrusted_proxies = [\"127.0.0.1/32\"]\n{prefix}");
        let conf = Conf {
            server: &server,
            ..Conf::new(&up, &auth)
        };
        let s = conf.start();
        let from = |ip: &str, key: &str| {
            s.get_with("/api/x", &[("x-forwarded-for", ip), ("x-api-key", key)])
        };
        for (i, bad) in ["sk_bad_one_11111", "sk_bad_two_22222", "sk_bad_three_333"]
            .iter()
            .enumerate()
        {
            // Each guess from another address of the same /64.
            let r = from(&format!("2001:db8:1:2::{}", i + 1), bad);
            assert_eq!(r.status, 401, "{prefix}: failure {}: {}", i + 1, r.body);
        }
        let sibling = from("2001:db8:1:2:ffff:ffff:ffff:fffe", KEY_ACME);
        if sibling_banned {
            assert_banned(&sibling);
        } else {
            assert_eq!(sibling.status, 200, "{prefix}: {}", sibling.body);
        }
        assert_eq!(
            from("2001:db8:1:3::1", KEY_ACME).status,
            200,
            "{prefix}: the next /64"
        );
    }
}

/// With Redis the ban is fleet-wide: the address that failed on one instance is refused by
/// another within a second.
#[test]
fn a_failure_ban_reaches_the_fleet_on_redis() {
    let redis = RedisServer::start();
    let up = EchoUpstream::start();
    let auth = ban_auth();
    let limiter = format!(
        "backend = \"redis\"\nurl = \"{}\"\ntimeout = \"500ms\"",
        redis.url()
    );
    let conf = Conf {
        limiter: &limiter,
        ..Conf::new(&up, &auth)
    };
    let (a, b) = (conf.start(), conf.start());
    assert_eq!(with_key(&b, "/api/x", KEY_ACME).status, 200);
    for bad in ["sk_bad_one_11111", "sk_bad_two_22222", "sk_bad_three_333"] {
        assert_eq!(with_key(&a, "/api/x", bad).status, 401);
    }
    let banned_at = Instant::now();
    let refused = b.wait_for(Duration::from_secs(1), || {
        with_key(&b, "/api/x", KEY_ACME).status == 429
    });
    assert!(
        refused,
        "instance b still admits the banned address after 1 s"
    );
    assert!(banned_at.elapsed() <= Duration::from_millis(1_500));
    assert_banned(&with_key(&b, "/api/x", KEY_ACME));
    assert_banned(&with_key(&a, "/api/x", KEY_ACME));
}

// ---------------------------------------------------------------------------------------
// Runtime consumers.

fn consumer_list(s: &Sluice) -> Vec<Value> {
    let r = admin(s, "GET", "/v1/consumers", "");
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).expect("a JSON list");
    v.as_array().expect("a list").clone()
}

fn listed<'a>(list: &'a [Value], name: &str) -> Option<&'a Value> {
    list.iter().find(|c| c["name"] == name)
}

/// Creates runtime consumer `name` with `plan` and one key through `s`: (key id, key).
fn create_with_key(s: &Sluice, name: &str, plan: &str) -> (String, String) {
    let put = admin(
        s,
        "PUT",
        &format!("/v1/consumers/{name}"),
        &json!({"plan": plan}).to_string(),
    );
    assert_eq!(put.status, 200, "{}", put.body);
    let post = admin(s, "POST", &format!("/v1/consumers/{name}/keys"), "");
    assert_eq!(post.status, 201, "{}", post.body);
    let created: Value = serde_json::from_str(&post.body).expect("a JSON key");
    let id = created["id"].as_str().expect("an id").to_owned();
    let key = created["key"].as_str().expect("a key").to_owned();
    assert!(key.starts_with("sk_"), "{key}");
    (id, key)
}

/// Runtime consumers on one instance (memory): created with a plan and a key shown once,
/// listed beside the config's, usable at once; a revoked key is refused; a deleted consumer
/// takes its keys along; the config's consumers cannot be changed or deleted (409).
#[test]
fn runtime_consumers_and_keys_through_the_admin_api() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let auth = format!("[auth]\n{}", consumers());
    let token = admin_token_file(&dir);
    let conf = Conf {
        admin: &token,
        ..Conf::new(&up, &auth)
    };
    let s = conf.start();
    let (id, key) = create_with_key(&s, "newco", "gold");
    let (_, second) = {
        let post = admin(&s, "POST", "/v1/consumers/newco/keys", "");
        assert_eq!(post.status, 201, "{}", post.body);
        let v: Value = serde_json::from_str(&post.body).expect("JSON");
        (
            v["id"].as_str().unwrap_or("").to_owned(),
            v["key"].as_str().unwrap_or("").to_owned(),
        )
    };
    assert_ne!(key, second);
    assert!(
        key.len() >= 3 + 43,
        "a 256-bit key is at least 43 base64 characters: {key}"
    );

    let list = consumer_list(&s);
    let newco = listed(&list, "newco").expect("newco listed");
    assert_eq!(
        (&newco["plan"], &newco["keys"], &newco["source"]),
        (&json!("gold"), &json!(2), &json!("runtime"))
    );
    let acme = listed(&list, "acme").expect("acme listed");
    assert_eq!(
        (&acme["plan"], &acme["keys"], &acme["source"]),
        (&json!("gold"), &json!(1), &json!("config"))
    );
    assert!(
        !list.iter().any(|c| c.to_string().contains(&key)),
        "the listing shows a key"
    );
    assert_eq!(
        s.metric("sluice_consumers{source=\"runtime\"}"),
        1.0,
        "{}",
        s.metrics()
    );

    assert_as(&with_key(&s, "/api/x", &key), Some("newco"), "gold");
    assert_as(&with_key(&s, "/api/x", &second), Some("newco"), "gold");
    // A plan change applies to the keys it has.
    let put = admin(
        &s,
        "PUT",
        "/v1/consumers/newco",
        &json!({"plan": "silver"}).to_string(),
    );
    assert_eq!(put.status, 200, "{}", put.body);
    assert!(s.wait_for(Duration::from_secs(1), || {
        upstream_saw(&with_key(&s, "/api/x", &key), "x-consumer-plan").as_deref() == Some("silver")
    }));

    let revoke = admin(&s, "DELETE", &format!("/v1/consumers/newco/keys/{id}"), "");
    assert_eq!(revoke.status, 204, "{}", revoke.body);
    assert!(
        s.wait_for(Duration::from_secs(1), || with_key(&s, "/api/x", &key)
            .status
            == 401)
    );
    assert_eq!(with_key(&s, "/api/x", &second).status, 200);

    assert_eq!(admin(&s, "DELETE", "/v1/consumers/newco", "").status, 204);
    assert!(
        s.wait_for(Duration::from_secs(1), || with_key(&s, "/api/x", &second)
            .status
            == 401)
    );
    assert!(listed(&consumer_list(&s), "newco").is_none());

    for (method, path, body) in [
        ("PUT", "/v1/consumers/acme", "{\"plan\": \"free\"}"),
        ("DELETE", "/v1/consumers/acme", ""),
        ("POST", "/v1/consumers/acme/keys", ""),
    ] {
        let r = admin(&s, method, path, body);
        assert_eq!(r.status, 409, "{method} {path}: {}", r.body);
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
    }
    assert_as(&with_key(&s, "/api/x", KEY_ACME), Some("acme"), "gold");
    // The admin API needs its own token.
    let r = http::request(s.admin, "GET", "/v1/consumers", &[], "");
    assert_eq!(r.status, 401);
}

/// With Redis, runtime keys are fleet-wide: a key created on instance A works on B within
/// a second, and revoked on B it is refused on A within a second.
#[test]
fn a_runtime_key_works_and_is_revoked_across_the_fleet() {
    let redis = RedisServer::start();
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let auth = format!("[auth]\n{}", consumers());
    let token = admin_token_file(&dir);
    let limiter = format!(
        "backend = \"redis\"\nurl = \"{}\"\ntimeout = \"500ms\"",
        redis.url()
    );
    let conf = Conf {
        admin: &token,
        limiter: &limiter,
        ..Conf::new(&up, &auth)
    };
    let (a, b) = (conf.start(), conf.start());
    let (id, key) = create_with_key(&a, "fleetco", "gold");
    let started = Instant::now();
    assert!(
        b.wait_for(Duration::from_secs(1), || with_key(&b, "/api/x", &key)
            .status
            == 200),
        "B does not know A's new key after {:?}",
        started.elapsed()
    );
    assert_as(&with_key(&b, "/api/x", &key), Some("fleetco"), "gold");
    assert!(listed(&consumer_list(&b), "fleetco").is_some_and(|c| c["source"] == "runtime"));
    assert_eq!(with_key(&a, "/api/x", &key).status, 200);

    let revoke = admin(
        &b,
        "DELETE",
        &format!("/v1/consumers/fleetco/keys/{id}"),
        "",
    );
    assert_eq!(revoke.status, 204, "{}", revoke.body);
    let started = Instant::now();
    assert!(
        a.wait_for(Duration::from_secs(1), || with_key(&a, "/api/x", &key)
            .status
            == 401),
        "A still accepts the key revoked on B after {:?}",
        started.elapsed()
    );
    assert_eq!(with_key(&b, "/api/x", &key).status, 401);

    // A third instance started now knows the fleet's consumers.
    let (_, key2) = {
        let post = admin(&a, "POST", "/v1/consumers/fleetco/keys", "");
        assert_eq!(post.status, 201, "{}", post.body);
        let v: Value = serde_json::from_str(&post.body).expect("JSON");
        (
            v["id"].as_str().unwrap_or("").to_owned(),
            v["key"].as_str().unwrap_or("").to_owned(),
        )
    };
    let c = conf.start();
    assert!(
        c.wait_for(Duration::from_secs(2), || with_key(&c, "/api/x", &key2)
            .status
            == 200)
    );
    assert_eq!(with_key(&c, "/api/x", &key).status, 401);
}

// ---------------------------------------------------------------------------------------
// gRPC.

/// A gRPC call (h2c) that fails auth gets HTTP 200 with `grpc-status` 16
/// (UNAUTHENTICATED), without a credential and with a bad one.
#[test]
fn grpc_calls_that_fail_auth_get_unauthenticated() {
    let up = EchoUpstream::start();
    let auth = format!("[auth]\n{}", consumers());
    let conf = Conf {
        server: "access_log = \"off\"\nh2c = true",
        ..Conf::new(&up, &auth)
    };
    let s = conf.start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let answers = rt.block_on(async {
        let tcp = tokio::net::TcpStream::connect(s.addr)
            .await
            .expect("connect");
        let (send, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
        let driver = tokio::spawn(connection);
        let mut answers = Vec::new();
        for key in [None, Some("sk_not_a_real_key_999")] {
            let mut req = ::http::Request::post(format!("http://{}/api/pkg.Svc/Call", s.addr))
                .header("content-type", "application/grpc")
                .header("te", "trailers");
            if let Some(k) = key {
                req = req.header("x-api-key", k);
            }
            let req = req.body(()).expect("a request");
            let mut send = send.clone().ready().await.expect("a stream slot");
            let (response, mut body_out) = send.send_request(req, false).expect("send");
            // One empty gRPC message: no compression flag, length 0.
            body_out
                .send_data(bytes::Bytes::from_static(&[0, 0, 0, 0, 0]), true)
                .expect("send the message");
            let (parts, mut body) = response.await.expect("a response").into_parts();
            let mut status: Option<String> = parts
                .headers
                .get("grpc-status")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            while let Some(chunk) = body.data().await {
                let chunk = chunk.expect("body data");
                let _ = body.flow_control().release_capacity(chunk.len());
            }
            if let Ok(Some(trailers)) = body.trailers().await {
                if let Some(v) = trailers.get("grpc-status").and_then(|v| v.to_str().ok()) {
                    status = Some(v.to_owned());
                }
            }
            answers.push((parts.status.as_u16(), status));
        }
        drop(send);
        driver.abort();
        answers
    });
    for (status, grpc_status) in answers {
        assert_eq!(status, 200);
        assert_eq!(grpc_status.as_deref(), Some("16"));
    }
    assert_eq!(up.hits(), 0);
}

// ---------------------------------------------------------------------------------------
// Reload.

/// Consumers from `consumer_files` are read with the config and again on every reload: a
/// consumer added to a file passes after SIGHUP, one removed is refused.
#[test]
fn consumer_files_are_read_again_on_reload() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let files = dir.0.join("consumers.d");
    std::fs::create_dir_all(&files).expect("consumers.d");
    std::fs::write(
        files.join("acme.toml"),
        format!(
            "[[consumers]]\nname = \"acme\"\nplan = \"gold\"\nkeys = [\"{}\"]\n",
            key_digest(KEY_ACME)
        ),
    )
    .expect("write acme.toml");
    let auth = format!(
        "[auth]\nconsumer_files = [\"{}/*.toml\"]\n",
        files.display()
    );
    let conf = Conf::new(&up, &auth);
    let s = conf.start();
    assert_as(&with_key(&s, "/api/x", KEY_ACME), Some("acme"), "gold");
    assert_eq!(with_key(&s, "/api/x", KEY_FREE).status, 401);

    std::fs::write(
        files.join("freebie.toml"),
        format!(
            "[[consumers]]\nname = \"freebie\"\nplan = \"free\"\nkeys = [\"{}\"]\n",
            key_digest(KEY_FREE)
        ),
    )
    .expect("write freebie.toml");
    std::fs::remove_file(files.join("acme.toml")).expect("remove acme.toml");
    s.reload(&conf.render());
    assert!(
        s.wait_for(Duration::from_secs(5), || with_key(&s, "/api/x", KEY_FREE)
            .status
            == 200),
        "the added consumer was not loaded: {}",
        s.stderr()
    );
    assert_eq!(with_key(&s, "/api/x", KEY_ACME).status, 401);
}

// ---------------------------------------------------------------------------------------
// More key parts and the CLI.

/// `claim:NAME` keys a policy on a claim of the verified token: two users of one `org`
/// share its bucket, another org has its own, and a client cannot set the part by header.
#[test]
fn a_claim_keys_a_policy() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let es = Signer::es256("es-1");
    let auth = format!("[auth]\n{}", jwks_file_issuer(&dir, &[&es], &["ES256"], ""));
    let policies = policy("per_org", "fixed_window", 3, "1h", "\"claim:org\"", "");
    let conf = Conf {
        policies: &policies,
        api: "\"per_org\"",
        ..Conf::new(&up, &auth)
    };
    let s = conf.start();
    let token = |sub: &str, org: &str| good(&es, sub, json!({"org": org}));
    let (alice, bob, carol) = (
        bearer(&token("alice", "org-1")),
        bearer(&token("bob", "org-1")),
        bearer(&token("carol", "org-2")),
    );
    assert_eq!(
        s.get_with("/api/x", &[("Authorization", &alice)]).status,
        200
    );
    assert_eq!(s.get_with("/api/x", &[("Authorization", &bob)]).status, 200);
    // bob, claiming another org by header, still counts against org-1.
    let r = s.get_with(
        "/api/x",
        &[
            ("Authorization", &bob),
            ("org", "org-9"),
            ("x-org", "org-9"),
        ],
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        s.get_with("/api/x", &[("Authorization", &alice)]).status,
        429
    );
    assert_eq!(
        common::admitted_until_rejected(
            &s,
            "/api/x",
            &[("Authorization", &carol)],
            "per_org",
            3,
            10
        ),
        3
    );
}

/// A key of two parts cannot be imitated by values that carry the separator (DESIGN §21):
/// `team = "a\0b", org = "c"` and `team = "a", org = "b\0c"` are two keys, not one, so a
/// token whose claims a client's own identity provider lets it write cannot spend (or
/// escape into) another tenant's count.
#[test]
fn claims_that_carry_a_nul_do_not_imitate_another_key() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let es = Signer::es256("es-1");
    let auth = format!("[auth]\n{}", jwks_file_issuer(&dir, &[&es], &["ES256"], ""));
    let policies = policy(
        "per_team_org",
        "fixed_window",
        2,
        "1h",
        "\"claim:team\", \"claim:org\"",
        "",
    );
    let conf = Conf {
        policies: &policies,
        api: "\"per_team_org\"",
        ..Conf::new(&up, &auth)
    };
    let s = conf.start();
    let token = |sub: &str, team: &str, org: &str| {
        bearer(&good(&es, sub, json!({"team": team, "org": org})))
    };
    let (a, b) = (token("a", "a\0b", "c"), token("b", "a", "b\0c"));
    for _ in 0..2 {
        assert_eq!(s.get_with("/api/x", &[("Authorization", &a)]).status, 200);
    }
    assert_eq!(s.get_with("/api/x", &[("Authorization", &a)]).status, 429);
    assert_eq!(
        s.get_with("/api/x", &[("Authorization", &b)]).status,
        200,
        "the other key's count is its own"
    );
}

/// `sluice admin …` with the config file: create a runtime consumer with a plan, a key for
/// it (shown once), list consumers, revoke the key, delete the consumer.
#[test]
fn the_admin_cli_manages_consumers_and_keys() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let auth = format!("[auth]\n{}", consumers());
    let token = admin_token_file(&dir);
    let conf = Conf {
        admin: &token,
        ..Conf::new(&up, &auth)
    };
    let s = conf.start();
    let cli = |args: &[&str]| s.admin_cli(args);
    let (ok, out, err) = cli(&["consumer", "clico", "--plan", "gold"]);
    assert!(ok, "{out}{err}");
    let (ok, out, err) = cli(&["key", "create", "clico"]);
    assert!(ok, "{out}{err}");
    let created: Value = serde_json::from_str(&out).expect("the new key as JSON");
    let (id, key) = (
        created["id"].as_str().expect("an id").to_owned(),
        created["key"].as_str().expect("a key").to_owned(),
    );
    assert_as(&with_key(&s, "/api/x", &key), Some("clico"), "gold");

    let (ok, out, err) = cli(&["consumers"]);
    assert!(ok, "{err}");
    let list: Value = serde_json::from_str(&out).expect("consumers as JSON");
    let list = list.as_array().expect("a list");
    assert!(
        listed(list, "clico").is_some_and(|c| c["source"] == "runtime"),
        "{out}"
    );
    assert!(
        listed(list, "acme").is_some_and(|c| c["source"] == "config"),
        "{out}"
    );
    assert!(!out.contains(&key), "the listing shows the key");

    let (ok, out, err) = cli(&["key", "revoke", "clico", &id]);
    assert!(ok, "{out}{err}");
    assert!(
        s.wait_for(Duration::from_secs(1), || with_key(&s, "/api/x", &key)
            .status
            == 401)
    );
    let (ok, out, err) = cli(&["consumer", "clico", "--delete"]);
    assert!(ok, "{out}{err}");
    assert!(listed(&consumer_list(&s), "clico").is_none());
    // The config's consumers are not the CLI's to change: exit 1, 409 on stderr.
    let (ok, _, err) = cli(&["consumer", "acme", "--delete"]);
    assert!(!ok && err.contains("409"), "{err}");
}

//! Identity and credentials against a hostile client (DESIGN §17): identity headers in
//! every spelling are removed, every credential presented is checked and all must name one
//! consumer, and a token's consumer stays inside its issuer (`consumer_prefix`,
//! `consumers = "match"`, claims that could pose as an address or as `anonymous`). Hostile
//! requests are written as raw bytes; keys and tokens are generated when the test runs.

mod common;

use std::net::SocketAddr;

use common::echo::{upstream_target, EchoUpstream};
use common::http::{self, Response};
use common::jwt::{claims, key_digest, Signer};
use common::{Sluice, TempDir};
use serde_json::{json, Value};

const ISS: &str = "https://idp.test/";
const AUD: &str = "api";
const ADMIN_TOKEN: &str = "admin-t0ken-for-identity-tests";
/// acme's API key (plan gold) and freebie's (plan free).
const KEY_ACME: &str = "sk_test_acme_9Fw3XqL2mZ8rTb1V";
const KEY_FREE: &str = "sk_test_free_4Kd7YnP0sQ5hJu2C";

/// A config over the echo upstream `up`: `[auth]` with `auth` lines (API keys from the
/// `x-api-key` header and the `api_key` query parameter, `strip_headers = ["x-plan"]`),
/// acme and freebie as consumers, `policies` with `api` the policy list of `/api/`; routes
/// `/api/` (auth required), `/opt/` (optional) and `/open/` (off); h2c on; the admin API
/// with a token file in `dir`.
fn config(up: &EchoUpstream, dir: &TempDir, auth: &str, policies: &str, api: &str) -> String {
    let token_file = dir.0.join("admin-token");
    std::fs::write(&token_file, format!("{ADMIN_TOKEN}\n")).expect("write the admin token");
    format!(
        "[server]\nlisten = [\"{{listen}}\"]\naccess_log = \"off\"\nh2c = true\n\
         [admin]\nlisten = \"{{admin}}\"\ntoken_file = \"{token}\"\n\
         [auth]\napi_key = [\"header:x-api-key\", \"query:api_key\"]\nstrip_headers = [\"x-plan\"]\n{auth}\n\
         [[consumers]]\nname = \"acme\"\nplan = \"gold\"\nkeys = [\"{acme}\"]\n\
         [[consumers]]\nname = \"freebie\"\nplan = \"free\"\nkeys = [\"{free}\"]\n\
         {policies}\n[upstreams.up]\nservers = [\"{addr}\"]\n\
         [[routes]]\nname = \"api\"\npath_prefix = \"/api/\"\nupstream = \"up\"\nauth = \"required\"\npolicies = [{api}]\n\
         [[routes]]\nname = \"opt\"\npath_prefix = \"/opt/\"\nupstream = \"up\"\nauth = \"optional\"\n\
         [[routes]]\nname = \"open\"\npath_prefix = \"/open/\"\nupstream = \"up\"\n",
        token = token_file.display(),
        acme = key_digest(KEY_ACME),
        free = key_digest(KEY_FREE),
        addr = up.addr,
    )
}

/// An `[[auth.jwt]]` issuer `iss` whose keys (`signer`'s) are in a JWKS file in `dir`, with
/// `plan_claim = "plan"` and `extra` lines.
fn issuer(dir: &TempDir, iss: &str, signer: &Signer, extra: &str) -> String {
    let file = dir.0.join(format!("{}.jwks.json", signer.kid));
    std::fs::write(&file, common::jwt::jwks(&[signer]).to_string()).expect("write the JWKS");
    format!(
        "[[auth.jwt]]\nissuer = \"{iss}\"\naudiences = [\"{AUD}\"]\nalgorithms = [\"ES256\"]\njwks_file = \"{}\"\nplan_claim = \"plan\"\n{extra}\n",
        file.display()
    )
}

/// A token of `iss` for AUD naming `sub` (a string or any JSON value), valid for 5 minutes,
/// with `extra` claims.
fn token(signer: &Signer, iss: &str, sub: Value, extra: Value) -> String {
    let mut c = claims(iss, AUD, "", 300, &extra);
    c["sub"] = sub;
    signer.sign(&c)
}

/// GET `target` as raw bytes with the header lines `lines`, exactly as written.
fn raw(addr: SocketAddr, target: &str, lines: &[String]) -> Response {
    let mut req = format!("GET {target} HTTP/1.1\r\nHost: localhost\r\n");
    for line in lines {
        req.push_str(line);
        req.push_str("\r\n");
    }
    req.push_str("Connection: close\r\n\r\n");
    http::parse(&http::send_raw(addr, req.as_bytes()).expect("an answer"))
}

fn admin(s: &Sluice, method: &str, path: &str, body: &str) -> Response {
    let auth = format!("Bearer {ADMIN_TOKEN}");
    http::request(s.admin, method, path, &[("Authorization", &auth)], body)
}

/// A header name as CGI, WSGI, Rack and PHP read it: case ignored, `_` taken as `-`.
fn folded(name: &str) -> String {
    name.to_ascii_lowercase().replace('_', "-")
}

/// Every header the upstream received whose name folds to one of `names`, as (name as
/// received, value), sorted.
fn upstream_saw_folded(r: &Response, names: &[&str]) -> Vec<(String, String)> {
    let v: Value = serde_json::from_str(&r.body)
        .unwrap_or_else(|e| panic!("not an echo ({e}): {} {}", r.status, r.body));
    let mut out: Vec<(String, String)> = v["headers"]
        .as_object()
        .expect("the echo's headers")
        .iter()
        .filter(|(k, _)| names.contains(&folded(k).as_str()))
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
        .collect();
    out.sort();
    out
}

const IDENTITY: [&str; 3] = ["x-consumer", "x-consumer-plan", "x-plan"];

/// What reached the upstream under an identity name in any spelling, as
/// ("name", "value") pairs written by sluice.
fn identity_seen(r: &Response) -> Vec<(String, String)> {
    assert_eq!(r.status, 200, "{:?} {}", r.headers, r.body);
    upstream_saw_folded(r, &IDENTITY)
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A 401 as §11 makes it for a presented credential: the Bearer challenge with
/// `error="invalid_token"`, a problem+json body whose detail mentions `word`, and none of
/// `credentials` anywhere in the answer.
fn assert_401(r: &Response, credentials: &[&str], word: &str) {
    assert_eq!(r.status, 401, "{:?} {}", r.headers, r.body);
    assert_eq!(
        r.header("www-authenticate"),
        Some("Bearer realm=\"sluice\", error=\"invalid_token\""),
        "{}",
        r.body
    );
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let body: Value = serde_json::from_str(&r.body).expect("a JSON problem body");
    assert_eq!(body["status"], 401, "{body}");
    let detail = body["detail"]
        .as_str()
        .expect("a detail")
        .to_ascii_lowercase();
    assert!(
        detail.contains(&word.to_ascii_lowercase()),
        "detail {detail:?} should mention {word:?}"
    );
    for c in credentials.iter().filter(|c| c.len() >= 8) {
        assert!(
            !r.body.contains(c),
            "the 401 echoes a credential: {}",
            r.body
        );
        assert!(
            r.headers.values().all(|v| !v.contains(c)),
            "a header echoes a credential: {:?}",
            r.headers
        );
    }
}

/// The forged identity headers, each in several spellings a CGI/WSGI/Rack/PHP upstream
/// reads as one variable.
fn forged_spellings() -> Vec<String> {
    [
        "X_Consumer: mallory",
        "x_consumer: mallory-2",
        "X-CONSUMER: mallory-3",
        "x-Consumer: mallory-4",
        "x_consumer_plan: gold",
        "X_Consumer-Plan: gold",
        "x-consumer_plan: gold",
        "X-CONSUMER-PLAN: gold",
        "X_Plan: gold",
        "x_PLAN: gold",
        "X-Plan: gold",
    ]
    .map(String::from)
    .to_vec()
}

// ---------------------------------------------------------------------------------------
// Identity headers in every spelling.

/// `X_Consumer`, `x_consumer_plan`, `X_Plan` and every other spelling of the protected
/// names (case ignored, `_` as `-`) never reach the upstream: on a route with auth off, on
/// an optional route without a credential, and on a required route with a key, where the
/// upstream sees exactly the verified values sluice set.
#[test]
fn identity_headers_in_every_spelling_are_removed_on_every_route() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let s = Sluice::start(&config(&up, &dir, "", "", ""));
    let forged = forged_spellings();

    let r = raw(s.addr, "/open/x", &forged);
    assert_eq!(identity_seen(&r), pairs(&[]), "auth off: {}", r.body);

    let r = raw(s.addr, "/opt/x", &forged);
    assert_eq!(
        identity_seen(&r),
        pairs(&[("x-consumer-plan", "anonymous")]),
        "anonymous: {}",
        r.body
    );

    let mut keyed = forged.clone();
    keyed.push(format!("x-api-key: {KEY_FREE}"));
    let r = raw(s.addr, "/api/x", &keyed);
    assert_eq!(
        identity_seen(&r),
        pairs(&[("x-consumer", "freebie"), ("x-consumer-plan", "free")]),
        "authenticated: {}",
        r.body
    );

    // A name that only resembles a protected one is passed on.
    let r = raw(
        s.addr,
        "/open/x",
        &["x-consumers: kept".into(), "x__consumer: kept".into()],
    );
    assert_eq!(
        upstream_saw_folded(&r, &["x-consumers", "x--consumer"]),
        pairs(&[("x-consumers", "kept"), ("x__consumer", "kept")])
    );
}

/// The same over HTTP/2 (h2c): header names there are lower case, and `_` still folds.
#[test]
fn identity_headers_in_every_spelling_are_removed_over_http2() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let s = Sluice::start(&config(&up, &dir, "", "", ""));
    let forged = [
        ("x_consumer", "mallory"),
        ("x_consumer_plan", "gold"),
        ("x-consumer_plan", "gold"),
        ("x_plan", "gold"),
    ];
    let answers = h2_get(
        s.addr,
        &[
            ("/open/x", forged.to_vec()),
            ("/opt/x", forged.to_vec()),
            ("/api/x", [&forged[..], &[("x_api_key", KEY_ACME)]].concat()),
        ],
    );
    assert_eq!(identity_seen(&answers[0]), pairs(&[]));
    assert_eq!(
        identity_seen(&answers[1]),
        pairs(&[("x-consumer-plan", "anonymous")])
    );
    assert_eq!(
        identity_seen(&answers[2]),
        pairs(&[("x-consumer", "acme"), ("x-consumer-plan", "gold")])
    );
}

/// GETs over one prior-knowledge HTTP/2 connection with the Rust `h2` client, one after the
/// other: (path, headers) each; the answers as `Response`s.
fn h2_get(addr: SocketAddr, requests: &[(&str, Vec<(&str, &str)>)]) -> Vec<Response> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    rt.block_on(async {
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (send, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
        let driver = tokio::spawn(connection);
        let mut out = Vec::new();
        for (path, headers) in requests {
            let mut req = ::http::Request::get(format!("http://{addr}{path}"));
            for (k, v) in headers {
                req = req.header(*k, *v);
            }
            let req = req.body(()).expect("a request");
            let mut send = send.clone().ready().await.expect("a stream slot");
            let (response, _) = send.send_request(req, true).expect("send");
            let (parts, mut body) = response.await.expect("a response").into_parts();
            let mut data = Vec::new();
            while let Some(chunk) = body.data().await {
                let chunk = chunk.expect("body data");
                let _ = body.flow_control().release_capacity(chunk.len());
                data.extend_from_slice(&chunk);
            }
            out.push(Response {
                status: parts.status.as_u16(),
                headers: parts
                    .headers
                    .iter()
                    .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("").to_owned()))
                    .collect(),
                body: String::from_utf8_lossy(&data).into_owned(),
            });
        }
        drop(send);
        driver.abort();
        out
    })
}

/// An API key sent as `X_Api_Key` (or `X-API-KEY`) is read as `x-api-key` would be: a
/// valid one is its consumer, an unknown one is a 401, even beside a valid `x-api-key`.
#[test]
fn an_api_key_in_another_spelling_is_read_as_the_key() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let s = Sluice::start(&config(&up, &dir, "", "", ""));
    for name in ["X_Api_Key", "x_api_key", "X-API-KEY", "x-api_key"] {
        let r = raw(s.addr, "/api/x", &[format!("{name}: {KEY_ACME}")]);
        assert_eq!(
            identity_seen(&r),
            pairs(&[("x-consumer", "acme"), ("x-consumer-plan", "gold")]),
            "{name}"
        );
    }
    let made_up = "sk_made_up_underscored_key_1";
    let r = raw(
        s.addr,
        "/api/x",
        &[
            format!("x-api-key: {KEY_ACME}"),
            format!("X_Api_Key: {made_up}"),
        ],
    );
    assert_401(&r, &[KEY_ACME, made_up], "API key");
    let r = raw(
        s.addr,
        "/opt/x",
        &[
            format!("x-api-key: {KEY_ACME}"),
            format!("x_api_key: {KEY_FREE}"),
        ],
    );
    assert_401(&r, &[KEY_ACME, KEY_FREE], "different consumers");
    assert_eq!(up.hits(), 4);
}

// ---------------------------------------------------------------------------------------
// Every credential is checked.

/// Every `api_key` source, every copy of each, and every `Authorization` header is read:
/// one unknown credential, or two that name different consumers, is a 401 whatever valid
/// credential comes with it; a query parameter's name is compared percent-decoded. The
/// same consumer twice is served.
#[test]
fn every_credential_must_be_valid_and_name_one_consumer() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let es = Signer::es256("es-1");
    let s = Sluice::start(&config(&up, &dir, &issuer(&dir, ISS, &es, ""), "", ""));
    let unknown = "sk_unknown_but_presented_7";
    let (alice, bob) = (
        token(&es, ISS, json!("alice"), json!({})),
        token(&es, ISS, json!("bob"), json!({})),
    );
    let key = |k: &str| format!("x-api-key: {k}");
    let bearer = |t: &str| format!("Authorization: Bearer {t}");

    let refused: Vec<(&str, String, Vec<String>, &str)> = vec![
        (
            "a valid header beside an unknown query key",
            format!("/api/x?api_key={unknown}"),
            vec![key(KEY_ACME)],
            "API key",
        ),
        (
            "a valid header beside another consumer's query key",
            format!("/api/x?api_key={KEY_FREE}"),
            vec![key(KEY_ACME)],
            "different consumers",
        ),
        (
            "a valid header beside an unknown percent-encoded query name",
            format!("/api/x?api%5Fkey={unknown}"),
            vec![key(KEY_ACME)],
            "API key",
        ),
        (
            "a valid header beside a lower-case percent-encoded query name",
            format!("/api/x?page=1&api%5fkey={KEY_FREE}"),
            vec![key(KEY_ACME)],
            "different consumers",
        ),
        (
            "a valid query key, then an unknown one",
            format!("/api/x?api_key={KEY_ACME}&api_key={unknown}"),
            vec![],
            "API key",
        ),
        (
            "a valid header, then an unknown one",
            "/api/x".into(),
            vec![key(KEY_ACME), key(unknown)],
            "API key",
        ),
        (
            "two consumers' keys in two headers",
            "/opt/x".into(),
            vec![key(KEY_ACME), key(KEY_FREE)],
            "different consumers",
        ),
        (
            "a valid token, then a broken one",
            "/api/x".into(),
            vec![bearer(&alice), bearer("aaaa.bbbb.cccc")],
            "malformed",
        ),
        (
            "two valid tokens of different consumers",
            "/opt/x".into(),
            vec![bearer(&alice), bearer(&bob)],
            "different consumers",
        ),
        (
            "a valid key and a valid token of different consumers",
            "/api/x".into(),
            vec![key(KEY_ACME), bearer(&alice)],
            "different consumers",
        ),
        (
            "a valid key and another consumer's token after a tab",
            "/api/x".into(),
            vec![key(KEY_ACME), format!("Authorization: Bearer\t{alice}")],
            "different consumers",
        ),
        (
            "a valid key and a broken token after spaces and tabs",
            "/api/x".into(),
            vec![
                key(KEY_ACME),
                "Authorization: bearer \t  aaaa.bbbb.cccc".into(),
            ],
            "malformed",
        ),
        (
            "a valid query key and another's as PHP spells its name (api.key)",
            format!("/api/x?api_key={KEY_ACME}&api.key={KEY_FREE}"),
            vec![],
            "different consumers",
        ),
        (
            "a valid header beside an unknown key named api[key",
            format!("/api/x?api[key={unknown}"),
            vec![key(KEY_ACME)],
            "API key",
        ),
        (
            "a valid header beside another's key named api+key",
            format!("/api/x?api+key={KEY_FREE}"),
            vec![key(KEY_ACME)],
            "different consumers",
        ),
    ];
    for (what, target, lines, word) in &refused {
        let r = raw(s.addr, target, lines);
        assert_eq!(r.status, 401, "{what}: {}", r.body);
        assert_401(&r, &[KEY_ACME, KEY_FREE, unknown, &alice, &bob], word);
    }
    assert_eq!(
        up.hits(),
        0,
        "a request with a bad credential reached the upstream"
    );

    let served: Vec<(&str, String, Vec<String>, &str)> = vec![
        (
            "a percent-encoded query name",
            format!("/api/x?api%5Fkey={KEY_ACME}"),
            vec![],
            "acme",
        ),
        (
            "the same key in the header and the query",
            format!("/api/x?api_key={KEY_ACME}"),
            vec![key(KEY_ACME)],
            "acme",
        ),
        (
            "the same key in two headers",
            "/api/x".into(),
            vec![key(KEY_FREE), key(KEY_FREE)],
            "freebie",
        ),
        (
            "the same token twice",
            "/api/x".into(),
            vec![bearer(&alice), bearer(&alice)],
            "alice",
        ),
        (
            "a token beside a Basic credential, which is not sluice's",
            "/api/x".into(),
            vec![bearer(&bob), "Authorization: Basic dXNlcjpwYXNz".into()],
            "bob",
        ),
    ];
    for (what, target, lines, consumer) in &served {
        let r = raw(s.addr, target, lines);
        assert_eq!(r.status, 200, "{what}: {}", r.body);
        assert_eq!(
            upstream_saw_folded(&r, &["x-consumer"]),
            pairs(&[("x-consumer", consumer)]),
            "{what}"
        );
    }
}

/// `hide_credentials = true` removes every copy of every credential: each spelling and
/// repetition of the key header, every `api_key` query parameter however its name is
/// encoded, and every Authorization header; the rest of the request is unchanged.
#[test]
fn hide_credentials_removes_every_copy_of_every_credential() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let es = Signer::es256("es-1");
    let auth = format!(
        "hide_credentials = true\n{}",
        issuer(&dir, ISS, &es, "consumers = \"match\"")
    );
    let s = Sluice::start(&config(&up, &dir, &auth, "", ""));
    let acme = token(&es, ISS, json!("acme"), json!({}));
    let r = raw(
        s.addr,
        &format!(
            "/api/x?page=2&api_key={KEY_ACME}&api%5Fkey={KEY_ACME}&q=a%5Fb&api_key={KEY_ACME}"
        ),
        &[
            format!("x-api-key: {KEY_ACME}"),
            format!("X_Api_Key: {KEY_ACME}"),
            format!("X-API-KEY: {KEY_ACME}"),
            format!("Authorization: Bearer {acme}"),
            format!("authorization: Bearer {acme}"),
            "x-other: kept".into(),
        ],
    );
    assert_eq!(
        identity_seen(&r),
        pairs(&[("x-consumer", "acme"), ("x-consumer-plan", "gold")])
    );
    assert_eq!(upstream_target(&r), "/api/x?page=2&q=a%5Fb");
    assert!(
        !r.body.contains(KEY_ACME),
        "a copy of the key got through: {}",
        r.body
    );
    assert!(
        !r.body.contains(&acme),
        "a copy of the token got through: {}",
        r.body
    );
    assert_eq!(
        upstream_saw_folded(&r, &["x-other"]),
        pairs(&[("x-other", "kept")])
    );
}

// ---------------------------------------------------------------------------------------
// Token consumers stay in their issuer.

/// A token's consumer claim that is empty, longer than 128 bytes, holds a control
/// character, is an IP address (it would share that address's anonymous bucket) or is
/// `anonymous` is a 401; so is one naming a consumer of API keys, from the config or the
/// admin API, also when the token was verified (and remembered) before that consumer
/// existed. 128 bytes and integer claims pass.
#[test]
fn a_token_cannot_pose_as_an_address_anonymous_or_a_key_holder() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let es = Signer::es256("es-1");
    let s = Sluice::start(&config(&up, &dir, &issuer(&dir, ISS, &es, ""), "", ""));
    let refused = [
        (json!(""), "claim"),
        (json!("a".repeat(129)), "128"),
        (json!("bob\u{7}"), "control"),
        (json!("bob\tby"), "control"),
        (json!("bob\u{85}"), "control"),
        (json!("198.51.100.7"), "IP address"),
        (json!("2001:db8::7"), "IP address"),
        (json!("anonymous"), "anonymous"),
        (json!("acme"), "consumer"),
        (json!("freebie"), "consumer"),
    ];
    for (sub, word) in &refused {
        let t = token(&es, ISS, sub.clone(), json!({"plan": "gold"}));
        let r = raw(s.addr, "/opt/x", &[format!("Authorization: Bearer {t}")]);
        assert_eq!(r.status, 401, "sub {sub}: {}", r.body);
        assert_401(&r, &[&t], word);
    }
    assert_eq!(up.hits(), 0, "{}", s.stderr());

    for (sub, consumer) in [
        (json!("a".repeat(128)), "a".repeat(128)),
        (json!(12345), "12345".to_owned()),
        (json!("user@example.com"), "user@example.com".to_owned()),
    ] {
        let t = token(&es, ISS, sub, json!({}));
        let r = raw(s.addr, "/api/x", &[format!("Authorization: Bearer {t}")]);
        assert_eq!(
            identity_seen(&r),
            pairs(&[("x-consumer", &consumer)]),
            "{}",
            r.body
        );
    }

    // A runtime consumer is a key holder too; and a token remembered before its consumer
    // was created is refused once it is.
    let put = |name: &str| {
        let r = admin(
            &s,
            "PUT",
            &format!("/v1/consumers/{name}"),
            r#"{"plan":"silver"}"#,
        );
        assert_eq!(r.status, 200, "{}", r.body);
    };
    put("rt");
    let t = token(&es, ISS, json!("rt"), json!({}));
    assert_401(
        &raw(s.addr, "/api/x", &[format!("Authorization: Bearer {t}")]),
        &[&t],
        "consumer",
    );
    let later = token(&es, ISS, json!("later"), json!({"plan": "pro"}));
    let with_later = [format!("Authorization: Bearer {later}")];
    assert_eq!(
        identity_seen(&raw(s.addr, "/api/x", &with_later)),
        pairs(&[("x-consumer", "later"), ("x-consumer-plan", "pro")])
    );
    put("later");
    assert_401(&raw(s.addr, "/api/x", &with_later), &[&later], "consumer");
}

/// With two issuers each names consumers under its own prefix: the same `sub` from each is
/// two consumers, and neither is the API-key consumer of that name.
#[test]
fn each_issuer_names_its_consumers_under_its_own_prefix() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let (a, b) = (Signer::es256("a-1"), Signer::es256("b-1"));
    let (iss_a, iss_b) = ("https://a.idp.test/", "https://b.idp.test/");
    let auth = issuer(&dir, iss_a, &a, "consumer_prefix = \"a:\"")
        + &issuer(&dir, iss_b, &b, "consumer_prefix = \"b:\"");
    let s = Sluice::start(&config(&up, &dir, &auth, "", ""));
    for (signer, iss, sub, consumer) in [
        (&a, iss_a, "bob", "a:bob"),
        (&b, iss_b, "bob", "b:bob"),
        (&b, iss_b, "acme", "b:acme"),
        (&a, iss_a, "b:bob", "a:b:bob"),
    ] {
        let t = token(signer, iss, json!(sub), json!({}));
        let r = raw(s.addr, "/api/x", &[format!("Authorization: Bearer {t}")]);
        assert_eq!(
            identity_seen(&r),
            pairs(&[("x-consumer", consumer)]),
            "{iss} {sub}: {}",
            r.body
        );
    }
}

/// An issuer with `consumers = "match"` names API-key consumers: its token is that
/// consumer with that consumer's plan (not the token's), sharing its bucket; a claim that
/// names no consumer is a 401; runtime consumers count, and a token remembered for one is
/// refused once it is deleted.
#[test]
fn a_match_issuer_names_key_holders_with_their_plans() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let es = Signer::es256("es-1");
    let policies = "[policies.tiers]\nalgorithm = \"fixed_window\"\nlimit = 2\nperiod = \"1h\"\nkey = [\"consumer\"]\n\
                    [[policies.tiers.overrides]]\nwhen = { plan = \"gold\" }\nlimit = 4\n";
    let auth = issuer(&dir, ISS, &es, "consumers = \"match\"");
    let s = Sluice::start(&config(&up, &dir, &auth, policies, "\"tiers\""));
    let acme = token(&es, ISS, json!("acme"), json!({"plan": "platinum"}));
    let with_token = [format!("Authorization: Bearer {acme}")];
    let with_key = [format!("x-api-key: {KEY_ACME}")];

    let r = raw(s.addr, "/api/x", &with_token);
    assert_eq!(
        identity_seen(&r),
        pairs(&[("x-consumer", "acme"), ("x-consumer-plan", "gold")])
    );
    assert_eq!(r.header("ratelimit-policy"), Some("\"tiers\";q=4;w=3600"));
    // One bucket for acme, whichever credential: 4 in all.
    assert_eq!(raw(s.addr, "/api/x", &with_key).status, 200);
    assert_eq!(raw(s.addr, "/api/x", &with_token).status, 200);
    assert_eq!(raw(s.addr, "/api/x", &with_key).status, 200);
    assert_eq!(raw(s.addr, "/api/x", &with_token).status, 429);
    assert_eq!(raw(s.addr, "/api/x", &with_key).status, 429);

    let both = [with_token[0].clone(), format!("x-api-key: {KEY_FREE}")];
    assert_401(
        &raw(s.addr, "/opt/x", &both),
        &[&acme, KEY_FREE],
        "different consumers",
    );
    let nobody = token(&es, ISS, json!("nobody"), json!({}));
    assert_401(
        &raw(
            s.addr,
            "/opt/x",
            &[format!("Authorization: Bearer {nobody}")],
        ),
        &[&nobody],
        "consumer",
    );

    let put = admin(&s, "PUT", "/v1/consumers/rt", r#"{"plan":"silver"}"#);
    assert_eq!(put.status, 200, "{}", put.body);
    let rt = token(&es, ISS, json!("rt"), json!({}));
    let with_rt = [format!("Authorization: Bearer {rt}")];
    assert_eq!(
        identity_seen(&raw(s.addr, "/opt/x", &with_rt)),
        pairs(&[("x-consumer", "rt"), ("x-consumer-plan", "silver")])
    );
    assert_eq!(admin(&s, "DELETE", "/v1/consumers/rt", "").status, 204);
    assert_401(&raw(s.addr, "/opt/x", &with_rt), &[&rt], "consumer");
}

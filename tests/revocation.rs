//! Changes cannot be lost to a race (DESIGN §17): runtime consumers and keys change by
//! compare-and-set, so concurrent calls on two instances of a fleet on a real redis-server
//! never bring a revoked key back nor lose a created one; a revoked key, a changed plan and
//! a key dropped from a JWKS take effect within a second on every instance, tokens that
//! sluice remembers as verified included.

mod common;

use std::net::SocketAddr;
use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

use common::echo::{upstream_saw, EchoUpstream};
use common::http::{self, Response};
use common::jwt::{self, claims, JwksServer, Signer};
use common::redis::{RedisCluster, RedisServer};
use common::{Sluice, TempDir};
use serde_json::{json, Value};

const ISS: &str = "https://idp.test/";
const AUD: &str = "api";
const ADMIN_TOKEN: &str = "admin-t0ken-for-revocation-tests";
/// What an issuer says so that its tokens may name the API-key holders (DESIGN §17:
/// "Token consumers stay in their issuer").
const MATCH: &str = "consumers = \"match\"";
/// Within this, every instance follows a change (DESIGN §11, §17).
const SECOND: Duration = Duration::from_secs(1);

/// A config: `/api/` (auth required) to `upstream`, counted per consumer, 1000 an hour, and
/// 5000 on plan `gold`; the admin API with its token; `limiter` and `auth` lines as given.
fn config(upstream: SocketAddr, dir: &TempDir, limiter: &str, auth: &str) -> String {
    let token = dir.0.join("admin-token");
    std::fs::write(&token, format!("{ADMIN_TOKEN}\n")).expect("write the admin token file");
    format!(
        "[server]\nlisten = [\"{{listen}}\"]\naccess_log = \"off\"\n\
         [admin]\nlisten = \"{{admin}}\"\ntoken_file = \"{}\"\n\
         [limiter]\n{limiter}\n\
         [auth]\napi_key = [\"header:x-api-key\"]\n{auth}\n\
         [policies.per_consumer]\nalgorithm = \"fixed_window\"\nlimit = 1000\nperiod = \"1h\"\nkey = [\"consumer\"]\n\
         [[policies.per_consumer.overrides]]\nwhen = {{ plan = \"gold\" }}\nlimit = 5000\n\
         [upstreams.up]\nservers = [\"{upstream}\"]\n\
         [[routes]]\nname = \"api\"\npath_prefix = \"/api/\"\nupstream = \"up\"\nauth = \"required\"\npolicies = [\"per_consumer\"]\n",
        token.display()
    )
}

fn redis_limiter(redis: &RedisServer) -> String {
    format!(
        "backend = \"redis\"\nurl = \"{}\"\ntimeout = \"500ms\"",
        redis.url()
    )
}

/// An `[[auth.jwt]]` entry for ISS and AUD, ES256, with the key source and `extra` lines.
fn issuer(source: &str, extra: &str) -> String {
    format!(
        "[[auth.jwt]]\nissuer = \"{ISS}\"\naudiences = [\"{AUD}\"]\nalgorithms = [\"ES256\"]\n{source}\n{extra}\n"
    )
}

fn admin(s: &Sluice, method: &str, path: &str, body: &str) -> Response {
    let auth = format!("Bearer {ADMIN_TOKEN}");
    http::request(s.admin, method, path, &[("Authorization", &auth)], body)
}

fn put_plan(s: &Sluice, name: &str, plan: &str) {
    let body = json!({ "plan": plan }).to_string();
    let r = admin(s, "PUT", &format!("/v1/consumers/{name}"), &body);
    assert_eq!(r.status, 200, "{}", r.body);
}

/// A new key of `name` through `s`: (id, key).
fn create_key(s: &Sluice, name: &str) -> Result<(String, String), Response> {
    let r = admin(s, "POST", &format!("/v1/consumers/{name}/keys"), "");
    if r.status != 201 {
        return Err(r);
    }
    let v: Value = serde_json::from_str(&r.body).expect("a JSON key");
    let field = |f: &str| v[f].as_str().expect("id and key").to_owned();
    Ok((field("id"), field("key")))
}

/// A request with an API key, written as bytes on a fresh connection.
fn with_key(s: &Sluice, key: &str) -> Response {
    let raw = format!(
        "GET /api/x HTTP/1.1\r\nHost: localhost\r\nx-api-key: {key}\r\nConnection: close\r\n\r\n"
    );
    http::parse(&http::send_raw(s.addr, raw.as_bytes()).expect("an answer"))
}

fn with_token(s: &Sluice, token: &str) -> Response {
    let raw = format!(
        "GET /api/x HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n"
    );
    http::parse(&http::send_raw(s.addr, raw.as_bytes()).expect("an answer"))
}

/// The plan a request was counted under: per_consumer's `q` in `RateLimit-Policy` (1000
/// without gold, 5000 on gold), checked against the plan the upstream was told.
fn counted_as(r: &Response) -> Option<&'static str> {
    if r.status != 200 {
        return None;
    }
    let plan = upstream_saw(r, "x-consumer-plan");
    match r.header("ratelimit-policy") {
        Some("\"per_consumer\";q=5000;w=3600") if plan.as_deref() == Some("gold") => Some("gold"),
        Some("\"per_consumer\";q=1000;w=3600") if plan.as_deref() == Some("free") => Some("free"),
        other => panic!("counted under {other:?} with plan {plan:?}: {}", r.body),
    }
}

/// The key ids `s` lists for runtime consumer `name`.
fn listed_ids(s: &Sluice, name: &str) -> Vec<String> {
    let r = admin(s, "GET", "/v1/consumers", "");
    assert_eq!(r.status, 200, "{}", r.body);
    let list: Value = serde_json::from_str(&r.body).expect("a JSON list");
    let ids = list
        .as_array()
        .expect("a list")
        .iter()
        .find(|c| c["name"] == name)
        .map(|c| c["key_ids"].clone())
        .unwrap_or(json!([]));
    ids.as_array()
        .expect("key ids")
        .iter()
        .map(|id| id.as_str().expect("an id").to_owned())
        .collect()
}

// ---------------------------------------------------------------------------------------
// Compare-and-set.

/// Round after round, every key of the last round is revoked while new keys are created
/// and the plan is changed, all at once, through every instance of `fleet`. Afterwards, on
/// every instance within a second: each revoked key is refused and unlisted, each created
/// key (answered 201) is accepted and listed. A read-modify-write of the whole consumer
/// lets a call that read before another's write put back what that write took away.
fn no_change_is_lost(fleet: &[Sluice], rounds: usize) {
    const CREATES: usize = 4;
    put_plan(&fleet[0], "raceco", "free");
    let mut live: Vec<(String, String)> = (0..CREATES)
        .map(|_| create_key(&fleet[0], "raceco").expect("a first key"))
        .collect();
    for round in 0..rounds {
        let calls = live.len() + CREATES * fleet.len() + fleet.len();
        let start = Barrier::new(calls);
        let (revoked, created) = thread::scope(|scope| {
            let start = &start;
            let revokes: Vec<_> = live
                .iter()
                .enumerate()
                .map(|(i, (id, _))| {
                    let s = &fleet[i % fleet.len()];
                    scope.spawn(move || {
                        start.wait();
                        admin(s, "DELETE", &format!("/v1/consumers/raceco/keys/{id}"), "")
                    })
                })
                .collect();
            let creates: Vec<_> = (0..CREATES * fleet.len())
                .map(|i| {
                    let s = &fleet[i % fleet.len()];
                    scope.spawn(move || {
                        start.wait();
                        create_key(s, "raceco")
                    })
                })
                .collect();
            let puts: Vec<_> = fleet
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    scope.spawn(move || {
                        start.wait();
                        let plan = if (round + i) % 2 == 0 { "gold" } else { "free" };
                        put_plan(s, "raceco", plan);
                    })
                })
                .collect();
            for put in puts {
                put.join().expect("a plan change");
            }
            let revoked: Vec<Response> = revokes
                .into_iter()
                .map(|t| t.join().expect("a revoke"))
                .collect();
            let created: Vec<_> = creates
                .into_iter()
                .map(|t| t.join().expect("a create"))
                .collect();
            (revoked, created)
        });
        for r in &revoked {
            assert_eq!(r.status, 204, "round {round}: a revoke answered {}", r.body);
        }
        let created: Vec<(String, String)> = created
            .into_iter()
            .map(|c| c.unwrap_or_else(|r| panic!("round {round}: a create answered {}", r.body)))
            .collect();
        for s in fleet {
            let settled = s.wait_for(SECOND, || {
                let ids = listed_ids(s, "raceco");
                live.iter().all(|(id, _)| !ids.contains(id))
                    && created.iter().all(|(id, _)| ids.contains(id))
            });
            let ids = listed_ids(s, "raceco");
            for (id, key) in &live {
                assert!(
                    settled && !ids.contains(id),
                    "round {round}: revoked key {id} came back on {}: {ids:?}",
                    s.addr
                );
                assert_eq!(with_key(s, key).status, 401, "round {round}: revoked {id}");
            }
            for (id, key) in &created {
                assert!(
                    ids.contains(id),
                    "round {round}: created key {id} was lost on {}: {ids:?}",
                    s.addr
                );
                assert_eq!(with_key(s, key).status, 200, "round {round}: created {id}");
            }
        }
        live = created;
    }
}

#[test]
fn concurrent_calls_on_a_fleet_never_bring_a_revoked_key_back() {
    let redis = RedisServer::start();
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let conf = config(up.addr, &dir, &redis_limiter(&redis), "");
    let fleet = [Sluice::start(&conf), Sluice::start(&conf)];
    no_change_is_lost(&fleet, 25);
}

/// On a Cluster the script runs on the node of the consumers' hash.
#[test]
fn concurrent_calls_on_a_fleet_on_a_redis_cluster_never_bring_a_revoked_key_back() {
    let cluster = RedisCluster::start();
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let seeds: Vec<String> = cluster.seeds().iter().map(|s| format!("\"{s}\"")).collect();
    let limiter = format!(
        "backend = \"redis\"\ncluster = [{}]\ntimeout = \"500ms\"",
        seeds.join(", ")
    );
    let conf = config(up.addr, &dir, &limiter, "");
    let fleet = [Sluice::start(&conf), Sluice::start(&conf)];
    changes_answer_alike(&fleet[0]);
    no_change_is_lost(&fleet, 5);
}

#[test]
fn concurrent_calls_on_one_instance_never_bring_a_revoked_key_back() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let conf = config(up.addr, &dir, "", "");
    no_change_is_lost(&[Sluice::start(&conf)], 25);
}

// ---------------------------------------------------------------------------------------
// Within a second, everywhere.

/// A key revoked through instance A is refused on B within a second, though B was using it
/// a moment before; deleting the consumer takes its other keys along the same way.
#[test]
fn a_key_revoked_on_one_instance_is_refused_on_the_other_within_a_second() {
    let redis = RedisServer::start();
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let conf = config(up.addr, &dir, &redis_limiter(&redis), "");
    let (a, b) = (Sluice::start(&conf), Sluice::start(&conf));
    put_plan(&a, "revokeco", "free");
    let (id, key) = create_key(&a, "revokeco").expect("a key");
    let (_, other) = create_key(&a, "revokeco").expect("a second key");
    assert!(b.wait_for(SECOND, || with_key(&b, &key).status == 200));
    assert!(b.wait_for(SECOND, || with_key(&b, &other).status == 200));

    let r = admin(
        &a,
        "DELETE",
        &format!("/v1/consumers/revokeco/keys/{id}"),
        "",
    );
    assert_eq!(r.status, 204, "{}", r.body);
    let started = Instant::now();
    assert_eq!(with_key(&a, &key).status, 401);
    assert!(
        b.wait_for(SECOND, || with_key(&b, &key).status == 401),
        "B still accepts the revoked key after {:?}",
        started.elapsed()
    );
    assert_eq!(with_key(&b, &other).status, 200);

    assert_eq!(
        admin(&a, "DELETE", "/v1/consumers/revokeco", "").status,
        204
    );
    assert_eq!(with_key(&a, &other).status, 401);
    assert!(b.wait_for(SECOND, || with_key(&b, &other).status == 401));
}

/// A runtime consumer's plan changed through A: the next requests on B are counted under
/// the new plan within a second, for its API key and for a token naming it that B has
/// already verified and remembers.
#[test]
fn a_plan_change_counts_the_next_requests_under_the_new_plan_everywhere() {
    let redis = RedisServer::start();
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let signer = Signer::es256("es-plan");
    let jwks_file = dir.0.join("jwks.json");
    std::fs::write(&jwks_file, jwt::jwks(&[&signer]).to_string()).expect("write the JWKS");
    let auth = issuer(&format!("jwks_file = \"{}\"", jwks_file.display()), MATCH);
    let conf = config(up.addr, &dir, &redis_limiter(&redis), &auth);
    let (a, b) = (Sluice::start(&conf), Sluice::start(&conf));
    put_plan(&a, "planco", "free");
    let (_, key) = create_key(&a, "planco").expect("a key");
    // No plan claim: the token's plan is its consumer's.
    let token = signer.sign(&claims(ISS, AUD, "planco", 300, &json!({})));
    assert!(b.wait_for(SECOND, || with_key(&b, &key).status == 200));
    for _ in 0..3 {
        assert_eq!(counted_as(&with_key(&b, &key)), Some("free"));
        // The first verifies the token, the others are answered from memory.
        assert_eq!(counted_as(&with_token(&b, &token)), Some("free"));
    }

    for plan in ["gold", "free", "gold"] {
        put_plan(&a, "planco", plan);
        let started = Instant::now();
        assert_eq!(counted_as(&with_key(&a, &key)), Some(plan));
        assert_eq!(counted_as(&with_token(&a, &token)), Some(plan));
        let by_key = b.wait_for(SECOND, || counted_as(&with_key(&b, &key)) == Some(plan));
        assert!(
            by_key,
            "B's key is not on {plan} after {:?}",
            started.elapsed()
        );
        let by_token = b.wait_for(SECOND, || counted_as(&with_token(&b, &token)) == Some(plan));
        assert!(
            by_token,
            "B's remembered token is not on {plan} after {:?}",
            started.elapsed()
        );
    }
}

/// A config reload that changes a consumer's plan applies to its remembered tokens too.
#[test]
fn a_reload_that_changes_a_plan_applies_to_remembered_tokens() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let signer = Signer::es256("es-reload");
    let jwks_file = dir.0.join("jwks.json");
    std::fs::write(&jwks_file, jwt::jwks(&[&signer]).to_string()).expect("write the JWKS");
    let key = "sk_test_reload_consumer_5Rk2Wq";
    let with_plan = |plan: &str| {
        let consumer = format!(
            "[[consumers]]\nname = \"cfgco\"\nplan = \"{plan}\"\nkeys = [\"{}\"]\n",
            jwt::key_digest(key)
        );
        let auth = issuer(&format!("jwks_file = \"{}\"", jwks_file.display()), MATCH);
        config(up.addr, &dir, "", &format!("{auth}{consumer}"))
    };
    let s = Sluice::start(&with_plan("free"));
    let token = signer.sign(&claims(ISS, AUD, "cfgco", 300, &json!({})));
    for _ in 0..2 {
        assert_eq!(counted_as(&with_token(&s, &token)), Some("free"));
    }
    s.reload(&with_plan("gold"));
    assert!(
        s.wait_for(Duration::from_secs(5), || counted_as(&with_key(&s, key))
            == Some("gold")),
        "the reload was not applied: {}",
        s.stderr()
    );
    assert_eq!(counted_as(&with_token(&s, &token)), Some("gold"));
}

/// The identity provider drops a key from its JWKS: once sluice has fetched the new set
/// (`jwks_refresh = "1s"`), a token signed with the dropped key is refused within a second,
/// though it was verified and remembered before; tokens of the kept key still pass.
#[test]
fn a_key_dropped_from_the_jwks_url_refuses_its_remembered_tokens() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let (dropped, kept) = (Signer::es256("es-dropped"), Signer::es256("es-kept"));
    let jwks = JwksServer::start(jwt::jwks(&[&dropped, &kept]));
    let source = format!("jwks_url = \"{}\"\njwks_refresh = \"1s\"", jwks.url());
    let conf = config(up.addr, &dir, "", &issuer(&source, "plan_claim = \"plan\""));
    let s = Sluice::start(&conf);
    let old = dropped.sign(&claims(ISS, AUD, "tok-user", 300, &json!({"plan": "free"})));
    let new = kept.sign(&claims(ISS, AUD, "tok-user", 300, &json!({"plan": "free"})));
    assert!(
        s.wait_for(Duration::from_secs(10), || with_token(&s, &old).status
            == 200)
    );
    for _ in 0..3 {
        assert_eq!(counted_as(&with_token(&s, &old)), Some("free"));
        assert_eq!(counted_as(&with_token(&s, &new)), Some("free"));
    }

    jwks.set(jwt::jwks(&[&kept]));
    let asked = jwks.served();
    assert!(
        s.wait_for(Duration::from_secs(5), || jwks.served() > asked),
        "sluice did not fetch the set again: {}",
        s.stderr()
    );
    let fetched = Instant::now();
    assert!(
        s.wait_for(SECOND, || with_token(&s, &old).status == 401),
        "a token of the dropped key still passes {:?} after the fetch",
        fetched.elapsed()
    );
    assert_eq!(counted_as(&with_token(&s, &new)), Some("free"));
}

/// A key dropped from a `jwks_file` read again on reload: its remembered tokens are refused.
#[test]
fn a_key_dropped_from_a_reloaded_jwks_file_refuses_its_remembered_tokens() {
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    let (dropped, kept) = (Signer::es256("es-dropped"), Signer::es256("es-kept"));
    let jwks_file = dir.0.join("jwks.json");
    std::fs::write(&jwks_file, jwt::jwks(&[&dropped, &kept]).to_string()).expect("write");
    let source = format!("jwks_file = \"{}\"", jwks_file.display());
    let conf = config(up.addr, &dir, "", &issuer(&source, "plan_claim = \"plan\""));
    let s = Sluice::start(&conf);
    let old = dropped.sign(&claims(ISS, AUD, "tok-user", 300, &json!({"plan": "free"})));
    let new = kept.sign(&claims(ISS, AUD, "tok-user", 300, &json!({"plan": "free"})));
    for _ in 0..2 {
        assert_eq!(counted_as(&with_token(&s, &old)), Some("free"));
        assert_eq!(counted_as(&with_token(&s, &new)), Some("free"));
    }
    std::fs::write(&jwks_file, jwt::jwks(&[&kept]).to_string()).expect("write");
    s.reload(&conf);
    assert!(
        s.wait_for(Duration::from_secs(5), || with_token(&s, &old).status
            == 401),
        "a token of the dropped key still passes after the reload: {}",
        s.stderr()
    );
    assert_eq!(counted_as(&with_token(&s, &new)), Some("free"));
}

// ---------------------------------------------------------------------------------------
// The same answers on both backends.

/// Each change answers alike whether Redis (one script call) or the process keeps the
/// consumers: a plan change keeps the keys, `{}` clears the plan, keys of a consumer that is
/// not there and ids a consumer does not have are 404 and change nothing.
fn changes_answer_alike(s: &Sluice) {
    let call = |method: &str, path: &str, body: &str| admin(s, method, path, body);
    assert_eq!(call("POST", "/v1/consumers/ghost/keys", "").status, 404);
    assert_eq!(
        call("DELETE", "/v1/consumers/ghost/keys/abc", "").status,
        404
    );
    assert_eq!(call("DELETE", "/v1/consumers/ghost", "").status, 404);
    assert!(listed_ids(s, "ghost").is_empty());

    put_plan(s, "sameco", "gold");
    let (id, key) = create_key(s, "sameco").expect("a key");
    let r = call("PUT", "/v1/consumers/sameco", "{}");
    assert_eq!(r.status, 200, "{}", r.body);
    let shown: Value = serde_json::from_str(&r.body).expect("JSON");
    assert_eq!(
        (&shown["plan"], &shown["keys"], &shown["key_ids"]),
        (&Value::Null, &json!(1), &json!([id])),
        "{shown}"
    );
    let r = with_key(s, &key);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(upstream_saw(&r, "x-consumer").as_deref(), Some("sameco"));
    assert_eq!(upstream_saw(&r, "x-consumer-plan"), None);
    let r = call("DELETE", "/v1/consumers/sameco/keys/0000000000000000", "");
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(with_key(s, &key).status, 200);
    let path = format!("/v1/consumers/sameco/keys/{id}");
    assert_eq!(call("DELETE", &path, "").status, 204);
    assert_eq!(call("DELETE", &path, "").status, 404);
    assert_eq!(with_key(s, &key).status, 401);
    assert_eq!(call("DELETE", "/v1/consumers/sameco", "").status, 204);
    assert_eq!(call("DELETE", "/v1/consumers/sameco", "").status, 404);
    assert_eq!(call("POST", "/v1/consumers/sameco/keys", "").status, 404);
}

#[test]
fn changes_answer_alike_on_redis_and_in_process() {
    let redis = RedisServer::start();
    let up = EchoUpstream::start();
    let dir = TempDir::new();
    changes_answer_alike(&Sluice::start(&config(
        up.addr,
        &dir,
        &redis_limiter(&redis),
        "",
    )));
    changes_answer_alike(&Sluice::start(&config(up.addr, &dir, "", "")));
}

//! What one uncached JWT verification costs, per algorithm (DESIGN §11): the work sluice
//! does for a token it has not seen yet (or whose cache entry was evicted), through the
//! library's own verifier, `sluice::auth::jwt::verify` (header and claims parsed, key
//! chosen by `kid`, signature checked with ring, `iss`/`aud`/`exp` checked).
//!
//!     cargo run --release --example jwt_verify_cost            # or bench/jwt_cost.sh
//!     cargo run --release --example jwt_verify_cost -- 0.5     # seconds per batch
//!
//! Keys are made at run time, in memory, and never written anywhere (ring cannot generate
//! RSA keys: `openssl genpkey` makes a 2048-bit PKCS#8 key on its stdout). Tokens are
//! signed with ring: ECDSA P-256, Ed25519, RSA PKCS#1 v1.5 and PSS, HMAC-SHA256. For comparison, the last row is what the cached
//! path costs instead of a verification: one SHA-256 of the token (the cache's key).
//!
//! Prints a Markdown table: median µs per verification over 7 batches, one thread.

use std::hint::black_box;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use jsonwebtoken::{Algorithm, DecodingKey};
use ring::rand::SystemRandom;
use ring::signature::{
    EcdsaKeyPair, Ed25519KeyPair, KeyPair, RsaKeyPair, RsaPublicKeyComponents,
    ECDSA_P256_SHA256_FIXED_SIGNING, RSA_PKCS1_SHA256, RSA_PSS_SHA256,
};
use serde_json::json;
use sluice::auth::jwks::KeySet;
use sluice::auth::jwt::{verify, Issuer, Keys};
use sluice::config::{JwtIssuer, JwtKeys};

const ISSUER: &str = "https://bench.test/";
const AUDIENCE: &str = "bench";
/// Distinct tokens per algorithm (different `sub`), verified in turn.
const TOKENS: usize = 64;
const BATCHES: usize = 7;

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// Signs `header.payload`: the raw JWS signature.
type Signer = Box<dyn Fn(&[u8]) -> Vec<u8>>;

/// What a token of one algorithm needs: its issuer, and how to sign `header.payload`.
struct Case {
    name: &'static str,
    key: String,
    alg: Algorithm,
    issuer: Issuer,
    sign: Signer,
}

fn jwt_issuer(alg: Algorithm, keys: JwtKeys) -> JwtIssuer {
    JwtIssuer {
        issuer: ISSUER.into(),
        audiences: vec![AUDIENCE.into()],
        algorithms: vec![alg],
        keys,
        jwks_refresh: Duration::from_secs(600),
        unknown_kid_refetch: Duration::from_secs(30),
        leeway: Duration::from_secs(60),
        consumer_claim: "sub".into(),
        plan_claim: None,
        consumer_prefix: String::new(),
        consumers: sluice::config::JwtConsumers::Separate,
    }
}

/// An issuer whose keys are the one-key JWKS `jwk` (as a `jwks_file` would give).
fn jwks_issuer(alg: Algorithm, jwk: serde_json::Value) -> Issuer {
    let doc = json!({ "keys": [jwk] }).to_string();
    let set = KeySet::parse(doc.as_bytes(), &[alg]).expect("the JWKS has a usable key");
    Issuer {
        config: jwt_issuer(alg, JwtKeys::Jwks(set.clone())),
        keys: Keys::Static(Arc::new(set)),
    }
}

/// A 2048-bit RSA key in PKCS#8 DER, from openssl (ring does not generate RSA keys).
/// genpkey's PEM is PKCS#8 ("BEGIN PRIVATE KEY"; its DER output is PKCS#1, which ring
/// refuses), read from its stdout: the key never touches the disk.
fn rsa_pkcs8() -> Vec<u8> {
    let out = Command::new("openssl")
        .args([
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
        ])
        .output()
        .expect("run openssl genpkey (is openssl installed?)");
    assert!(out.status.success(), "openssl genpkey failed");
    let pem = String::from_utf8(out.stdout).expect("PEM is ASCII");
    assert!(
        pem.contains("BEGIN PRIVATE KEY"),
        "openssl genpkey did not write PKCS#8"
    );
    let b64: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
    base64::engine::general_purpose::STANDARD
        .decode(b64)
        .expect("PEM base64")
}

fn cases() -> Vec<Case> {
    let rng = SystemRandom::new();
    let mut out = Vec::new();

    let pkcs8 =
        EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).expect("P-256 key");
    let pair = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &rng)
        .expect("P-256 key");
    let point = pair.public_key().as_ref().to_vec();
    let r = rng.clone();
    out.push(Case {
        name: "ES256",
        key: "ECDSA P-256".into(),
        alg: Algorithm::ES256,
        issuer: jwks_issuer(
            Algorithm::ES256,
            json!({"kty": "EC", "crv": "P-256", "kid": "es", "x": b64(&point[1..33]), "y": b64(&point[33..])}),
        ),
        sign: Box::new(move |m| pair.sign(&r, m).expect("sign").as_ref().to_vec()),
    });

    let der = rsa_pkcs8();
    for (name, alg, padding) in [
        (
            "RS256",
            Algorithm::RS256,
            &RSA_PKCS1_SHA256 as &'static dyn ring::signature::RsaEncoding,
        ),
        ("PS256", Algorithm::PS256, &RSA_PSS_SHA256),
    ] {
        let pair = RsaKeyPair::from_pkcs8(&der).expect("RSA key");
        let public: RsaPublicKeyComponents<Vec<u8>> = pair.public().into();
        let r = rng.clone();
        out.push(Case {
            name,
            key: format!("RSA {} bits", pair.public().modulus_len() * 8),
            alg,
            issuer: jwks_issuer(
                alg,
                json!({"kty": "RSA", "kid": "rsa", "n": b64(&public.n), "e": b64(&public.e)}),
            ),
            sign: Box::new(move |m| {
                let mut sig = vec![0; pair.public().modulus_len()];
                pair.sign(padding, &r, m, &mut sig).expect("sign");
                sig
            }),
        });
    }

    let pkcs8 = Ed25519KeyPair::generate_pkcs8(&rng).expect("Ed25519 key");
    let pair = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).expect("Ed25519 key");
    let x = b64(pair.public_key().as_ref());
    out.push(Case {
        name: "EdDSA",
        key: "Ed25519".into(),
        alg: Algorithm::EdDSA,
        issuer: jwks_issuer(
            Algorithm::EdDSA,
            json!({"kty": "OKP", "crv": "Ed25519", "kid": "ed", "x": x}),
        ),
        sign: Box::new(move |m| pair.sign(m).as_ref().to_vec()),
    });

    let mut secret = [0u8; 32];
    ring::rand::SecureRandom::fill(&rng, &mut secret).expect("random secret");
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &secret);
    out.push(Case {
        name: "HS256",
        key: "256-bit secret".into(),
        alg: Algorithm::HS256,
        issuer: Issuer {
            config: jwt_issuer(Algorithm::HS256, JwtKeys::Secret(secret.to_vec())),
            keys: Keys::Secret(DecodingKey::from_secret(&secret)),
        },
        sign: Box::new(move |m| ring::hmac::sign(&key, m).as_ref().to_vec()),
    });
    out
}

fn tokens(case: &Case) -> Vec<String> {
    let kid = match case.alg {
        Algorithm::ES256 => Some("es"),
        Algorithm::RS256 | Algorithm::PS256 => Some("rsa"),
        Algorithm::EdDSA => Some("ed"),
        _ => None,
    };
    let mut header = json!({"alg": case.name, "typ": "JWT"});
    if let Some(kid) = kid {
        header["kid"] = json!(kid);
    }
    let head = b64(header.to_string().as_bytes());
    (0..TOKENS)
        .map(|i| {
            let claims = json!({"iss": ISSUER, "aud": AUDIENCE, "sub": format!("c{}", i + 1),
                                "exp": 4_102_444_800u64});
            let input = format!("{head}.{}", b64(claims.to_string().as_bytes()));
            let sig = (case.sign)(input.as_bytes());
            format!("{input}.{}", b64(&sig))
        })
        .collect()
}

/// Median and minimum µs per call of `f` over BATCHES batches of about `batch` each.
fn time_per_call(batch: Duration, mut f: impl FnMut(usize)) -> (f64, f64) {
    // Calibrate: how many calls fill one batch.
    let start = Instant::now();
    let mut n = 0usize;
    while start.elapsed() < batch / 4 {
        f(n);
        n += 1;
    }
    let per_batch = (n * 4).max(1);
    let mut us: Vec<f64> = (0..BATCHES)
        .map(|_| {
            let t = Instant::now();
            for i in 0..per_batch {
                f(i);
            }
            t.elapsed().as_secs_f64() * 1e6 / per_batch as f64
        })
        .collect();
    us.sort_by(|a, b| a.total_cmp(b));
    (us[BATCHES / 2], us[0])
}

fn main() {
    let batch = std::env::args()
        .nth(1)
        .map(|s| s.parse::<f64>().expect("seconds per batch, e.g. 0.3"))
        .unwrap_or(0.3);
    let batch = Duration::from_secs_f64(batch);
    sluice::auth::ring_provider::install();

    println!("## Uncached JWT verification cost, per algorithm");
    println!();
    println!(
        "`sluice::auth::jwt::verify` on one thread, {TOKENS} distinct valid tokens per algorithm \
         verified in turn; median (and minimum) of {BATCHES} batches of {:.1} s. A token sluice \
         has verified before costs the last row instead (its SHA-256, the cache key, plus a \
         hash-map lookup).",
        batch.as_secs_f64()
    );
    println!();
    println!("| algorithm | key | token bytes | µs / verification (median) | min | verifications / s per core |");
    println!("|---|---|---:|---:|---:|---:|");
    let mut es256_token = String::new();
    for case in cases() {
        let toks = tokens(&case);
        let issuers = [case.issuer];
        for t in &toks {
            let ok = verify(t, &issuers).unwrap_or_else(|e| panic!("{}: {e:?}", case.name));
            assert!(ok.consumer.starts_with('c'));
        }
        // Another token's signature must fail: the verifier really checks.
        let mut bad = toks[1].rsplit_once('.').expect("three parts").0.to_owned();
        bad.push('.');
        bad.push_str(toks[0].rsplit_once('.').expect("three parts").1);
        assert!(
            verify(&bad, &issuers).is_err(),
            "{}: a wrong signature passed",
            case.name
        );
        let (median, min) = time_per_call(batch, |i| {
            black_box(verify(black_box(&toks[i % TOKENS]), &issuers).is_ok());
        });
        println!(
            "| {} | {} | {} | {median:.1} | {min:.1} | {:.0} |",
            case.name,
            case.key,
            toks[0].len(),
            1e6 / median
        );
        if case.alg == Algorithm::ES256 {
            es256_token = toks[0].clone();
        }
    }
    let (median, min) = time_per_call(batch, |_| {
        black_box(ring::digest::digest(
            &ring::digest::SHA256,
            black_box(es256_token.as_bytes()),
        ));
    });
    println!(
        "| cached (any) | SHA-256 of the ES256 token | {} | {median:.2} | {min:.2} | {:.0} |",
        es256_token.len(),
        1e6 / median
    );
}

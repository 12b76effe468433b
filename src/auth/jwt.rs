//! Checking one bearer token against the configured issuers: signature by a key of the
//! issuer's set (by `kid`, key type and the allow-list, never the token's say-so), then
//! `iss`, `aud`, `exp`, `nbf` with leeway. Pure but for asking a URL source to re-fetch.

use std::sync::Arc;

use base64::Engine as _;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::{Map, Value};

use super::jwks::{KeySet, UrlSource};
use crate::config::{JwtConsumers, JwtIssuer, JwtKeys, ANONYMOUS};

/// Where one issuer's keys are now.
pub enum Keys {
    Static(Arc<KeySet>),
    Url(Arc<UrlSource>),
    Secret(DecodingKey),
}

pub struct Issuer {
    pub config: JwtIssuer,
    pub keys: Keys,
}

impl Issuer {
    /// `previous`: the URL sources of the config before a reload, kept when unchanged.
    pub fn new(
        config: &JwtIssuer,
        previous: &[Arc<UrlSource>],
        metrics: &Arc<crate::metrics::Metrics>,
    ) -> Issuer {
        let keys = match &config.keys {
            JwtKeys::Jwks(set) => Keys::Static(Arc::new(set.clone())),
            JwtKeys::Secret(secret) => Keys::Secret(DecodingKey::from_secret(secret)),
            JwtKeys::Url(url) => {
                let kept = previous.iter().find(|s| {
                    s.issuer == config.issuer
                        && s.same(
                            url,
                            &config.algorithms,
                            config.jwks_refresh,
                            config.unknown_kid_refetch,
                        )
                });
                let source = match kept {
                    Some(s) => s.clone(),
                    None => {
                        let same_url = previous.iter().find(|s| s.url == *url).map(|s| s.as_ref());
                        UrlSource::start(
                            url,
                            &config.issuer,
                            &config.algorithms,
                            config.jwks_refresh,
                            config.unknown_kid_refetch,
                            same_url,
                            metrics.clone(),
                        )
                    }
                };
                Keys::Url(source)
            }
        };
        Issuer {
            config: config.clone(),
            keys,
        }
    }

    /// False while a `jwks_url` has never been fetched.
    pub fn ready(&self) -> bool {
        match &self.keys {
            Keys::Url(s) => s.keys().is_some(),
            _ => true,
        }
    }
}

/// A token that checked out.
#[derive(Debug, Clone)]
pub struct Verified {
    /// The issuer's `consumer_prefix` and the consumer claim.
    pub consumer: String,
    pub plan: Option<String>,
    pub claims: Map<String, Value>,
    /// Unix seconds.
    pub exp: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The token is not good; the text says why, without the token.
    Invalid(String),
    /// The issuer's key set has never been fetched: sluice's fault, not the client's.
    Unavailable(String),
}

fn invalid(why: impl Into<String>) -> Failure {
    Failure::Invalid(why.into())
}

fn segment(part: &str) -> Result<Map<String, Value>, Failure> {
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(part)
        .map_err(|_| invalid("malformed token (bad base64)"))?;
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(map)) => Ok(map),
        _ => Err(invalid("malformed token (not a JSON object)")),
    }
}

/// Checks `token` against `issuers`.
pub fn verify(token: &str, issuers: &[Issuer]) -> Result<Verified, Failure> {
    let mut parts = token.split('.');
    let (Some(head), Some(body), Some(_sig), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(invalid(
            "malformed token (expected three dot-separated parts)",
        ));
    };
    let header = segment(head)?;
    let claims = segment(body)?;
    let alg_name = header.get("alg").and_then(Value::as_str).unwrap_or("");
    let Ok(alg) = alg_name.parse::<Algorithm>() else {
        return Err(invalid(format!("algorithm {alg_name:?} is not accepted")));
    };
    let kid = match header.get("kid") {
        None => None,
        Some(Value::String(k)) => Some(k.as_str()),
        Some(_) => return Err(invalid("malformed token (`kid` is not a string)")),
    };
    let Some(iss) = claims.get("iss").and_then(Value::as_str) else {
        return Err(invalid("the token has no `iss` claim"));
    };
    let Some(issuer) = issuers.iter().find(|i| i.config.issuer == iss) else {
        return Err(invalid("unknown issuer"));
    };
    let cfg = &issuer.config;
    if !cfg.algorithms.contains(&alg) {
        return Err(invalid(format!(
            "algorithm {alg_name} is not allowed for this issuer"
        )));
    }
    // Time claims are JSON numbers (RFC 7519 NumericDate), never strings.
    for name in ["exp", "nbf", "iat"] {
        if claims.get(name).is_some_and(|v| !v.is_number()) {
            return Err(invalid(format!("`{name}` must be a number")));
        }
    }
    let Some(exp) = claims.get("exp").and_then(Value::as_f64) else {
        return Err(invalid("the token has no `exp` claim"));
    };
    let mut validation = Validation::new(alg);
    validation.algorithms = vec![alg];
    validation.leeway = cfg.leeway.as_secs();
    validation.set_issuer(&[&cfg.issuer]);
    validation.set_audience(&cfg.audiences);
    validation.set_required_spec_claims(&["exp", "iss", "aud"]);
    validation.validate_nbf = true;

    let check =
        |key: &DecodingKey| jsonwebtoken::decode::<Map<String, Value>>(token, key, &validation);
    let result = match &issuer.keys {
        Keys::Secret(key) => check(key),
        Keys::Static(set) => first_good(set, alg, kid, check),
        Keys::Url(source) => {
            let Some(set) = source.keys() else {
                return Err(Failure::Unavailable(format!(
                    "the key set of issuer {iss:?} has not been fetched yet"
                )));
            };
            if let Some(kid) = kid.filter(|k| !set.has_kid(k)) {
                // Perhaps a rotation: fetch again (rate-limited), refuse this one.
                source.unknown_kid();
                return Err(invalid(format!("unknown key id {kid:?}")));
            }
            first_good(&set, alg, kid, check)
        }
    };
    let data = result.map_err(|e| invalid(reason(e.kind())))?;
    let name = |claim: &str| match data.claims.get(claim) {
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => Some(n.to_string()),
        _ => None,
    };
    let Some(claim) = name(&cfg.consumer_claim) else {
        return Err(invalid(format!(
            "the token has no string `{}` claim naming its consumer",
            cfg.consumer_claim
        )));
    };
    if let Some(why) = unfit_claim(&claim) {
        return Err(invalid(format!(
            "the token's `{}` claim {why}",
            cfg.consumer_claim
        )));
    }
    // A `match` issuer's claim names a consumer of API keys as written (DESIGN §17).
    let consumer = match cfg.consumers {
        JwtConsumers::Match => claim,
        JwtConsumers::Separate => format!("{}{claim}", cfg.consumer_prefix),
    };
    if let Some(why) = unfit_name(&consumer) {
        return Err(invalid(format!("the token's consumer {consumer:?} {why}")));
    }
    let plan = cfg.plan_claim.as_deref().and_then(name);
    Ok(Verified {
        consumer,
        plan,
        claims: data.claims,
        exp: exp.max(0.0) as u64,
    })
}

/// Why a consumer claim cannot name a consumer (DESIGN §17): too long, a control
/// character, or a name that poses as something else.
fn unfit_claim(claim: &str) -> Option<&'static str> {
    if claim.len() > 128 {
        return Some("is longer than 128 bytes");
    }
    if claim.chars().any(char::is_control) {
        return Some("holds a control character");
    }
    unfit_name(claim)
}

/// Why a token's consumer (prefix and claim) cannot be one: an IP address would share that
/// address's anonymous bucket, and `anonymous` is the plan of requests without a consumer.
fn unfit_name(name: &str) -> Option<&'static str> {
    if name.parse::<std::net::IpAddr>().is_ok() {
        Some("is an IP address (anonymous clients are keyed by theirs)")
    } else if name == ANONYMOUS {
        Some("is \"anonymous\", the plan of requests without a consumer")
    } else {
        None
    }
}

type Checked = jsonwebtoken::errors::Result<jsonwebtoken::TokenData<Map<String, Value>>>;

/// The first key of the set whose signature checks; a key that fails the signature lets
/// the next one try, any other failure is the token's.
fn first_good(
    set: &KeySet,
    alg: Algorithm,
    kid: Option<&str>,
    check: impl Fn(&DecodingKey) -> Checked,
) -> Checked {
    let mut last: Checked = Err(ErrorKind::InvalidSignature.into());
    let mut tried = false;
    for key in set.candidates(alg, kid) {
        tried = true;
        last = check(&key.key);
        match &last {
            Err(e) if *e.kind() == ErrorKind::InvalidSignature => continue,
            _ => return last,
        }
    }
    if !tried {
        return Err(ErrorKind::InvalidKeyFormat.into());
    }
    last
}

fn reason(kind: &ErrorKind) -> String {
    match kind {
        ErrorKind::ExpiredSignature => "token expired".into(),
        ErrorKind::ImmatureSignature => "token not yet valid (`nbf`)".into(),
        ErrorKind::InvalidAudience => "wrong audience".into(),
        ErrorKind::InvalidIssuer => "wrong issuer".into(),
        ErrorKind::InvalidSignature => "bad signature".into(),
        ErrorKind::InvalidKeyFormat => {
            "no key of the issuer's set matches the token's algorithm and key id".into()
        }
        ErrorKind::InvalidAlgorithm => "algorithm not allowed".into(),
        ErrorKind::MissingRequiredClaim(c) => format!("the token has no `{c}` claim"),
        ErrorKind::InvalidClaimFormat(c) => format!("bad `{c}` claim"),
        _ => "malformed token".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::{EncodingKey, Header};
    use ring::signature::{EcdsaKeyPair, KeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
    use serde_json::json;
    use std::time::Duration;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn now() -> u64 {
        crate::clock::unix_ms() / 1000
    }

    fn issuer(keys: Keys, algorithms: Vec<Algorithm>) -> Issuer {
        Issuer {
            config: JwtIssuer {
                issuer: "https://idp.test/".into(),
                audiences: vec!["api".into()],
                algorithms,
                keys: JwtKeys::Secret(Vec::new()),
                jwks_refresh: Duration::from_secs(600),
                unknown_kid_refetch: Duration::from_secs(30),
                leeway: Duration::from_secs(60),
                consumer_claim: "sub".into(),
                plan_claim: Some("plan".into()),
                consumer_prefix: String::new(),
                consumers: crate::config::JwtConsumers::Separate,
            },
            keys,
        }
    }

    fn claims() -> Value {
        json!({"iss": "https://idp.test/", "aud": "api", "sub": "acme", "plan": "gold", "exp": now() + 600})
    }

    fn hs256(claims: &Value) -> String {
        super::super::ring_provider::install();
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            claims,
            &EncodingKey::from_secret(SECRET),
        )
        .expect("sign")
    }

    fn with(f: impl FnOnce(&mut Value)) -> Value {
        let mut c = claims();
        f(&mut c);
        c
    }

    fn invalid_because(token: &str, issuers: &[Issuer], word: &str) {
        match verify(token, issuers) {
            Err(Failure::Invalid(why)) => assert!(why.contains(word), "{why:?} lacks {word:?}"),
            other => panic!("expected invalid ({word}), got {other:?}"),
        }
    }

    #[test]
    fn hmac_tokens_check_every_claim() {
        let hs = [issuer(
            Keys::Secret(DecodingKey::from_secret(SECRET)),
            vec![Algorithm::HS256],
        )];
        let ok = verify(&hs256(&claims()), &hs).expect("valid");
        assert_eq!(
            (ok.consumer.as_str(), ok.plan.as_deref()),
            ("acme", Some("gold"))
        );
        invalid_because(
            &hs256(&with(|c| c["exp"] = json!(now() - 120))),
            &hs,
            "expired",
        );
        // Within leeway (60 s).
        assert!(verify(&hs256(&with(|c| c["exp"] = json!(now() - 10))), &hs).is_ok());
        invalid_because(
            &hs256(&with(|c| c["nbf"] = json!(now() + 600))),
            &hs,
            "not yet valid",
        );
        invalid_because(
            &hs256(&with(|c| c["aud"] = json!("other"))),
            &hs,
            "audience",
        );
        invalid_because(
            &hs256(&with(|c| c["iss"] = json!("https://evil.test/"))),
            &hs,
            "issuer",
        );
        invalid_because(
            &hs256(&with(|c| c["exp"] = json!("9999999999"))),
            &hs,
            "number",
        );
        invalid_because(
            &hs256(&with(|c| drop(c.as_object_mut().map(|m| m.remove("exp"))))),
            &hs,
            "exp",
        );
        // A payload altered after signing.
        let token = hs256(&claims());
        let parts: Vec<&str> = token.split('.').collect();
        let forged = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(serde_json::to_vec(&with(|c| c["plan"] = json!("platinum"))).expect("json"));
        invalid_because(
            &format!("{}.{forged}.{}", parts[0], parts[2]),
            &hs,
            "signature",
        );
        // alg none, unsigned.
        let none = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(br#"{"alg":"none"}"#);
        invalid_because(&format!("{none}.{}.", parts[1]), &hs, "none");
    }

    /// A token's consumer is the issuer's prefix and its claim; a claim that is too long,
    /// holds a control character, or poses as an address or `anonymous` is refused, and so
    /// is a prefix and claim that together pose as one (DESIGN §17).
    #[test]
    fn consumer_claims_are_prefixed_and_checked() {
        let mut prefixed = issuer(
            Keys::Secret(DecodingKey::from_secret(SECRET)),
            vec![Algorithm::HS256],
        );
        prefixed.config.consumer_prefix = "idp:".into();
        let hs = [prefixed];
        let sub = |v: Value| hs256(&with(|c| c["sub"] = v));
        assert_eq!(
            verify(&sub(json!("bob")), &hs).expect("valid").consumer,
            "idp:bob"
        );
        assert_eq!(
            verify(&sub(json!(42)), &hs).expect("valid").consumer,
            "idp:42"
        );
        assert!(verify(&sub(json!("b".repeat(128))), &hs).is_ok());
        invalid_because(&sub(json!("b".repeat(129))), &hs, "128 bytes");
        invalid_because(&sub(json!("")), &hs, "no string `sub`");
        for control in ["a\u{0}", "a\nb", "\u{7f}", "\u{9b}x"] {
            invalid_because(&sub(json!(control)), &hs, "control character");
        }
        for ip in ["198.51.100.7", "::1", "2001:db8::7", "::ffff:10.0.0.1"] {
            invalid_because(&sub(json!(ip)), &hs, "IP address");
        }
        invalid_because(&sub(json!("anonymous")), &hs, "anonymous");

        let mut joined = issuer(
            Keys::Secret(DecodingKey::from_secret(SECRET)),
            vec![Algorithm::HS256],
        );
        joined.config.consumer_prefix = "10.".into();
        let hs = [joined];
        invalid_because(
            &sub(json!("0.0.1")),
            &hs,
            "consumer \"10.0.0.1\" is an IP address",
        );
        assert_eq!(
            verify(&sub(json!("x")), &hs).expect("valid").consumer,
            "10.x"
        );

        // A `match` issuer's claim names a consumer as written (`check` refuses a prefix).
        let mut matching = issuer(
            Keys::Secret(DecodingKey::from_secret(SECRET)),
            vec![Algorithm::HS256],
        );
        matching.config.consumer_prefix = "idp:".into();
        matching.config.consumers = crate::config::JwtConsumers::Match;
        assert_eq!(
            verify(&sub(json!("bob")), &[matching])
                .expect("valid")
                .consumer,
            "bob"
        );
    }

    #[test]
    fn public_key_issuers_refuse_hmac_tokens_and_other_keys() {
        super::super::ring_provider::install();
        let rng = ring::rand::SystemRandom::new();
        let pkcs8 =
            EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).expect("key");
        let pair = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &rng)
            .expect("key");
        let point = pair.public_key().as_ref();
        let b64 = |b: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b);
        let jwks = json!({"keys": [{"kty": "EC", "crv": "P-256", "kid": "k1",
            "x": b64(&point[1..33]), "y": b64(&point[33..])}]});
        let set = KeySet::parse(jwks.to_string().as_bytes(), &[Algorithm::ES256]).expect("set");
        let es = [issuer(Keys::Static(Arc::new(set)), vec![Algorithm::ES256])];
        let mut header = Header::new(Algorithm::ES256);
        header.kid = Some("k1".into());
        let token = jsonwebtoken::encode(
            &header,
            &claims(),
            &EncodingKey::from_ec_der(pkcs8.as_ref()),
        )
        .expect("sign");
        assert_eq!(verify(&token, &es).expect("valid").consumer, "acme");
        // An HMAC token for this issuer, signed with its public key as the secret.
        let confused = jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims(),
            &EncodingKey::from_secret(point),
        )
        .expect("sign");
        invalid_because(&confused, &es, "not allowed");
        // Another key's signature, under the same kid.
        let other =
            EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).expect("key");
        let forged = jsonwebtoken::encode(
            &header,
            &claims(),
            &EncodingKey::from_ec_der(other.as_ref()),
        )
        .expect("sign");
        invalid_because(&forged, &es, "signature");
    }
}

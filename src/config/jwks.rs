//! A JWKS document read into the keys an issuer's allow-list may use (`jwks_file` at load,
//! and each fetch of a `jwks_url` by `auth::jwks`).

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey};

/// One usable key of a set.
#[derive(Clone)]
pub struct SetKey {
    pub kid: Option<String>,
    /// The allowed algorithms this key can check (its type's, narrowed by its `alg`).
    pub algorithms: Vec<Algorithm>,
    pub key: DecodingKey,
}

/// The keys of a JWKS that an issuer's allow-list can use; the rest are left out.
#[derive(Clone, Default)]
pub struct KeySet {
    pub keys: Vec<SetKey>,
}

impl std::fmt::Debug for KeySet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kids: Vec<&str> = self
            .keys
            .iter()
            .map(|k| k.kid.as_deref().unwrap_or("-"))
            .collect();
        write!(f, "KeySet{kids:?}")
    }
}

impl KeySet {
    /// Reads a JWKS document. Keys of other types, for encryption, or for algorithms the
    /// allow-list does not name are skipped; an HMAC (`oct`) key is never taken from a set.
    pub fn parse(text: &[u8], allowed: &[Algorithm]) -> Result<KeySet, String> {
        let doc: serde_json::Value =
            serde_json::from_slice(text).map_err(|e| format!("not JSON: {e}"))?;
        let Some(list) = doc.get("keys").and_then(|k| k.as_array()) else {
            return Err("no \"keys\" array".into());
        };
        let keys = list
            .iter()
            .filter_map(|value| {
                let jwk: Jwk = serde_json::from_value(value.clone()).ok()?;
                usable(&jwk, allowed)
            })
            .collect::<Vec<_>>();
        if keys.is_empty() {
            return Err(format!(
                "no usable key for {} among its {} keys",
                names(allowed),
                list.len()
            ));
        }
        Ok(KeySet { keys })
    }

    /// The keys that may have signed a token with `alg` and `kid`.
    pub fn candidates<'a>(
        &'a self,
        alg: Algorithm,
        kid: Option<&'a str>,
    ) -> impl Iterator<Item = &'a SetKey> + 'a {
        self.keys.iter().filter(move |k| {
            k.algorithms.contains(&alg) && (kid.is_none() || k.kid.as_deref() == kid)
        })
    }

    pub fn has_kid(&self, kid: &str) -> bool {
        self.keys.iter().any(|k| k.kid.as_deref() == Some(kid))
    }
}

pub fn names(algorithms: &[Algorithm]) -> String {
    let list: Vec<String> = algorithms.iter().map(|a| format!("{a:?}")).collect();
    list.join(", ")
}

fn usable(jwk: &Jwk, allowed: &[Algorithm]) -> Option<SetKey> {
    if jwk.common.public_key_use == Some(PublicKeyUse::Encryption) {
        return None;
    }
    use Algorithm::*;
    let by_type: &[Algorithm] = match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => &[RS256, RS384, RS512, PS256, PS384, PS512],
        AlgorithmParameters::EllipticCurve(ec) => match ec.curve {
            EllipticCurve::P256 => &[ES256],
            EllipticCurve::P384 => &[ES384],
            _ => return None,
        },
        AlgorithmParameters::OctetKeyPair(okp) if okp.curve == EllipticCurve::Ed25519 => &[EdDSA],
        _ => return None,
    };
    let own = jwk
        .common
        .key_algorithm
        .and_then(|a| serde_json::to_value(a).ok())
        .and_then(|v| v.as_str().and_then(|s| s.parse::<Algorithm>().ok()));
    let algorithms: Vec<Algorithm> = by_type
        .iter()
        .copied()
        .filter(|a| allowed.contains(a) && own.is_none_or(|own| own == *a))
        .collect();
    if algorithms.is_empty() {
        return None;
    }
    let key = DecodingKey::from_jwk(jwk).ok()?;
    Some(SetKey {
        kid: jwk.common.key_id.clone(),
        algorithms,
        key,
    })
}

//! jsonwebtoken's crypto backend on ring, the library rustls already uses: one crypto
//! library for TLS and tokens, and no second RSA/ECDSA implementation to build or audit.

use jsonwebtoken::crypto::{CryptoProvider, JwtSigner, JwtVerifier, KeyUtils};
use jsonwebtoken::errors::{Error, ErrorKind};
use jsonwebtoken::signature;
use jsonwebtoken::{Algorithm, DecodingKey, DecodingKeyKind, EncodingKey};
use ring::signature::{self as sig, KeyPair};

/// Installs the ring provider for this process (idempotent).
pub fn install() {
    // Err: already installed (by an earlier call).
    let _ = PROVIDER.install_default();
}

static PROVIDER: CryptoProvider = CryptoProvider {
    signer_factory: signer,
    verifier_factory: verifier,
    key_utils: KeyUtils {
        rsa_pub_components_from_private_key: |_| Err(ErrorKind::InvalidKeyFormat.into()),
        rsa_pub_components_from_public_key: |_| Err(ErrorKind::InvalidKeyFormat.into()),
        ec_pub_components_from_private_key: |_, _| Err(ErrorKind::InvalidKeyFormat.into()),
        ed_pub_components_from_private_key: |_, _| Err(ErrorKind::InvalidKeyFormat.into()),
        compute_digest: |data, hash| {
            let algorithm = match hash {
                jsonwebtoken::jwk::ThumbprintHash::SHA256 => &ring::digest::SHA256,
                jsonwebtoken::jwk::ThumbprintHash::SHA384 => &ring::digest::SHA384,
                jsonwebtoken::jwk::ThumbprintHash::SHA512 => &ring::digest::SHA512,
                _ => return Err(ErrorKind::InvalidAlgorithm.into()),
            };
            Ok(ring::digest::digest(algorithm, data).as_ref().to_vec())
        },
    },
};

/// What one algorithm needs of ring.
enum Scheme {
    Hmac(ring::hmac::Algorithm),
    Rsa(&'static sig::RsaParameters, &'static dyn sig::RsaEncoding),
    Ecdsa(
        &'static sig::EcdsaVerificationAlgorithm,
        &'static sig::EcdsaSigningAlgorithm,
    ),
    Ed25519,
}

fn scheme(alg: Algorithm) -> Option<Scheme> {
    use Algorithm::*;
    Some(match alg {
        HS256 => Scheme::Hmac(ring::hmac::HMAC_SHA256),
        HS384 => Scheme::Hmac(ring::hmac::HMAC_SHA384),
        HS512 => Scheme::Hmac(ring::hmac::HMAC_SHA512),
        RS256 => Scheme::Rsa(&sig::RSA_PKCS1_2048_8192_SHA256, &sig::RSA_PKCS1_SHA256),
        RS384 => Scheme::Rsa(&sig::RSA_PKCS1_2048_8192_SHA384, &sig::RSA_PKCS1_SHA384),
        RS512 => Scheme::Rsa(&sig::RSA_PKCS1_2048_8192_SHA512, &sig::RSA_PKCS1_SHA512),
        PS256 => Scheme::Rsa(&sig::RSA_PSS_2048_8192_SHA256, &sig::RSA_PSS_SHA256),
        PS384 => Scheme::Rsa(&sig::RSA_PSS_2048_8192_SHA384, &sig::RSA_PSS_SHA384),
        PS512 => Scheme::Rsa(&sig::RSA_PSS_2048_8192_SHA512, &sig::RSA_PSS_SHA512),
        ES256 => Scheme::Ecdsa(
            &sig::ECDSA_P256_SHA256_FIXED,
            &sig::ECDSA_P256_SHA256_FIXED_SIGNING,
        ),
        ES384 => Scheme::Ecdsa(
            &sig::ECDSA_P384_SHA384_FIXED,
            &sig::ECDSA_P384_SHA384_FIXED_SIGNING,
        ),
        EdDSA => Scheme::Ed25519,
        _ => return None,
    })
}

fn bad<E>(_: E) -> signature::Error {
    signature::Error::new()
}

struct Verifier {
    alg: Algorithm,
    key: DecodingKey,
}

impl signature::Verifier<Vec<u8>> for Verifier {
    fn verify(&self, msg: &[u8], signature: &Vec<u8>) -> Result<(), signature::Error> {
        let Some(scheme) = scheme(self.alg) else {
            return Err(signature::Error::new());
        };
        match (scheme, self.key.kind()) {
            (Scheme::Hmac(alg), DecodingKeyKind::SecretOrDer(secret)) => {
                ring::hmac::verify(&ring::hmac::Key::new(alg, secret), msg, signature).map_err(bad)
            }
            (Scheme::Rsa(params, _), DecodingKeyKind::RsaModulusExponent { n, e }) => {
                sig::RsaPublicKeyComponents { n, e }
                    .verify(params, msg, signature)
                    .map_err(bad)
            }
            (Scheme::Rsa(params, _), DecodingKeyKind::SecretOrDer(der)) => {
                sig::UnparsedPublicKey::new(params, der)
                    .verify(msg, signature)
                    .map_err(bad)
            }
            (Scheme::Ecdsa(alg, _), DecodingKeyKind::SecretOrDer(point)) => {
                sig::UnparsedPublicKey::new(alg, point)
                    .verify(msg, signature)
                    .map_err(bad)
            }
            (Scheme::Ed25519, DecodingKeyKind::SecretOrDer(public)) => {
                sig::UnparsedPublicKey::new(&sig::ED25519, public)
                    .verify(msg, signature)
                    .map_err(bad)
            }
            _ => Err(signature::Error::new()),
        }
    }
}

impl JwtVerifier for Verifier {
    fn algorithm(&self) -> Algorithm {
        self.alg
    }
}

/// A verifier only for a key of the algorithm's own family: an HMAC token is never
/// checked with a public key as its secret.
fn verifier(
    alg: &Algorithm,
    key: &DecodingKey,
) -> jsonwebtoken::errors::Result<Box<dyn JwtVerifier>> {
    if key.family() != alg.family() {
        return Err(Error::from(ErrorKind::InvalidAlgorithm));
    }
    Ok(Box::new(Verifier {
        alg: *alg,
        key: key.clone(),
    }))
}

struct Signer {
    alg: Algorithm,
    /// HMAC: the secret; others: PKCS#8 DER.
    key: Vec<u8>,
}

impl signature::Signer<Vec<u8>> for Signer {
    fn try_sign(&self, msg: &[u8]) -> Result<Vec<u8>, signature::Error> {
        let rng = ring::rand::SystemRandom::new();
        let Some(scheme) = scheme(self.alg) else {
            return Err(signature::Error::new());
        };
        match scheme {
            Scheme::Hmac(alg) => Ok(ring::hmac::sign(&ring::hmac::Key::new(alg, &self.key), msg)
                .as_ref()
                .to_vec()),
            Scheme::Rsa(_, encoding) => {
                let pair = sig::RsaKeyPair::from_pkcs8(&self.key)
                    .or_else(|_| sig::RsaKeyPair::from_der(&self.key))
                    .map_err(bad)?;
                let mut out = vec![0; pair.public().modulus_len()];
                pair.sign(encoding, &rng, msg, &mut out).map_err(bad)?;
                Ok(out)
            }
            Scheme::Ecdsa(_, signing) => {
                let pair = sig::EcdsaKeyPair::from_pkcs8(signing, &self.key, &rng).map_err(bad)?;
                Ok(pair.sign(&rng, msg).map_err(bad)?.as_ref().to_vec())
            }
            Scheme::Ed25519 => {
                let pair =
                    sig::Ed25519KeyPair::from_pkcs8_maybe_unchecked(&self.key).map_err(bad)?;
                let _ = pair.public_key();
                Ok(pair.sign(msg).as_ref().to_vec())
            }
        }
    }
}

impl JwtSigner for Signer {
    fn algorithm(&self) -> Algorithm {
        self.alg
    }
}

/// Signing is for tests and tools (sluice itself only verifies).
fn signer(alg: &Algorithm, key: &EncodingKey) -> jsonwebtoken::errors::Result<Box<dyn JwtSigner>> {
    if key.family() != alg.family() {
        return Err(Error::from(ErrorKind::InvalidAlgorithm));
    }
    Ok(Box::new(Signer {
        alg: *alg,
        key: key.as_bytes().to_vec(),
    }))
}

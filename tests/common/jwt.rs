//! JSON Web Tokens for the auth tests (DESIGN §11), signed with ring at test time: keys
//! of every algorithm sluice accepts, tokens well-formed and deliberately broken, RFC 7517
//! key sets, and a JWKS endpoint the tests can rotate, take down and bring back. No private
//! key is ever stored in the repository: each one is generated when a test asks for it.

use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use ring::rand::SystemRandom;
use ring::signature::{self, EcdsaKeyPair, Ed25519KeyPair, KeyPair, RsaKeyPair};
use serde_json::{json, Map, Value};

use super::http::{read_request, Listening};
use super::TempDir;

/// base64url without padding (RFC 7515 §2).
pub fn b64(bytes: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(bytes)
}

/// Seconds since the Unix epoch, now.
pub fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs() as i64
}

/// Lowercase hex SHA-256 of `key`'s UTF-8 bytes, as `[[consumers]] keys` lists it:
/// `sha256:<64 hex digits>`.
pub fn key_digest(key: &str) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, key.as_bytes());
    let hex: String = d.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

enum Key {
    /// RS256 (PKCS#1 v1.5) or PS256 (PSS); `pkcs8` is the private key's DER as openssl
    /// wrote it (PKCS#8 or PKCS#1).
    Rsa {
        pair: RsaKeyPair,
        pss: bool,
        pkcs8: Vec<u8>,
    },
    Ec(EcdsaKeyPair),
    Ed(Ed25519KeyPair),
    Hmac(Vec<u8>),
}

/// A signing key with its `kid` and JWS `alg`.
pub struct Signer {
    pub kid: String,
    pub alg: &'static str,
    key: Key,
}

/// A fresh 2048-bit RSA private key in DER (PKCS#8 or PKCS#1, as the openssl version
/// writes it), from `openssl genpkey`.
fn rsa_pkcs8() -> Vec<u8> {
    let dir = TempDir::new();
    let file = dir.0.join("rsa.der");
    let out = Command::new("openssl")
        .args([
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-outform",
            "DER",
            "-out",
        ])
        .arg(&file)
        .output()
        .expect("openssl is needed for the RSA tests: apt-get install openssl");
    assert!(
        out.status.success(),
        "openssl genpkey: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read(&file).expect("read the generated RSA key")
}

impl Signer {
    fn rsa(kid: &str, pss: bool) -> Signer {
        let pkcs8 = rsa_pkcs8();
        // OpenSSL 3.0 writes `-outform DER` as PKCS#1 (RSAPrivateKey), other versions as
        // PKCS#8: ring reads either.
        let pair = RsaKeyPair::from_pkcs8(&pkcs8)
            .or_else(|_| RsaKeyPair::from_der(&pkcs8))
            .expect("ring accepts openssl's RSA key");
        Signer {
            kid: kid.to_owned(),
            alg: if pss { "PS256" } else { "RS256" },
            key: Key::Rsa { pair, pss, pkcs8 },
        }
    }

    /// RSASSA-PKCS1-v1_5 with SHA-256, a new 2048-bit key.
    pub fn rs256(kid: &str) -> Signer {
        Self::rsa(kid, false)
    }

    /// RSASSA-PSS with SHA-256, a new 2048-bit key.
    pub fn ps256(kid: &str) -> Signer {
        Self::rsa(kid, true)
    }

    /// ECDSA on P-256 with SHA-256, a new key.
    pub fn es256(kid: &str) -> Signer {
        let rng = SystemRandom::new();
        let alg = &signature::ECDSA_P256_SHA256_FIXED_SIGNING;
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(alg, &rng).expect("generate a P-256 key");
        let pair = EcdsaKeyPair::from_pkcs8(alg, pkcs8.as_ref(), &rng).expect("load the P-256 key");
        Signer {
            kid: kid.to_owned(),
            alg: "ES256",
            key: Key::Ec(pair),
        }
    }

    /// Ed25519 (JWS `EdDSA`), a new key.
    pub fn eddsa(kid: &str) -> Signer {
        let rng = SystemRandom::new();
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&rng).expect("generate an Ed25519 key");
        let pair = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).expect("load the Ed25519 key");
        Signer {
            kid: kid.to_owned(),
            alg: "EdDSA",
            key: Key::Ed(pair),
        }
    }

    /// HMAC-SHA256 with `secret`.
    pub fn hs256(kid: &str, secret: &[u8]) -> Signer {
        Signer {
            kid: kid.to_owned(),
            alg: "HS256",
            key: Key::Hmac(secret.to_vec()),
        }
    }

    /// The signature of `input` (the JWS signing input `header.payload`).
    pub fn sign_bytes(&self, input: &[u8]) -> Vec<u8> {
        let rng = SystemRandom::new();
        match &self.key {
            Key::Rsa { pair, pss, .. } => {
                let padding: &'static dyn signature::RsaEncoding = if *pss {
                    &signature::RSA_PSS_SHA256
                } else {
                    &signature::RSA_PKCS1_SHA256
                };
                let mut sig = vec![0u8; pair.public().modulus_len()];
                pair.sign(padding, &rng, input, &mut sig)
                    .expect("RSA signature");
                sig
            }
            Key::Ec(pair) => pair
                .sign(&rng, input)
                .expect("ECDSA signature")
                .as_ref()
                .to_vec(),
            Key::Ed(pair) => pair.sign(input).as_ref().to_vec(),
            Key::Hmac(secret) => hmac_sha256(secret, input),
        }
    }

    /// A token with the default header (`alg`, `typ`, `kid`) and `claims`.
    pub fn sign(&self, claims: &Value) -> String {
        token(self, &json!({}), claims)
    }

    /// The RSA public key as the PKCS#1 `RSAPublicKey` DER that ring holds.
    pub fn rsa_public_pkcs1_der(&self) -> Vec<u8> {
        match &self.key {
            Key::Rsa { pair, .. } => pair.public().as_ref().to_vec(),
            _ => panic!("{} is not an RSA key", self.kid),
        }
    }

    /// The RSA public key as an X.509 SubjectPublicKeyInfo in PEM (`-----BEGIN PUBLIC KEY-----`),
    /// the form an HS/RS confusion attack usually feeds to HMAC; from `openssl pkey`.
    pub fn rsa_public_spki_pem(&self) -> Vec<u8> {
        let Key::Rsa { pkcs8, .. } = &self.key else {
            panic!("{} is not an RSA key", self.kid)
        };
        let dir = TempDir::new();
        let file = dir.0.join("rsa.der");
        std::fs::write(&file, pkcs8).expect("write the RSA key");
        let out = Command::new("openssl")
            .args(["pkey", "-inform", "DER", "-pubout", "-in"])
            .arg(&file)
            .output()
            .expect("run openssl pkey");
        assert!(
            out.status.success(),
            "openssl pkey: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    }

    /// This key as an RFC 7517 JWK (public part only), with `kid`, `alg` and `use`.
    pub fn jwk(&self) -> Value {
        let mut jwk = match &self.key {
            Key::Rsa { pair, .. } => {
                let parts = ring::rsa::PublicKeyComponents::<Vec<u8>>::from(pair.public());
                json!({"kty": "RSA", "n": b64(&parts.n), "e": b64(&parts.e)})
            }
            Key::Ec(pair) => {
                // Uncompressed point: 0x04 || x (32 bytes) || y (32 bytes).
                let p = pair.public_key().as_ref();
                assert_eq!((p.len(), p[0]), (65, 4), "an uncompressed P-256 point");
                json!({"kty": "EC", "crv": "P-256", "x": b64(&p[1..33]), "y": b64(&p[33..])})
            }
            Key::Ed(pair) => {
                json!({"kty": "OKP", "crv": "Ed25519", "x": b64(pair.public_key().as_ref())})
            }
            Key::Hmac(secret) => json!({"kty": "oct", "k": b64(secret)}),
        };
        jwk["kid"] = json!(self.kid);
        jwk["alg"] = json!(self.alg);
        jwk["use"] = json!("sig");
        jwk
    }
}

fn hmac_sha256(secret: &[u8], input: &[u8]) -> Vec<u8> {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    ring::hmac::sign(&key, input).as_ref().to_vec()
}

/// `{"alg": signer.alg, "typ": "JWT", "kid": signer.kid}` with `overrides` merged in; an
/// override of `null` removes the field.
fn header(signer: &Signer, overrides: &Value) -> Value {
    let mut h = Map::new();
    h.insert("alg".into(), json!(signer.alg));
    h.insert("typ".into(), json!("JWT"));
    h.insert("kid".into(), json!(signer.kid));
    if let Some(o) = overrides.as_object() {
        for (k, v) in o {
            if v.is_null() {
                h.remove(k);
            } else {
                h.insert(k.clone(), v.clone());
            }
        }
    }
    Value::Object(h)
}

/// A compact JWS: base64url(header) . base64url(claims) . base64url(signature by `signer`).
/// `header_overrides` change or (with null) remove header fields; the signature covers
/// whatever header results, so e.g. `{"kid": "other"}` gives a validly signed token that
/// names another key.
pub fn token(signer: &Signer, header_overrides: &Value, claims: &Value) -> String {
    let h = header(signer, header_overrides);
    let input = format!(
        "{}.{}",
        b64(h.to_string().as_bytes()),
        b64(claims.to_string().as_bytes())
    );
    let sig = signer.sign_bytes(input.as_bytes());
    format!("{input}.{}", b64(&sig))
}

/// Standard claims: `iss`, `aud`, `sub`, `iat` = now, `exp` = now + `exp_in` seconds, a
/// unique `jti` (so two tokens never share a cache entry), plus `extra` merged in (a null
/// value removes the claim).
pub fn claims(iss: &str, aud: &str, sub: &str, exp_in: i64, extra: &Value) -> Value {
    static N: AtomicUsize = AtomicUsize::new(0);
    let t = now();
    let mut c = json!({
        "iss": iss,
        "aud": aud,
        "sub": sub,
        "iat": t,
        "exp": t + exp_in,
        "jti": format!("t{}-{}", std::process::id(), N.fetch_add(1, Ordering::SeqCst)),
    });
    if let Some(o) = extra.as_object() {
        for (k, v) in o {
            if v.is_null() {
                c.as_object_mut().expect("claims object").remove(k);
            } else {
                c[k] = v.clone();
            }
        }
    }
    c
}

/// `alg: none`: header `{"alg":"none","typ":"JWT","kid":kid}`, the claims, and an empty
/// signature (`h.p.`).
pub fn alg_none(kid: &str, claims: &Value) -> String {
    let h = json!({"alg": "none", "typ": "JWT", "kid": kid});
    format!(
        "{}.{}.",
        b64(h.to_string().as_bytes()),
        b64(claims.to_string().as_bytes())
    )
}

/// `token` with its payload replaced by `claims`, the original header and signature kept.
pub fn tampered_payload(token: &str, claims: &Value) -> String {
    let parts: Vec<&str> = token.split('.').collect();
    assert_eq!(parts.len(), 3, "a compact JWS");
    format!(
        "{}.{}.{}",
        parts[0],
        b64(claims.to_string().as_bytes()),
        parts[2]
    )
}

/// `token` with its header replaced by `header`, payload and signature kept.
pub fn tampered_header(token: &str, header: &Value) -> String {
    let parts: Vec<&str> = token.split('.').collect();
    assert_eq!(parts.len(), 3, "a compact JWS");
    format!(
        "{}.{}.{}",
        b64(header.to_string().as_bytes()),
        parts[1],
        parts[2]
    )
}

/// The HS/RS confusion attack: header `alg: HS256` with the RSA key's `kid`, signed with
/// HMAC-SHA256 whose secret is `public_bytes` (the RSA public key in some encoding a
/// verifier might use as an HMAC secret).
pub fn hmac_with_public_key(rsa: &Signer, public_bytes: &[u8], claims: &Value) -> String {
    let h = json!({"alg": "HS256", "typ": "JWT", "kid": rsa.kid});
    let input = format!(
        "{}.{}",
        b64(h.to_string().as_bytes()),
        b64(claims.to_string().as_bytes())
    );
    format!(
        "{input}.{}",
        b64(&hmac_sha256(public_bytes, input.as_bytes()))
    )
}

/// An RFC 7517 JWK Set of the public parts of `signers`.
pub fn jwks(signers: &[&Signer]) -> Value {
    json!({"keys": signers.iter().map(|s| s.jwk()).collect::<Vec<_>>()})
}

const UP: u8 = 0;
const FAILING: u8 = 1;
const SILENT: u8 = 2;

/// A JWKS endpoint on 127.0.0.1: `GET /jwks.json` answers the current set (HTTP/1.1,
/// `Connection: close`). It can rotate the set, fail (503), drop every connection
/// unanswered, and come back; it counts the requests it got.
pub struct JwksServer {
    pub addr: SocketAddr,
    set: Arc<Mutex<Value>>,
    mode: Arc<AtomicU8>,
    fetches: Arc<AtomicUsize>,
    served: Arc<AtomicUsize>,
    _listening: Listening,
}

impl JwksServer {
    /// Serves `set` from now on.
    pub fn start(set: Value) -> JwksServer {
        Self::start_in(set, UP)
    }

    /// Answers 503 until `up()`: a URL that has never answered.
    pub fn start_failing(set: Value) -> JwksServer {
        Self::start_in(set, FAILING)
    }

    fn start_in(set: Value, mode: u8) -> JwksServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the JWKS server");
        let set = Arc::new(Mutex::new(set));
        let mode = Arc::new(AtomicU8::new(mode));
        let fetches = Arc::new(AtomicUsize::new(0));
        let served = Arc::new(AtomicUsize::new(0));
        let state = (set.clone(), mode.clone(), fetches.clone(), served.clone());
        let listening = Listening::serve(listener, move |conn| {
            let (set, mode, fetches, served) = &state;
            answer(conn, set, mode, fetches, served)
        });
        JwksServer {
            addr: listening.addr,
            set,
            mode,
            fetches,
            served,
            _listening: listening,
        }
    }

    /// `http://127.0.0.1:PORT/jwks.json`
    pub fn url(&self) -> String {
        format!("http://{}/jwks.json", self.addr)
    }

    /// Replaces the set served from now on (a key rotation at the identity provider).
    pub fn set(&self, set: Value) {
        *self.set.lock().unwrap_or_else(|e| e.into_inner()) = set;
    }

    /// Answers 503 from now on.
    pub fn fail(&self) {
        self.mode.store(FAILING, Ordering::SeqCst);
    }

    /// Closes every connection without an answer from now on.
    pub fn go_silent(&self) {
        self.mode.store(SILENT, Ordering::SeqCst);
    }

    /// Serves the set again.
    pub fn up(&self) {
        self.mode.store(UP, Ordering::SeqCst);
    }

    /// Requests for the set received so far, answered or not.
    pub fn fetches(&self) -> usize {
        self.fetches.load(Ordering::SeqCst)
    }

    /// Requests answered with the set (200) so far.
    pub fn served(&self) -> usize {
        self.served.load(Ordering::SeqCst)
    }
}

fn answer(
    conn: TcpStream,
    set: &Mutex<Value>,
    mode: &AtomicU8,
    fetches: &AtomicUsize,
    served: &AtomicUsize,
) {
    let _ = conn.set_read_timeout(Some(std::time::Duration::from_secs(5)));
    let mut reader = BufReader::new(conn.try_clone().expect("clone stream"));
    let mut conn = conn;
    let Some(req) = read_request(&mut reader) else {
        return;
    };
    let target = req.target;
    let path = target.split('?').next().unwrap_or("");
    if path != "/jwks.json" {
        let _ = conn
            .write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        return;
    }
    fetches.fetch_add(1, Ordering::SeqCst);
    let resp = match mode.load(Ordering::SeqCst) {
        SILENT => return,
        FAILING => "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 5\r\nConnection: close\r\n\r\ndown\n".to_owned(),
        _ => {
            let text = set.lock().unwrap_or_else(|e| e.into_inner()).to_string();
            served.fetch_add(1, Ordering::SeqCst);
            format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
                text.len()
            )
        }
    };
    let _ = conn.write_all(resp.as_bytes());
}

//! TLS termination: which certificate a handshake gets (SNI), client certificates, reload.
//!
//! The `ServerConfig` Pingora builds for a TLS listener asks [`Certificates`] for a certificate
//! on every handshake. Its set sits behind an `ArcSwap`, so a reload swaps renewed
//! certificates in for new handshakes while open connections keep theirs. The files were read
//! and checked by `config`; nothing here reads a file.

use std::cell::Cell;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use arc_swap::ArcSwap;
use pingora::listeners::tls::TlsSettings;
use pingora::protocols::Digest;
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;

use crate::config::{ClientAuth, Config, HostMatch, TlsVersion};
use crate::metrics::Metrics;

/// The certificates of one config, indexed by SNI name.
struct CertificateSet {
    exact: HashMap<String, Arc<CertifiedKey>>,
    /// `*.example.com` certificates by ".example.com": one lookup per distinct suffix
    /// length, longest first, however many certificates there are (DESIGN §16).
    wildcards: HashMap<String, Arc<CertifiedKey>>,
    /// The distinct lengths of `wildcards`' suffixes, longest first.
    wildcard_lengths: Vec<usize>,
    /// The first `[[certificates]]` entry: for no SNI, or a name nobody lists.
    default: Option<Arc<CertifiedKey>>,
    min_version: TlsVersion,
}

impl CertificateSet {
    fn new(config: &Config) -> CertificateSet {
        let mut exact = HashMap::new();
        let mut wildcards = HashMap::new();
        for cert in &config.certificates {
            for host in &cert.hosts {
                match host {
                    HostMatch::Exact(name) => {
                        exact
                            .entry(name.clone())
                            .or_insert_with(|| cert.key.clone());
                    }
                    // The earlier entry wins, as for exact names.
                    HostMatch::Suffix(suffix) => {
                        wildcards
                            .entry(suffix.clone())
                            .or_insert_with(|| cert.key.clone());
                    }
                }
            }
        }
        CertificateSet {
            exact,
            wildcard_lengths: lengths_longest_first(&wildcards),
            wildcards,
            default: config.certificates.first().map(|c| c.key.clone()),
            min_version: config.tls.min_version,
        }
    }

    /// Exact name first, then the longest matching wildcard, else the default.
    fn pick(&self, server_name: Option<&str>) -> Option<Arc<CertifiedKey>> {
        if let Some(name) = server_name {
            let name = name.trim_end_matches('.').to_ascii_lowercase();
            if let Some(key) = self.exact.get(&name) {
                return Some(key.clone());
            }
            for &len in &self.wildcard_lengths {
                // "*.example.com" covers "a.example.com", never "example.com" itself.
                let found = (name.len() > len)
                    .then(|| name.get(name.len() - len..))
                    .flatten()
                    .and_then(|suffix| self.wildcards.get(suffix));
                if let Some(key) = found {
                    return Some(key.clone());
                }
            }
        }
        self.default.clone()
    }
}

fn lengths_longest_first(wildcards: &HashMap<String, Arc<CertifiedKey>>) -> Vec<usize> {
    let mut lengths: Vec<usize> = wildcards.keys().map(String::len).collect();
    lengths.sort_unstable_by(|a, b| b.cmp(a));
    lengths.dedup();
    lengths
}

/// The certificate resolver every TLS listener shares; `update` swaps in a new config's set.
pub struct Certificates {
    current: ArcSwap<CertificateSet>,
}

impl Certificates {
    pub fn new(config: &Config) -> Arc<Certificates> {
        Arc::new(Certificates {
            current: ArcSwap::from_pointee(CertificateSet::new(config)),
        })
    }

    /// New handshakes get `config`'s certificates (and `min_version`) from now on.
    pub fn update(&self, config: &Config, metrics: &Metrics) {
        self.current.store(Arc::new(CertificateSet::new(config)));
        // Certificates dropped from the config must not keep reporting an expiry.
        metrics.tls_certificate_expiry.reset();
        for cert in &config.certificates {
            metrics
                .tls_certificate_expiry
                .with_label_values(&[&cert.name])
                .set(cert.not_after);
        }
    }
}

impl fmt::Debug for Certificates {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let set = self.current.load();
        f.debug_struct("Certificates")
            .field("exact", &set.exact.keys().collect::<Vec<_>>())
            .field("wildcards", &set.wildcards.len())
            .finish()
    }
}

/// TLS 1.3 cipher suites (RFC 8446 B.4) are 0x13XX.
fn offers_tls13(hello: &ClientHello) -> bool {
    hello
        .cipher_suites()
        .iter()
        .any(|suite| u16::from(*suite) >> 8 == 0x13)
}

impl ResolvesServerCert for Certificates {
    fn resolve(&self, hello: ClientHello) -> Option<Arc<CertifiedKey>> {
        let set = self.current.load();
        // Pingora's listener enables TLS 1.2 and 1.3 and does not let us change that, so
        // `min_version = "1.3"` is enforced here: rustls negotiates 1.3 with every client
        // that offers it, and a client limited to 1.2 offers no TLS 1.3 cipher suite.
        // Answering no certificate fails that handshake with an alert.
        let below = set.min_version == TlsVersion::V1_3 && !offers_tls13(&hello);
        REFUSED.set(below.then_some(BELOW_MIN_VERSION));
        if below {
            return None;
        }
        set.pick(hello.server_name())
    }
}

thread_local! {
    /// Why this thread's resolver refused the handshake it last saw, until that is logged.
    static REFUSED: Cell<Option<&'static str>> = const { Cell::new(None) };
}

/// What rustls says of a handshake its resolver answered with no certificate, whatever the
/// reason.
const UNRESOLVED: &str = "no server certificate chain resolved";
const BELOW_MIN_VERSION: &str =
    "the client offers TLS 1.2 at most, below [tls] min_version = \"1.3\"";

/// A logger that says why a handshake was refused where Pingora logs rustls's words for
/// it (#43 item 8): a client below `min_version` gets no certificate, which rustls calls
/// "no server certificate chain resolved". Pingora logs the failed handshake on the thread
/// that ran the resolver, in the same poll, so the reason the resolver left there is the
/// one of that line. Other records pass as they are, formatted only while a reason waits.
pub struct ExplainRefusals<L>(pub L);

impl<L: log::Log> log::Log for ExplainRefusals<L> {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        self.0.enabled(metadata)
    }

    fn log(&self, record: &log::Record) {
        if let Some(why) = REFUSED.get() {
            if record.target().starts_with("pingora") {
                let text = record.args().to_string();
                if text.contains(UNRESOLVED) {
                    REFUSED.set(None);
                    let text = text.replace(UNRESOLVED, why);
                    return self.0.log(
                        &log::Record::builder()
                            .args(format_args!("{text}"))
                            .metadata(record.metadata().clone())
                            .module_path(record.module_path())
                            .file(record.file())
                            .line(record.line())
                            .build(),
                    );
                }
            }
        }
        self.0.log(record);
    }

    fn flush(&self) {
        self.0.flush();
    }
}

/// The settings of one TLS listener: ALPN h2 and http/1.1, the shared resolver, and client
/// certificate verification from `[tls]`. `client_auth` and `client_ca` are fixed here until
/// a restart.
pub fn settings(config: &Config, certificates: Arc<Certificates>) -> Result<TlsSettings, String> {
    // With a resolver the paths are never read.
    let mut settings = TlsSettings::intermediate("", "").map_err(|e| e.to_string())?;
    settings.enable_h2();
    settings.set_cert_resolver(certificates);
    if config.tls.client_auth != ClientAuth::Off {
        let mut roots = rustls::RootCertStore::empty();
        for ca in &config.tls.client_ca {
            roots
                .add(ca.clone())
                .map_err(|e| format!("client_ca: {e}"))?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
        let builder = match config.tls.client_auth {
            ClientAuth::Optional => builder.allow_unauthenticated(),
            _ => builder,
        };
        let verifier = builder.build().map_err(|e| format!("client_ca: {e}"))?;
        settings.set_client_cert_verifier(verifier);
    }
    Ok(settings)
}

/// The `client_cert` key part: lower-case hex SHA-256 of the client's leaf certificate (DER).
/// Pingora's rustls digest already holds exactly that hash, present only when the client
/// presented a certificate that the verifier accepted.
pub fn client_cert_id(digest: Option<&Digest>) -> Option<String> {
    let hash = &digest?.ssl_digest.as_ref()?.cert_digest;
    if hash.is_empty() {
        return None;
    }
    let mut out = String::with_capacity(hash.len() * 2);
    for b in hash {
        out.push(char::from(b"0123456789abcdef"[usize::from(b >> 4)]));
        out.push(char::from(b"0123456789abcdef"[usize::from(b & 15)]));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(tag: u8) -> Arc<CertifiedKey> {
        // Only identity matters to `pick`; a throw-away key type would need a real key.
        struct Tag;
        impl fmt::Debug for Tag {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("Tag")
            }
        }
        impl rustls::sign::SigningKey for Tag {
            fn choose_scheme(
                &self,
                _: &[rustls::SignatureScheme],
            ) -> Option<Box<dyn rustls::sign::Signer>> {
                None
            }
            fn algorithm(&self) -> rustls::SignatureAlgorithm {
                rustls::SignatureAlgorithm::ECDSA
            }
        }
        let der = rustls::pki_types::CertificateDer::from(vec![tag]);
        Arc::new(CertifiedKey::new(vec![der], Arc::new(Tag)))
    }

    fn tag(k: Option<Arc<CertifiedKey>>) -> Option<u8> {
        k.map(|k| k.cert[0].as_ref()[0])
    }

    #[test]
    fn client_cert_id_is_the_hex_sha256_of_the_leaf_der() {
        use pingora::protocols::tls::SslDigest;
        // Pingora fills `cert_digest` with `hash_certificate(leaf)`: SHA-256 of the DER.
        let leaf = rustls::pki_types::CertificateDer::from(b"abc".to_vec());
        let ssl = SslDigest::new("", "", None, None, pingora::tls::hash_certificate(&leaf));
        let digest = Digest {
            ssl_digest: Some(Arc::new(ssl)),
            ..Digest::default()
        };
        assert_eq!(
            client_cert_id(Some(&digest)).as_deref(),
            Some("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
        );
        let no_cert = Digest {
            ssl_digest: Some(Arc::new(SslDigest::new("", "", None, None, Vec::new()))),
            ..Digest::default()
        };
        assert_eq!(client_cert_id(Some(&no_cert)), None);
        assert_eq!(client_cert_id(Some(&Digest::default())), None);
        assert_eq!(client_cert_id(None), None);
    }

    #[test]
    fn sni_exact_then_longest_wildcard_then_default() {
        let wildcards = HashMap::from([
            (".eu.example.com".to_owned(), key(3)),
            (".example.com".to_owned(), key(2)),
        ]);
        let set = CertificateSet {
            exact: HashMap::from([("api.example.com".to_owned(), key(1))]),
            wildcard_lengths: lengths_longest_first(&wildcards),
            wildcards,
            default: Some(key(9)),
            min_version: TlsVersion::V1_2,
        };
        assert_eq!(tag(set.pick(Some("api.example.com"))), Some(1));
        assert_eq!(tag(set.pick(Some("API.Example.com."))), Some(1));
        assert_eq!(tag(set.pick(Some("www.example.com"))), Some(2));
        assert_eq!(tag(set.pick(Some("a.eu.example.com"))), Some(3));
        assert_eq!(tag(set.pick(Some("example.com"))), Some(9));
        assert_eq!(tag(set.pick(Some("other.test"))), Some(9));
        assert_eq!(tag(set.pick(None)), Some(9));
    }
}

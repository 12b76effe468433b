//! `ca_file`, `client_cert` and `client_key` of an upstream (DESIGN §20): the CAs trusted for
//! it and the certificate sluice presents to it, read and checked when the config is loaded.

use std::fmt;
use std::path::Path;

use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use super::certs;
use super::read::{Problems, Table};
use super::tree::Spanned;

/// The TLS material of one upstream, as DER; empty when it names none.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct UpstreamTls {
    /// `ca_file`: the only roots trusted for this upstream; `None`: the system's roots.
    pub ca: Option<Vec<CertificateDer<'static>>>,
    /// `client_cert` / `client_key`: mutual TLS.
    pub client: Option<ClientCert>,
}

/// A client certificate chain (leaf first) and its private key, checked to match.
#[derive(Clone, PartialEq, Eq)]
pub struct ClientCert {
    pub chain: Vec<CertificateDer<'static>>,
    /// The key's DER (PKCS#8, PKCS#1 or SEC1), as `PrivateKeyDer::try_from` reads it back.
    pub key: Vec<u8>,
}

impl fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("ca", &self.ca.as_ref().map(Vec::len))
            .field("client", &self.client)
            .finish()
    }
}

impl fmt::Debug for ClientCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the key.
        f.debug_struct("ClientCert")
            .field("chain", &self.chain.len())
            .finish_non_exhaustive()
    }
}

/// Reads `ca_file`, `client_cert` and `client_key` of `t` (paths relative to `dir`); each
/// problem is located at the value (or key) it is about.
pub(super) fn upstream_tls(p: &Problems, t: &Table, dir: &Path, tls: bool) -> UpstreamTls {
    let ca_file = t.string("ca_file");
    let cert = t.string("client_cert");
    let key = t.string("client_key");
    if !tls {
        for name in ["ca_file", "client_cert", "client_key"] {
            if t.get(name).is_some() {
                p.at(&t.key_span(name), format!("`{name}` needs `tls = true`"));
            }
        }
        return UpstreamTls::default();
    }
    let ca = ca_file.and_then(|path| match read_ca(&dir.join(&path.value)) {
        Ok(ca) => Some(ca),
        Err(e) => {
            p.at(&path.span, format!("`ca_file`: {e}"));
            None
        }
    });
    let client = match (cert, key) {
        (Some(cert), Some(key)) => client_cert(p, &cert, &key, dir),
        (Some(_), None) => {
            p.at(
                &t.key_span("client_cert"),
                "`client_cert` needs `client_key`",
            );
            None
        }
        (None, Some(_)) => {
            p.at(
                &t.key_span("client_key"),
                "`client_key` needs `client_cert`",
            );
            None
        }
        (None, None) => None,
    };
    UpstreamTls { ca, client }
}

/// The CAs of `path`, each a usable trust anchor and a parseable X.509 certificate.
fn read_ca(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let ca = certs::read_ca(path)?;
    for cert in &ca {
        parseable(cert, path)?;
    }
    Ok(ca)
}

fn parseable(cert: &CertificateDer<'_>, path: &Path) -> Result<(), String> {
    x509_parser::parse_x509_certificate(cert.as_ref())
        .map(|_| ())
        .map_err(|e| format!("cannot parse a certificate in \"{}\": {e}", path.display()))
}

fn client_cert(
    p: &Problems,
    cert: &Spanned<String>,
    key: &Spanned<String>,
    dir: &Path,
) -> Option<ClientCert> {
    let (cert_path, key_path) = (dir.join(&cert.value), dir.join(&key.value));
    let loaded = match certs::read_pair(&cert_path, &key_path) {
        Ok(loaded) => loaded,
        Err(problems) => {
            for problem in problems {
                match problem {
                    certs::Problem::Cert(m) => p.at(&cert.span, format!("`client_cert`: {m}")),
                    certs::Problem::Key(m) => p.at(&key.span, format!("`client_key`: {m}")),
                }
            }
            return None;
        }
    };
    if let Some(soon) = loaded.expires_soon {
        p.warn(&cert.span, format!("`client_cert`: {soon}"));
    }
    let chain = loaded.key.cert.clone();
    for c in &chain {
        if let Err(e) = parseable(c, &cert_path) {
            p.at(&cert.span, format!("`client_cert`: {e}"));
            return None;
        }
    }
    // Read as rustls will read it back when the handshake presents it.
    let der = match certs::read_key(&key_path) {
        Ok(k) => k.secret_der().to_vec(),
        Err(e) => {
            p.at(&key.span, format!("`client_key`: {e}"));
            return None;
        }
    };
    if PrivateKeyDer::try_from(der.clone()).is_err() {
        p.at(
            &key.span,
            format!(
                "`client_key`: unsupported private key in \"{}\" (expected PKCS#8, PKCS#1 or SEC1)",
                key_path.display()
            ),
        );
        return None;
    }
    Some(ClientCert { chain, key: der })
}

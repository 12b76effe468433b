//! `[tls]` and `[[certificates]]` (DESIGN §8): their types and readers; the files are read
//! and checked here (`certs`), so a bad certificate is a located config error.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use rustls::sign::CertifiedKey;

use super::certs;
use super::read::{Problems, Table};
use super::routes::HostMatch;
use super::tree::{Node, Spanned};

/// `[tls]`: settings shared by every `tls_listen` listener.
#[derive(Debug, Clone, PartialEq)]
pub struct Tls {
    pub min_version: TlsVersion,
    pub client_auth: ClientAuth,
    /// The CA certificates from `client_ca` (empty when it is not given).
    pub client_ca: Vec<CertificateDer<'static>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum TlsVersion {
    V1_2,
    V1_3,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    Off,
    Optional,
    Require,
}

/// One `[[certificates]]` entry, read from its files when the config was loaded.
#[derive(Debug, Clone)]
pub struct Certificate {
    /// SNI names: exact names, or `*.example.com` as `Suffix(".example.com")`.
    pub hosts: Vec<HostMatch>,
    /// The first entry of `hosts` as written: the `certificate` metric label.
    pub name: String,
    /// The chain (leaf first) with its private key, checked to match.
    pub key: Arc<CertifiedKey>,
    /// The leaf's notAfter, in Unix seconds.
    pub not_after: i64,
}

impl Default for Tls {
    fn default() -> Self {
        Tls {
            min_version: TlsVersion::V1_2,
            client_auth: ClientAuth::Off,
            client_ca: Vec::new(),
        }
    }
}

pub(super) fn tls(p: &Problems, node: &Spanned<Node>, dir: &Path) -> Option<Tls> {
    let t = Table::new(p, "[tls]", node)?;
    let min_version = t
        .choice(
            "min_version",
            &[("1.2", TlsVersion::V1_2), ("1.3", TlsVersion::V1_3)],
        )
        .unwrap_or(TlsVersion::V1_2);
    let client_auth = t
        .choice(
            "client_auth",
            &[
                ("off", ClientAuth::Off),
                ("optional", ClientAuth::Optional),
                ("require", ClientAuth::Require),
            ],
        )
        .unwrap_or(ClientAuth::Off);
    let ca = t.string("client_ca");
    let client_ca = match &ca {
        Some(path) => certs::read_ca(&dir.join(&path.value)).unwrap_or_else(|e| {
            p.at(&path.span, format!("`client_ca`: {e}"));
            Vec::new()
        }),
        None => Vec::new(),
    };
    if ca.is_none() && client_auth != ClientAuth::Off {
        p.at(
            &t.key_span("client_auth"),
            "`client_auth` other than \"off\" needs `client_ca`",
        );
    }
    t.finish();
    Some(Tls {
        min_version,
        client_auth,
        client_ca,
    })
}

pub(super) fn certificates(p: &Problems, node: &Spanned<Node>, dir: &Path) -> Vec<Certificate> {
    let Node::Array(items) = &node.value else {
        p.at(
            &node.span,
            format!(
                "`certificates` must be an array of tables ([[certificates]]), found {}",
                node.value.kind()
            ),
        );
        return Vec::new();
    };
    let mut seen: HashMap<String, ()> = HashMap::new();
    let mut out = Vec::new();
    for item in items {
        let Some(t) = Table::new(p, "[[certificates]]", item) else {
            continue;
        };
        let hosts = t.required("hosts").and_then(|_| t.strings("hosts"));
        if hosts.as_ref().is_some_and(Vec::is_empty) {
            p.at(&t.key_span("hosts"), "`hosts` needs at least one name");
        }
        let hosts = hosts.unwrap_or_default();
        let matches: Vec<HostMatch> = hosts
            .iter()
            .filter_map(|h| {
                let host = h.value.to_ascii_lowercase();
                if seen.insert(host.clone(), ()).is_some() {
                    p.at(
                        &h.span,
                        format!("`hosts`: \"{}\" is already served by an earlier certificate", h.value),
                    );
                }
                match host.strip_prefix("*.") {
                    Some(rest) if !rest.is_empty() && !rest.contains('*') => {
                        Some(HostMatch::Suffix(format!(".{rest}")))
                    }
                    None if !host.is_empty() && !host.contains('*') => Some(HostMatch::Exact(host)),
                    _ => {
                        p.at(
                            &h.span,
                            format!("`hosts`: bad name \"{}\" (expected \"api.example.com\" or \"*.example.com\")", h.value),
                        );
                        None
                    }
                }
            })
            .collect();
        let cert = t.required("cert").and_then(|_| t.string("cert"));
        let key = t.required("key").and_then(|_| t.string("key"));
        t.finish();
        let (Some(cert), Some(key)) = (cert, key) else {
            continue;
        };
        let loaded = certs::read_pair(&dir.join(&cert.value), &dir.join(&key.value));
        let loaded = match loaded {
            Ok(loaded) => loaded,
            Err(problems) => {
                for problem in problems {
                    match problem {
                        certs::Problem::Cert(m) => p.at(&cert.span, format!("`cert`: {m}")),
                        certs::Problem::Key(m) => p.at(&key.span, format!("`key`: {m}")),
                    }
                }
                continue;
            }
        };
        if let Some(soon) = loaded.expires_soon {
            p.warn(&cert.span, format!("`cert`: {soon}"));
        }
        let Some(name) = hosts.first() else { continue };
        out.push(Certificate {
            hosts: matches,
            name: name.value.clone(),
            key: loaded.key,
            not_after: loaded.not_after,
        });
    }
    out
}

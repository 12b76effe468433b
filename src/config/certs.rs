//! Reading and checking certificate, key and CA files named by the config (DESIGN §8).

use std::path::Path;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;

/// A certificate expiring sooner than this is a warning.
const EXPIRY_WARNING_SECS: i64 = 7 * 86_400;

/// What is wrong, and with which of the two files (so it can be located at that value).
#[derive(Debug, PartialEq, Eq)]
pub enum Problem {
    Cert(String),
    Key(String),
}

/// A certificate chain and its key, ready to serve.
pub struct Loaded {
    pub key: Arc<CertifiedKey>,
    /// The leaf's notAfter, Unix seconds.
    pub not_after: i64,
    /// A warning when the leaf expires within 7 days.
    pub expires_soon: Option<String>,
}

/// Reads a PEM chain (leaf first) and its private key, and checks that they belong together
/// and that the leaf has not expired.
pub fn read_pair(cert_path: &Path, key_path: &Path) -> Result<Loaded, Vec<Problem>> {
    let chain = read_certs(cert_path).map_err(Problem::Cert);
    let key = read_key(key_path).map_err(Problem::Key);
    let (chain, key) = match (chain, key) {
        (Ok(chain), Ok(key)) => (chain, key),
        (chain, key) => return Err([chain.err(), key.err()].into_iter().flatten().collect()),
    };
    let leaf = chain.first().map(|c| c.as_ref()).unwrap_or_default();
    let (not_before, not_after) = match x509_parser::parse_x509_certificate(leaf) {
        Ok((_, parsed)) => (
            parsed.validity().not_before.timestamp(),
            parsed.validity().not_after.timestamp(),
        ),
        Err(e) => {
            return Err(vec![Problem::Cert(format!(
                "cannot parse the first certificate in \"{}\": {e}",
                cert_path.display()
            ))])
        }
    };
    let signing_key = rustls::crypto::ring::sign::any_supported_type(&key).map_err(|e| {
        vec![Problem::Key(format!(
            "unsupported private key in \"{}\": {e}",
            key_path.display()
        ))]
    })?;
    let certified = CertifiedKey::new(chain, signing_key);
    let mut problems = Vec::new();
    if let Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) =
        certified.keys_match()
    {
        problems.push(Problem::Key(format!(
            "the private key in \"{}\" does not match the certificate in \"{}\"",
            key_path.display(),
            cert_path.display()
        )));
    }
    let now = now_secs();
    if not_after < now {
        problems.push(Problem::Cert(format!(
            "the certificate in \"{}\" expired on {}",
            cert_path.display(),
            utc(not_after)
        )));
    } else if not_before > now {
        problems.push(Problem::Cert(format!(
            "the certificate in \"{}\" is not valid before {}",
            cert_path.display(),
            utc(not_before)
        )));
    }
    if !problems.is_empty() {
        return Err(problems);
    }
    let expires_soon = (not_after - now < EXPIRY_WARNING_SECS).then(|| {
        format!(
            "the certificate in \"{}\" expires on {}, in less than 7 days",
            cert_path.display(),
            utc(not_after)
        )
    });
    Ok(Loaded {
        key: Arc::new(certified),
        not_after,
        expires_soon,
    })
}

/// The CA certificates in a PEM file, each usable as a trust anchor.
pub fn read_ca(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = read_certs(path)?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in &certs {
        roots.add(cert.clone()).map_err(|e| {
            format!(
                "a certificate in \"{}\" is not a usable CA: {e}",
                path.display()
            )
        })?;
    }
    Ok(certs)
}

fn read_file(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read \"{}\": {e}", path.display()))
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let bytes = read_file(path)?;
    let certs: Vec<CertificateDer<'static>> = rustls_pemfile::certs(&mut bytes.as_slice())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("bad PEM in \"{}\": {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "no certificate in \"{}\" (expected PEM: -----BEGIN CERTIFICATE-----)",
            path.display()
        ));
    }
    Ok(certs)
}

pub(super) fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    let bytes = read_file(path)?;
    match rustls_pemfile::private_key(&mut bytes.as_slice()) {
        Ok(Some(key)) => Ok(key),
        Ok(None) => Err(format!(
            "no private key in \"{}\" (expected PEM: PKCS#8, PKCS#1 or SEC1)",
            path.display()
        )),
        Err(e) => Err(format!("bad PEM in \"{}\": {e}", path.display())),
    }
}

fn now_secs() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// "2026-11-23 19:32:16 UTC" for Unix seconds (proleptic Gregorian, as X.509 uses).
pub fn utc(secs: i64) -> String {
    let days = secs.div_euclid(86_400);
    let rest = secs.rem_euclid(86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_dates() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc(1_795_462_336), "2026-11-23 19:32:16 UTC");
        assert_eq!(utc(253_402_300_799), "9999-12-31 23:59:59 UTC");
    }

    #[test]
    fn missing_files_name_both() {
        let problems = read_pair(
            Path::new("/nonexistent/a.pem"),
            Path::new("/nonexistent/a.key"),
        )
        .err()
        .unwrap_or_default();
        assert_eq!(problems.len(), 2);
        assert!(
            matches!(&problems[0], Problem::Cert(m) if m.starts_with("cannot read \"/nonexistent/a.pem\": "))
        );
        assert!(
            matches!(&problems[1], Problem::Key(m) if m.starts_with("cannot read \"/nonexistent/a.key\": "))
        );
    }
}

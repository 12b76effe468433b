//! TLS to upstreams (DESIGN §20): `ca_file` trusted instead of the system's roots, and
//! `client_cert` / `client_key` presented to an upstream that requires a client certificate.
//! The real binary, a Python TLS upstream (tests/tls_upstream.py) requiring a certificate
//! issued by a private CA, and keys made by the `openssl` CLI at test time.

mod common;

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::{openssl, Sluice, TempDir, SLUICE};

/// A private CA (`ca.pem`), a server certificate for "upstream.test" (`srv.pem`, `srv.key`)
/// and a client certificate "sluice-client" (`client.pem`, `client.key`), all issued by it;
/// and, under `other/`, a CA that issued none of them.
struct Pki(TempDir);

impl Pki {
    fn new() -> Pki {
        let dir = TempDir::new();
        let d = dir.0.as_path();
        common::tls_files(d, "DNS:upstream.test");
        openssl(
            d,
            &[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-keyout",
                "client.key",
                "-out",
                "client.csr",
                "-subj",
                "/CN=sluice-client",
            ],
        );
        std::fs::write(
            d.join("client.ext"),
            "extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n",
        )
        .expect("write client.ext");
        openssl(
            d,
            &[
                "x509",
                "-req",
                "-in",
                "client.csr",
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                "client.pem",
                "-days",
                "2",
                "-extfile",
                "client.ext",
            ],
        );
        let other = d.join("other");
        std::fs::create_dir_all(&other).expect("mkdir other");
        common::tls_files(&other, "DNS:other.test");
        Pki(dir)
    }

    fn path(&self, file: &str) -> String {
        self.0 .0.join(file).display().to_string()
    }
}

/// tests/tls_upstream.py serving `srv.pem`, requiring a client certificate issued by the CA.
struct TlsUpstream {
    child: Child,
    port: u16,
}

impl TlsUpstream {
    fn start(pki: &Pki) -> TlsUpstream {
        let portfile = PathBuf::from(pki.path("port"));
        let child = Command::new("python3")
            .arg("tests/tls_upstream.py")
            .args([
                pki.path("srv.pem"),
                pki.path("srv.key"),
                portfile.display().to_string(),
                pki.path("ca.pem"),
            ])
            .spawn()
            .expect("python3 for the TLS upstream");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !portfile.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let port = std::fs::read_to_string(&portfile)
            .expect("TLS upstream port")
            .trim()
            .parse()
            .expect("a port");
        TlsUpstream { child, port }
    }
}

impl Drop for TlsUpstream {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One upstream per (name, extra lines) at port `port`, SNI "upstream.test", and a route
/// `/NAME` to each.
fn config(port: u16, upstreams: &[(&str, String)]) -> String {
    let mut out = String::from(
        "[server]\nlisten = [\"{listen}\"]\naccess_log = \"off\"\n[admin]\nlisten = \"{admin}\"\n",
    );
    for (name, extra) in upstreams {
        out.push_str(&format!(
            "[upstreams.{name}]\nservers = [\"127.0.0.1:{port}\"]\ntls = true\nsni = \"upstream.test\"\n{extra}\n"
        ));
    }
    for (name, _) in upstreams {
        out.push_str(&format!(
            "[[routes]]\nname = \"{name}\"\npath_prefix = \"/{name}\"\nupstream = \"{name}\"\n"
        ));
    }
    out
}

fn ca_file(path: &str) -> String {
    format!("ca_file = \"{path}\"\n")
}

fn client_cert(pki: &Pki) -> String {
    format!(
        "client_cert = \"{}\"\nclient_key = \"{}\"\n",
        pki.path("client.pem"),
        pki.path("client.key")
    )
}

#[test]
fn a_private_ca_and_a_client_certificate_are_both_needed() {
    let pki = Pki::new();
    let upstream = TlsUpstream::start(&pki);
    let ca = ca_file(&pki.path("ca.pem"));
    let s = Sluice::start(&config(
        upstream.port,
        &[
            ("both", format!("{ca}{}", client_cert(&pki))),
            ("no_cert", ca.clone()),
            ("no_ca", client_cert(&pki)),
        ],
    ));
    let r = s.get("/both?x=1");
    assert_eq!(
        (r.status, r.body.as_str()),
        (
            200,
            "tls sni=upstream.test path=/both?x=1 client=sluice-client\n"
        ),
        "{}",
        s.stderr()
    );
    // The upstream refuses a handshake without a client certificate.
    assert_eq!(s.get("/no_cert").status, 502);
    // The system's roots do not know the private CA.
    assert_eq!(s.get("/no_ca").status, 502);
    // Still served: the failures above took nothing from the mutual-TLS upstream.
    assert_eq!(s.get("/both").status, 200);
}

fn reloads(s: &Sluice) -> f64 {
    s.metric(r#"sluice_config_reloads_total{result="success"}"#)
}

fn reload_and_wait(s: &Sluice, template: &str) {
    let before = reloads(s);
    s.reload(template);
    assert!(
        s.wait_for(Duration::from_secs(10), || reloads(s) > before),
        "reload not counted: {}",
        s.stderr()
    );
}

#[test]
fn a_reload_reads_the_ca_file_again() {
    let pki = Pki::new();
    let upstream = TlsUpstream::start(&pki);
    let trust = pki.path("trust.pem");
    std::fs::copy(pki.path("other/ca.pem"), &trust).expect("copy the other CA");
    let template = config(
        upstream.port,
        &[("api", format!("{}{}", ca_file(&trust), client_cert(&pki)))],
    );
    let s = Sluice::start(&template);
    assert_eq!(s.get("/api").status, 502, "a CA that did not issue it");

    std::fs::copy(pki.path("ca.pem"), &trust).expect("copy the CA");
    reload_and_wait(&s, &template);
    assert_eq!(s.get("/api").status, 200, "{}", s.stderr());
    assert_eq!(s.get("/api").status, 200);

    // Trust withdrawn: a connection verified against the old CAs is not reused.
    std::fs::copy(pki.path("other/ca.pem"), &trust).expect("copy the other CA");
    reload_and_wait(&s, &template);
    assert_eq!(s.get("/api").status, 502);
}

#[test]
fn check_locates_a_key_that_does_not_match_its_certificate() {
    let pki = Pki::new();
    let dir = TempDir::new();
    let path = dir.0.join("sluice.toml");
    let text = format!(
        "[server]\nlisten = [\"127.0.0.1:8080\"]\n[upstreams.api]\nservers = [\"127.0.0.1:9443\"]\ntls = true\nclient_cert = \"{}\"\nclient_key = \"{}\"\n[[routes]]\nname = \"r\"\nupstream = \"api\"\n",
        pki.path("client.pem"),
        pki.path("srv.key"),
    );
    std::fs::write(&path, text).expect("write config");
    let out = Command::new(SLUICE)
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .expect("run sluice check");
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim_end(),
        format!(
            "{}:7:14: `client_key`: the private key in \"{}\" does not match the certificate in \"{}\"",
            path.display(),
            pki.path("srv.key"),
            pki.path("client.pem"),
        )
    );
}

//! A policy's own 429 body (DESIGN §20, `reject = { body_file, content_type }`) through the
//! real binary: placeholders replaced, the configured content type, the file read again on
//! reload (relative to the config file), and the problem+json default elsewhere. A missing
//! file is a located config error (tests/config_errors.rs, calendar_reject.toml).

mod common;

use std::time::Duration;

use common::{config, policy, Sluice, TempDir};

const BODY: &str = r#"{"error":{"code":"rate_limited","policy":"{policy}","limit":{limit},"period":"{period}","retry_after":{retry_after}},"raw":"{other}"}"#;

fn template(body_file: &str) -> String {
    let reject = format!(
        "reject = {{ body_file = \"{body_file}\", content_type = \"application/vnd.api+json\" }}"
    );
    config(
        "deny_cache = 0",
        "",
        &format!(
            "{}{}",
            policy("custom", "fixed_window", 2, "1h", "", &reject),
            policy("plain", "fixed_window", 1, "1h", "", "")
        ),
        &[("custom", "\"custom\""), ("plain", "\"plain\"")],
    )
}

/// The third request to `/custom` (two are allowed).
fn denied(s: &Sluice) -> common::http::Response {
    loop {
        let r = s.get("/custom");
        if r.status != 200 {
            return r;
        }
    }
}

#[test]
fn a_policy_answers_429_with_its_own_body_read_again_on_reload() {
    let dir = TempDir::new();
    let file = dir.0.join("reject.json");
    std::fs::write(&file, BODY).expect("write body");
    let s = Sluice::start(&template(file.to_str().expect("utf-8 path")));

    let r = denied(&s);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("content-type"), Some("application/vnd.api+json"));
    let retry = r.header("retry-after").expect("Retry-After");
    assert!(r.header("ratelimit").is_some(), "headers unchanged");
    assert_eq!(
        r.body,
        format!(
            r#"{{"error":{{"code":"rate_limited","policy":"custom","limit":2,"period":"1h","retry_after":{retry}}},"raw":"{{other}}"}}"#
        )
    );

    // Another policy keeps the problem+json body.
    assert_eq!(s.get("/plain").status, 200);
    let plain = s.get("/plain");
    assert_eq!(plain.status, 429);
    assert_eq!(
        plain.header("content-type"),
        Some("application/problem+json")
    );
    assert!(plain.body.contains("\"violated-policies\":[\"plain\"]"));

    // Reload: a file next to the config, named relatively, and read at reload.
    let beside = s.config.parent().expect("config dir").join("limited.txt");
    std::fs::write(&beside, "slow down: {policy} allows {limit} per {period}\n").expect("write");
    s.reload(&template("limited.txt").replace("application/vnd.api+json", "text/plain"));
    assert!(
        s.wait_for(Duration::from_secs(10), || s.get("/custom").body
            == "slow down: custom allows 2 per 1h\n"),
        "the reloaded body: {}",
        s.stderr()
    );
    let r = s.get("/custom");
    assert_eq!(r.header("content-type"), Some("text/plain"));

    // The same file changed, and the config reloaded: its new text is served.
    std::fs::write(&beside, "still limited\n").expect("write");
    s.signal("HUP");
    assert!(
        s.wait_for(Duration::from_secs(10), || s.get("/custom").body
            == "still limited\n"),
        "the file read again on reload"
    );

    // A reload whose file is gone is refused: the body in force stays.
    std::fs::remove_file(&beside).expect("remove");
    s.signal("HUP");
    assert!(
        s.wait_for(Duration::from_secs(10), || s
            .stderr()
            .contains("limited.txt")),
        "the refused reload is logged: {}",
        s.stderr()
    );
    assert_eq!(s.get("/custom").body, "still limited\n");
}

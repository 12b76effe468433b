//! The operator console (DESIGN §15) in a real headless Chromium against the real binary:
//! the token, live rates, a key's quota, reset, overrides, API keys, and hostile key values
//! shown as text.
//!
//! `SLUICE_CONSOLE_SCREENSHOTS=DIR cargo test --release --test console -- --ignored` (or
//! `make console-screenshots`) writes the README's screenshots into DIR.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::browser::Browser;
use common::echo::EchoUpstream;
use common::http;
use common::jwt::key_digest;
use common::{admitted_until_rejected, free_port, tls_files, Sluice, TempDir};

const TOKEN: &str = "console-t0ken-for-tests";
const KEY_ACME: &str = "sk_test_acme_console_5Gv7Rq";
/// A key value a client chose to attack the console with: markup that would run script, set
/// a flag and change the title if the page ever parsed it as HTML.
const PAYLOAD: &str = "<script>window.__pwned=1</script><img src=x onerror=\"window.__pwned=2;document.title='pwned'\">";
const WAIT: Duration = Duration::from_secs(10);

/// Routes `/open/` (policy per_client: 3 per hour on `x-client`) and `/api/` (API keys
/// required, per_consumer), both to `upstream`; consumer acme from the config.
/// `extra` goes at the end of `[server]` (more tables may follow it), `admin` in `[admin]`.
fn template(upstream: &EchoUpstream, token_file: &str, extra: &str, admin: &str) -> String {
    format!(
        r#"[server]
listen = ["{{listen}}"]
access_log = "off"
{extra}
[admin]
listen = "{{admin}}"
token_file = "{token_file}"
{admin}
[limiter]
backend = "memory"
[auth]
api_key = ["header:x-api-key"]
[[consumers]]
name = "acme"
plan = "gold"
keys = ["{acme}"]
[policies.per_client]
algorithm = "fixed_window"
limit = 3
period = "1h"
key = ["header:x-client"]
[policies.per_consumer]
algorithm = "fixed_window"
limit = 1000
period = "1h"
key = ["consumer"]
[upstreams.up]
servers = ["{up}"]
adaptive = {{ min_limit = 50, initial_limit = 60, max_limit = 100 }}
[[routes]]
name = "open"
path_prefix = "/open/"
upstream = "up"
policies = ["per_client"]
[[routes]]
name = "api"
path_prefix = "/api/"
upstream = "up"
auth = "required"
policies = ["per_consumer"]
"#,
        acme = key_digest(KEY_ACME),
        up = upstream.addr,
    )
}

/// A running sluice with its upstream and token file.
struct Setup {
    sluice: Sluice,
    _upstream: EchoUpstream,
    _dir: TempDir,
}

/// The policies count in fixed windows of an hour, aligned to the clock: a test that
/// charged a key before the hour turned would read it fresh after. Starting a test in the
/// last minute of an hour waits for the next one (a test takes seconds).
fn clear_of_the_hour() {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let left = 3_600_000 - ms % 3_600_000;
    if left < 60_000 {
        std::thread::sleep(std::time::Duration::from_millis(left + 100));
    }
}

fn start() -> Setup {
    start_with("", |_, _| String::new())
}

fn start_with(admin: &str, extra: impl Fn(&TempDir, &EchoUpstream) -> String) -> Setup {
    clear_of_the_hour();
    let dir = TempDir::new();
    let token_file = dir.0.join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).expect("token file");
    let upstream = EchoUpstream::start();
    let extra = extra(&dir, &upstream);
    let sluice = Sluice::start(&template(
        &upstream,
        &token_file.display().to_string(),
        &extra,
        admin,
    ));
    Setup {
        sluice,
        _upstream: upstream,
        _dir: dir,
    }
}

fn console_url(s: &Sluice) -> String {
    format!("http://{}/console", s.admin)
}

/// A JavaScript string literal of `s`.
fn js(s: &str) -> String {
    serde_json::to_string(s).expect("a string")
}

/// Signs in with `token` the way a person does: types it and presses Open.
fn sign_in(b: &mut Browser, token: &str) {
    b.eval(&format!(
        "document.getElementById('token').value = {}; \
         document.querySelector('#login button[type=submit]').click(); true",
        js(token)
    ));
}

/// Sets a form field as typing or choosing does, with its `input` and `change` events.
fn set_field(b: &mut Browser, id: &str, value: &str) {
    b.eval(&format!(
        "(() => {{ const f = document.getElementById({}); f.value = {}; \
         f.dispatchEvent(new Event('input')); f.dispatchEvent(new Event('change')); return true; }})()",
        js(id),
        js(value)
    ));
}

fn show_tab(b: &mut Browser, tab: &str) {
    b.eval(&format!(
        "document.querySelector('#tabs button[data-tab={tab}]').click(); true"
    ));
}

/// The text of each cell of `table`'s body rows (`#ID`).
const ROWS: &str = "(id) => Array.from(document.querySelectorAll(`#${id} tbody tr`), \
                    (tr) => Array.from(tr.cells, (c) => c.textContent))";

/// The cells of the row of `table` whose first cell is `first`, or null.
fn row(b: &mut Browser, table: &str, first: &str) -> serde_json::Value {
    b.eval(&format!(
        "({ROWS})({}).find((r) => r[0] === {}) || null",
        js(table),
        js(first)
    ))
}

/// Clicks the button labelled `label` in the row of `table` whose first cell is `first`.
fn click_in_row(b: &mut Browser, table: &str, first: &str, label: &str) {
    // The table fills from its own fetch: under load it can come after the rest of the page.
    b.wait_for(
        &format!("a {label} button in {table}"),
        WAIT,
        &format!(
            "Array.from(document.querySelectorAll('#{table} tbody tr'))\
               .some((tr) => tr.cells[0].textContent === {first} && \
                 Array.from(tr.querySelectorAll('button')).some((x) => x.textContent === {label}))",
            first = js(first),
            label = js(label)
        ),
    );
    let clicked = b.eval(&format!(
        "(() => {{ const tr = Array.from(document.querySelectorAll('#{table} tbody tr'))\
           .find((tr) => tr.cells[0].textContent === {first}); \
         const btn = tr && Array.from(tr.querySelectorAll('button')).find((x) => x.textContent === {label}); \
         if (!btn) return false; btn.click(); return true; }})()",
        first = js(first),
        label = js(label)
    ));
    assert_eq!(
        clicked,
        serde_json::json!(true),
        "no {label} button in {table} row {first}"
    );
}

/// The quota table's field → value, as shown.
fn quota_shown(b: &mut Browser) -> serde_json::Value {
    b.eval(
        "Object.fromEntries(Array.from(document.querySelectorAll('#quota-table tbody tr'), \
         (tr) => [tr.cells[0].textContent, tr.cells[1].textContent]))",
    )
}

/// Asserts that the page asked exactly one confirmation since the last look, containing
/// `words`, and reported no errors.
fn confirmed(b: &mut Browser, words: &[&str]) {
    let (dialogs, problems) = b.events();
    assert_eq!(dialogs.len(), 1, "one confirmation expected: {dialogs:?}");
    for w in words {
        assert!(dialogs[0].contains(w), "{w:?} not in {:?}", dialogs[0]);
    }
    assert!(problems.is_empty(), "page errors: {problems:?}");
}

#[test]
fn the_page_is_served_under_its_policy_and_holds_no_data_without_the_token() {
    let setup = start();
    let s = &setup.sluice;
    for (path, kind) in [
        ("/console", "text/html"),
        ("/console/app.js", "text/javascript"),
        ("/console/app.css", "text/css"),
    ] {
        let r = http::get(s.admin, path, &[]);
        assert_eq!(r.status, 200, "{path}");
        assert!(r
            .header("content-type")
            .is_some_and(|t| t.starts_with(kind)));
        let csp = r.header("content-security-policy").unwrap_or_default();
        for directive in [
            "default-src 'none'",
            "script-src 'self'",
            "style-src 'self'",
            "connect-src 'self'",
            "frame-ancestors 'none'",
        ] {
            assert!(csp.contains(directive), "{directive:?} not in {csp:?}");
        }
        assert!(!csp.contains("unsafe-inline") && !csp.contains("http"));
        assert_eq!(r.header("x-content-type-options"), Some("nosniff"));
    }
    assert_eq!(http::get(s.admin, "/console/nope.js", &[]).status, 404);

    let mut b = Browser::open(&console_url(s), 1280, 900);
    // Without the token: the form, no data, and /v1/ refuses the page's own calls.
    let shown = b.eval(
        "[document.getElementById('login').hidden, document.getElementById('app').hidden, \
          document.querySelector('#routes-table tbody').rows.length]",
    );
    assert_eq!(shown, serde_json::json!([false, true, 0]));
    let status = b.eval("fetch('/v1/summary').then((r) => r.status)");
    assert_eq!(status, serde_json::json!(401));
    // Inline script is refused by the policy, even when injected at run time.
    let inline = b.eval(
        "new Promise((done) => { const s = document.createElement('script'); \
         s.textContent = 'window.__inline = 1'; document.body.append(s); \
         setTimeout(() => done(window.__inline === undefined), 100); })",
    );
    assert_eq!(inline, serde_json::json!(true), "inline script ran");
    let (_, problems) = b.events();
    assert!(
        problems
            .iter()
            .any(|p| p.contains("Content Security Policy")),
        "the refused inline script is reported: {problems:?}"
    );

    // A wrong token: refused, the form again with the reason, nothing kept.
    sign_in(&mut b, "not-the-token");
    let why = b.wait_for(
        "the wrong token refused",
        WAIT,
        "!document.getElementById('login-error').hidden && \
         document.getElementById('login-error').textContent",
    );
    assert!(why
        .as_str()
        .is_some_and(|w| w.contains("wrong bearer token")));
    let kept = b.eval("sessionStorage.length");
    assert_eq!(kept, serde_json::json!(0));
    // Refused calls are all the page logged so far.
    let (dialogs, problems) = b.events();
    assert!(dialogs.is_empty(), "{dialogs:?}");
    assert!(
        problems
            .iter()
            .all(|p| p.contains("401") || p.contains("Content Security Policy")),
        "{problems:?}"
    );

    // The right one: data, and the token in this tab's session storage only.
    sign_in(&mut b, TOKEN);
    b.wait_for(
        "the routes",
        WAIT,
        "document.querySelectorAll('#routes-table tbody tr').length === 2",
    );
    assert_eq!(
        row(&mut b, "routes-table", "open")[1],
        serde_json::json!("per_client")
    );
    let stored = b.eval("[sessionStorage.getItem('sluice.console.token'), localStorage.length]");
    assert_eq!(stored, serde_json::json!([TOKEN, 0]));
    assert!(b.eval("document.cookie").as_str() == Some(""));
    // Every section has its data.
    show_tab(&mut b, "upstreams");
    let up = b.wait_for(
        "the upstream",
        WAIT,
        "document.querySelector('#upstreams-table tbody tr')?.cells[3]?.textContent",
    );
    assert_eq!(up, serde_json::json!("up"));
    // Its adaptive concurrency: the limit (min_limit while the first probe runs), nothing
    // in flight, the range.
    let adaptive = b.wait_for(
        "the adaptive panel",
        WAIT,
        "(() => { const r = document.querySelector('#adaptive-table tbody tr'); return r && r.cells.length === 6 ? [...r.cells].map((c) => c.textContent) : null; })()",
    );
    assert_eq!(adaptive[0], serde_json::json!("up"), "{adaptive}");
    let limit: u64 = adaptive[1]
        .as_str()
        .and_then(|l| l.parse().ok())
        .unwrap_or(0);
    assert!((50..=100).contains(&limit), "{adaptive}");
    assert_eq!(adaptive[2], serde_json::json!("0"), "{adaptive}");
    assert_eq!(adaptive[5], serde_json::json!("50–100"), "{adaptive}");
    show_tab(&mut b, "reload");
    let reload = b.eval("document.getElementById('reload-table').textContent");
    assert!(
        reload
            .as_str()
            .is_some_and(|t| t.contains("memory") && t.contains("0 failed")),
        "{reload}"
    );
    // Signing out forgets the token.
    b.eval("document.getElementById('signout').click(); true");
    let gone = b.eval("[sessionStorage.length, document.getElementById('app').hidden]");
    assert_eq!(gone, serde_json::json!([0, true]));
    let (dialogs, problems) = b.events();
    assert!(
        dialogs.is_empty() && problems.is_empty(),
        "{dialogs:?} {problems:?}"
    );
    // The summary counts as an admin call like the rest.
    assert!(s.metric("sluice_admin_requests_total{endpoint=\"summary\",status=\"200\"}") >= 1.0);
    assert!(s.metric("sluice_admin_requests_total{endpoint=\"summary\",status=\"401\"}") >= 1.0);
}

#[test]
fn rates_move_with_traffic_and_hostile_keys_stay_text() {
    let setup = start();
    let s = &setup.sluice;
    let mut b = Browser::open(&console_url(s), 1280, 900);
    sign_in(&mut b, TOKEN);
    b.wait_for(
        "the routes",
        WAIT,
        "document.querySelectorAll('#routes-table tbody tr').length === 2",
    );

    // The hostile key: admitted 3 times, then rejected.
    for _ in 0..5 {
        s.get_with("/open/x", &[("x-client", PAYLOAD)]);
    }
    // Traffic on /open/ from many clients, some of them over their limit.
    let running = Arc::new(AtomicBool::new(true));
    let traffic = {
        let (addr, running) = (s.addr, running.clone());
        std::thread::spawn(move || {
            let mut n = 0u32;
            while running.load(Ordering::Relaxed) {
                let client = format!("client-{}", n % 20);
                http::get(addr, "/open/x", &[("x-client", &client)]);
                n += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    let rates = b.wait_for(
        "the open route's request and rejection rates to move",
        WAIT,
        "(() => { const r = Array.from(document.querySelectorAll('#routes-table tbody tr'))\
           .find((tr) => tr.cells[0].textContent === 'open'); \
         const req = parseFloat(r.cells[2].textContent), rej = parseFloat(r.cells[3].textContent); \
         return req > 10 && rej > 0 ? [req, rej] : null; })()",
    );
    running.store(false, Ordering::Relaxed);
    traffic.join().expect("traffic");
    // The api route saw nothing: its rate stays at 0.
    assert_eq!(
        row(&mut b, "routes-table", "api")[2],
        serde_json::json!("0")
    );
    // Stopped: the rates fall back to 0 at a later refresh.
    b.wait_for(
        "the open route's rate to fall to 0",
        WAIT,
        "Array.from(document.querySelectorAll('#routes-table tbody tr'))\
           .find((tr) => tr.cells[0].textContent === 'open').cells[2].textContent === '0'",
    );
    eprintln!("rates seen while traffic ran (req/s, rejected/s): {rates}");
    // The policy's counts moved too.
    show_tab(&mut b, "policies");
    let per_client = row(&mut b, "policies-table", "per_client");
    let rejected: u64 = per_client[10]
        .as_str()
        .and_then(|t| t.replace(',', "").parse().ok())
        .expect("a count");
    assert!(rejected >= 2, "{per_client}");

    // The hostile key in the top keys, verbatim, as text.
    show_tab(&mut b, "top");
    set_field(&mut b, "top-policy", "per_client");
    let found = b.wait_for(
        "the hostile key in the top keys",
        WAIT,
        &format!(
            "Array.from(document.querySelectorAll('#top-table tbody td')).some((td) => td.textContent === {})",
            js(PAYLOAD)
        ),
    );
    assert_eq!(found, serde_json::json!(true));
    // Filtering finds it by its text.
    set_field(&mut b, "top-filter", "onerror");
    let filtered = b.eval(&format!("({ROWS})('top-table').map((r) => r[0])"));
    assert_eq!(filtered, serde_json::json!([PAYLOAD]));
    // Never parsed: no element came of it, nothing ran, the title is the page's.
    std::thread::sleep(Duration::from_millis(300));
    let safe = b.eval(
        "[typeof window.__pwned, document.title, document.querySelectorAll('main script, main img').length]",
    );
    assert_eq!(safe, serde_json::json!(["undefined", "sluice console", 0]));
    let (dialogs, problems) = b.events();
    assert!(
        dialogs.is_empty() && problems.is_empty(),
        "{dialogs:?} {problems:?}"
    );
}

#[test]
fn a_key_is_looked_up_reset_and_overridden_from_the_page() {
    let setup = start();
    let s = &setup.sluice;
    let alice = [("x-client", "alice")];
    assert_eq!(
        admitted_until_rejected(s, "/open/x", &alice, "per_client", 3, 10),
        3
    );

    let mut b = Browser::open(&console_url(s), 1280, 900);
    sign_in(&mut b, TOKEN);
    b.wait_for(
        "the policies",
        WAIT,
        "document.querySelectorAll('#key-policy option').length === 2",
    );
    show_tab(&mut b, "policies");
    click_in_row(&mut b, "policies-table", "per_client", "per_client");
    let part = b.eval(
        "document.getElementById('key-policy').value + ' ' + \
         document.querySelector('#key-parts label').firstChild.textContent",
    );
    assert_eq!(part, serde_json::json!("per_client header:x-client"));
    b.eval(
        "document.querySelector('#key-parts input').value = 'alice'; \
         document.getElementById('key-lookup').click(); true",
    );
    b.wait_for(
        "alice's quota",
        WAIT,
        "document.querySelectorAll('#quota-table tbody tr').length > 0",
    );
    let q = quota_shown(&mut b);
    assert_eq!(q["limit"], "3", "{q}");
    assert_eq!(q["remaining"], "0", "{q}");
    assert_eq!(q["key"], "alice", "{q}");
    assert_eq!(s.get_with("/open/x", &alice).status, 429);

    // Reset: confirmed, and the next request passes.
    b.eval("document.getElementById('key-reset').click(); true");
    b.wait_for(
        "the reset",
        WAIT,
        "document.getElementById('key-message').textContent.startsWith('Reset')",
    );
    confirmed(&mut b, &["Reset", "per_client", "alice"]);
    assert_eq!(s.get_with("/open/x", &alice).status, 200);
    b.eval("document.getElementById('key-lookup').click(); true");
    b.wait_for(
        "the quota after one request",
        WAIT,
        "Array.from(document.querySelectorAll('#quota-table tbody tr'))\
           .some((tr) => tr.cells[0].textContent === 'remaining' && tr.cells[1].textContent === '2')",
    );

    // An override of 10: shown by the page and applied to real requests.
    b.eval(
        "document.getElementById('ov-limit').value = '10'; \
         document.getElementById('ov-ttl').value = '1h'; \
         document.getElementById('ov-set').click(); true",
    );
    b.wait_for(
        "the override stored",
        WAIT,
        "document.getElementById('key-message').textContent.startsWith('Override stored: limit 10')",
    );
    confirmed(&mut b, &["override", "alice", "limit 10", "ttl 1h"]);
    b.wait_for(
        "the quota under the override",
        WAIT,
        "Array.from(document.querySelectorAll('#quota-table tbody tr'))\
           .some((tr) => tr.cells[0].textContent === 'limit' && tr.cells[1].textContent === '10')",
    );
    let listed = b.wait_for(
        "the runtime override listed",
        WAIT,
        "document.querySelector('#runtime-overrides-table tbody tr')?.cells[1]?.textContent === '10' && \
         Array.from(document.querySelector('#runtime-overrides-table tbody tr').cells, (c) => c.textContent)",
    );
    assert_eq!(listed[0], "alice", "{listed}");
    // One request was made since the reset: 9 more of 10 pass, under the page's numbers.
    assert_eq!(
        admitted_until_rejected(s, "/open/x", &alice, "per_client", 10, 20),
        9
    );

    // Deleted from the list: the policy's own numbers again.
    click_in_row(&mut b, "runtime-overrides-table", "alice", "Delete");
    b.wait_for(
        "the override gone",
        WAIT,
        "document.querySelector('#runtime-overrides-table tbody tr').cells.length === 1",
    );
    confirmed(&mut b, &["Delete the override", "alice"]);
    let r = s.get_with("/open/x", &alice);
    assert_eq!(r.status, 429);
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"per_client\";q=3;w=3600")
    );
}

#[test]
fn api_keys_are_created_and_revoked_from_the_page() {
    let setup = start();
    let s = &setup.sluice;
    let mut b = Browser::open(&format!("{}#consumers", console_url(s)), 1280, 900);
    sign_in(&mut b, TOKEN);
    b.wait_for(
        "the config's consumer",
        WAIT,
        "document.querySelector('#consumers-table tbody tr')?.cells[0]?.textContent === 'acme'",
    );
    let acme = row(&mut b, "consumers-table", "acme");
    assert_eq!(
        acme,
        serde_json::json!([
            "acme",
            "gold",
            "config",
            "1",
            "digests in the config",
            "in the config"
        ])
    );

    b.eval(
        "document.getElementById('consumer-name').value = 'beta'; \
         document.getElementById('consumer-plan').value = 'silver'; \
         document.querySelector('#consumer-form button[type=submit]').click(); true",
    );
    b.wait_for(
        "the new consumer",
        WAIT,
        "Array.from(document.querySelectorAll('#consumers-table tbody tr')).some((tr) => tr.cells[0].textContent === 'beta')",
    );
    confirmed(&mut b, &["beta", "silver"]);

    click_in_row(&mut b, "consumers-table", "beta", "New key");
    let secret = b.wait_for(
        "the new key shown once",
        WAIT,
        "!document.getElementById('secret-box').hidden && document.getElementById('secret-value').textContent",
    );
    confirmed(&mut b, &["new API key", "beta"]);
    let secret = secret.as_str().expect("a key").to_owned();
    assert!(secret.starts_with("sk_"), "{secret}");
    let id = b.wait_for(
        "the key's id listed",
        WAIT,
        "document.querySelector('#consumers-table tbody tr:nth-child(2) .ids span')?.firstChild?.textContent",
    );
    let id = id.as_str().expect("an id").to_owned();
    let with_key = [("x-api-key", secret.as_str())];
    assert_eq!(s.get_with("/api/x", &with_key).status, 200);
    assert_eq!(s.get_with("/api/x", &[("x-api-key", KEY_ACME)]).status, 200);

    let clicked = b.eval(&format!(
        "(() => {{ const span = Array.from(document.querySelectorAll('#consumers-table .ids span'))\
           .find((s) => s.firstChild.textContent === {}); \
         if (!span) return false; span.querySelector('button').click(); return true; }})()",
        js(&id)
    ));
    assert_eq!(clicked, serde_json::json!(true));
    b.wait_for(
        "the key gone from the page",
        WAIT,
        "document.getElementById('consumers-message').textContent.includes('revoked')",
    );
    confirmed(&mut b, &["Revoke", &id, "beta"]);
    assert!(
        s.wait_for(Duration::from_secs(3), || s
            .get_with("/api/x", &with_key)
            .status
            == 401),
        "the revoked key is still accepted"
    );
    assert_eq!(s.get_with("/api/x", &[("x-api-key", KEY_ACME)]).status, 200);
    b.wait_for(
        "beta shown with no key",
        WAIT,
        "Array.from(document.querySelectorAll('#consumers-table tbody tr'))\
           .some((tr) => tr.cells[0].textContent === 'beta' && tr.cells[3].textContent === '0')",
    );
}

#[test]
fn a_fleet_sized_config_stays_usable() {
    // 300 more routes, each under its own policy, and 2,500 distinct keys on one of them.
    let setup = start_with("top_keys = 5000", |_, _| {
        let mut extra = String::new();
        for i in 0..300 {
            extra.push_str(&format!(
                "[policies.tenant_{i}]\nalgorithm = \"fixed_window\"\nlimit = 100\nperiod = \"1m\"\nkey = [\"header:x-client\"]\n\
                 [[routes]]\nname = \"tenant-{i}\"\npath_prefix = \"/t/{i}/\"\nrespond = {{ status = 200, body = \"ok\\n\" }}\npolicies = [\"tenant_{i}\"]\n"
            ));
        }
        extra
    });
    let s = &setup.sluice;
    for n in 0..2500 {
        let key = format!("tenant-key-{n:05}");
        assert_eq!(s.get_with("/t/7/x", &[("x-client", &key)]).status, 200);
    }
    let mut b = Browser::open(&console_url(s), 390, 844);
    sign_in(&mut b, TOKEN);
    b.wait_for(
        "every route",
        WAIT,
        "document.querySelectorAll('#routes-table tbody tr').length === 302",
    );
    // A filter narrows the table to what it names.
    set_field(&mut b, "routes-filter", "tenant-7");
    let names = b.eval(&format!("({ROWS})('routes-table').map((r) => r[0])"));
    let want: Vec<String> = std::iter::once("tenant-7".to_owned())
        .chain((70..80).map(|i| format!("tenant-{i}")))
        .collect();
    assert_eq!(names, serde_json::json!(want));
    // Thousands of top keys: at most 1,000 rows drawn, and said so; a filter finds the rest.
    show_tab(&mut b, "top");
    set_field(&mut b, "top-policy", "tenant_7");
    let note = b.wait_for(
        "the top keys",
        WAIT,
        "document.querySelectorAll('#top-table tbody tr').length === 1000 && \
         document.getElementById('top-note').textContent",
    );
    assert_eq!(
        note,
        serde_json::json!("Showing 1000 of 2500: filter to narrow.")
    );
    set_field(&mut b, "top-filter", "tenant-key-02499");
    let found = b.eval(&format!("({ROWS})('top-table').map((r) => r[0])"));
    assert_eq!(found, serde_json::json!(["tenant-key-02499"]));
    // At phone width nothing is wider than the screen: wide tables scroll in their own box.
    for tab in [
        "routes",
        "policies",
        "top",
        "consumers",
        "upstreams",
        "certificates",
        "reload",
    ] {
        show_tab(&mut b, tab);
        let fits = b.eval("document.documentElement.scrollWidth <= window.innerWidth");
        assert_eq!(
            fits,
            serde_json::json!(true),
            "the {tab} tab overflows the page"
        );
    }
    let (dialogs, problems) = b.events();
    assert!(
        dialogs.is_empty() && problems.is_empty(),
        "{dialogs:?} {problems:?}"
    );
}

/// Writes `console-desktop.png` and `console-narrow.png` into `$SLUICE_CONSOLE_SCREENSHOTS`
/// (the README's, under docs/): a config with several routes, upstreams (one server down),
/// a certificate, and traffic.
#[test]
#[ignore = "writes the README's screenshots: make console-screenshots"]
fn screenshots() {
    let out = std::path::PathBuf::from(
        std::env::var("SLUICE_CONSOLE_SCREENSHOTS").expect("SLUICE_CONSOLE_SCREENSHOTS=DIR"),
    );
    std::fs::create_dir_all(&out).expect("the screenshot directory");
    let setup = start_with("", |dir, up| {
        tls_files(&dir.0, "DNS:api.example.com");
        let down = format!("127.0.0.1:{}", free_port());
        let mut extra = format!(
            "tls_listen = [\"127.0.0.1:{}\"]\n[[certificates]]\nhosts = [\"api.example.com\"]\ncert = \"{}\"\nkey = \"{}\"\n\
             [upstreams.billing]\nservers = [\"{}\", \"{down}\"]\nhealth_check = {{ interval = \"200ms\" }}\n\
             [upstreams.search]\nservers = [\"{}\"]\n",
            free_port(),
            dir.0.join("srv.pem").display(),
            dir.0.join("srv.key").display(),
            up.addr,
            up.addr,
        );
        for (name, prefix) in [
            ("billing", "/billing/"),
            ("search", "/search/"),
            ("static", "/static/"),
        ] {
            let upstream = if name == "static" { "up" } else { name };
            extra.push_str(&format!(
                "[[routes]]\nname = \"{name}\"\npath_prefix = \"{prefix}\"\nupstream = \"{upstream}\"\npolicies = [\"per_client\"]\n"
            ));
        }
        extra
    });
    let s = &setup.sluice;
    let running = Arc::new(AtomicBool::new(true));
    let traffic = {
        let (addr, running) = (s.addr, running.clone());
        std::thread::spawn(move || {
            let mut n = 0u32;
            let paths = [
                "/open/a",
                "/open/b",
                "/search/q",
                "/billing/x",
                "/static/s.css",
            ];
            while running.load(Ordering::Relaxed) {
                let client = format!("203.0.113.{}", n % 250);
                http::get(
                    addr,
                    paths[n as usize % paths.len()],
                    &[("x-client", &client)],
                );
                n += 1;
                std::thread::sleep(Duration::from_millis(4));
            }
        })
    };
    for _ in 0..4 {
        s.get_with("/open/x", &[("x-client", PAYLOAD)]);
    }
    let mut b = Browser::open(&console_url(s), 1280, 900);
    sign_in(&mut b, TOKEN);
    b.wait_for(
        "rates",
        WAIT,
        "parseFloat(document.querySelector('#routes-table tbody tr')?.cells[2]?.textContent) > 0",
    );
    b.screenshot(&out.join("console-narrow.png"), 390, 844);
    show_tab(&mut b, "policies");
    click_in_row(&mut b, "policies-table", "per_client", "per_client");
    b.eval(
        "document.querySelector('#key-parts input').value = '203.0.113.7'; \
         document.getElementById('ov-limit').value = '50'; \
         document.getElementById('ov-ttl').value = '1d'; \
         document.getElementById('ov-set').click(); true",
    );
    b.wait_for(
        "the override and the quota under it",
        WAIT,
        "document.querySelector('#runtime-overrides-table tbody tr')?.cells.length > 1 && \
         document.querySelectorAll('#quota-table tbody tr').length > 0",
    );
    b.screenshot(&out.join("console-desktop.png"), 1280, 900);
    running.store(false, Ordering::Relaxed);
    traffic.join().expect("traffic");
}

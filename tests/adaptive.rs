//! `[upstreams.NAME.adaptive]` (DESIGN §22) through the real binary, against a real queueing
//! upstream: 8 workers that each serve a request in a set time while the rest wait in its
//! queue, driven by 64 clients that send again as soon as they are answered. The measured
//! case of §22: with `adaptive` the upstream's own queue stays short and the limit settles
//! near its capacity; without, the queue grows; the plan with the larger share keeps being
//! served while the smaller is shed; the limit climbs back when the upstream recovers.
//!
//! Margins, for a noisy 2-core machine that also runs sluice and the 64 clients: the two
//! tests never run at once; latencies are the upstream's own (arrival to answer), so the
//! proxy's and clients' scheduling delays do not count against it; the best latency is
//! probed under light load (4 clients, as an upstream warming up) rather than in the rush
//! of 64 connecting clients; the limit "settles" when at least 70% of its samples over 5 s
//! lie in 6–24 and their median does; recovery is read as the limit, held down by a
//! slowdown, passing the median it had settled at.
//!
//! `probe_every = "60s"` keeps the one probe at start inside the test's 25 s (a probe drops
//! the limit to min_limit for a window: gold's 8 clients would wait on 4 slots).
//! `tolerance = 1.2` here, not the default 1.5: at equilibrium the controller keeps
//! tolerance x capacity + sqrt(limit) requests at the upstream, which with 1.5 and 8
//! workers is 16.4 requests, a median of 2.05 x 20 ms, on the edge of §22's "within 2x"
//! (measured: 39.8 ms); 1.2 settles near 14 (about 1.75x).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::http::read_request;
use common::jwt::key_digest;
use common::Sluice;

const KEY_GOLD: &str = "sk_test_gold_Vb7Lq2mZ9xW4";
const KEY_FREE: &str = "sk_test_free_Rt5Kc8nY1pJ6";

/// An upstream of `workers` that each serve one request in `service` (changeable); the
/// others wait. Each answered request's latency at the upstream (its arrival to its answer)
/// is kept.
struct Queueing {
    addr: SocketAddr,
    service_us: Arc<AtomicU64>,
    latencies: Arc<Mutex<Vec<Duration>>>,
}

impl Queueing {
    fn start(workers: usize, service: Duration) -> Queueing {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let service_us = Arc::new(AtomicU64::new(service.as_micros() as u64));
        let latencies = Arc::new(Mutex::new(Vec::new()));
        let free = Arc::new((Mutex::new(workers), Condvar::new()));
        let (us, lat) = (service_us.clone(), latencies.clone());
        thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (us, lat, free) = (us.clone(), lat.clone(), free.clone());
                thread::spawn(move || serve(conn, &us, &lat, &free));
            }
        });
        Queueing {
            addr,
            service_us,
            latencies,
        }
    }

    fn set_service(&self, d: Duration) {
        self.service_us
            .store(d.as_micros() as u64, Ordering::SeqCst);
    }

    /// The latencies since the last call.
    fn take(&self) -> Vec<Duration> {
        std::mem::take(&mut *self.latencies.lock().expect("lock"))
    }
}

fn serve(
    conn: TcpStream,
    service_us: &AtomicU64,
    latencies: &Mutex<Vec<Duration>>,
    free: &(Mutex<usize>, Condvar),
) {
    let _ = conn.set_nodelay(true);
    let mut reader = BufReader::new(conn.try_clone().expect("clone"));
    let mut conn = conn;
    while let Some(_req) = read_request(&mut reader) {
        let arrived = Instant::now();
        let (lock, cv) = free;
        {
            let mut n = lock.lock().expect("lock");
            while *n == 0 {
                n = cv.wait(n).expect("wait");
            }
            *n -= 1;
        }
        thread::sleep(Duration::from_micros(service_us.load(Ordering::SeqCst)));
        *lock.lock().expect("lock") += 1;
        cv.notify_one();
        latencies.lock().expect("lock").push(arrived.elapsed());
        let ok = conn
            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
            .is_ok();
        if !ok {
            return;
        }
    }
}

/// `adaptive`: the `[upstreams.slow.adaptive]` lines, or None for none.
fn config(upstream: SocketAddr, adaptive: Option<&str>) -> String {
    let adaptive = adaptive.map_or(String::new(), |a| {
        format!("[upstreams.slow.adaptive]\n{a}\n")
    });
    format!(
        r#"
[server]
listen = ["{{listen}}"]
access_log = "off"
[admin]
listen = "{{admin}}"
[auth]
api_key = ["header:x-api-key"]
[[consumers]]
name = "acme"
plan = "gold"
keys = ["{gold}"]
[[consumers]]
name = "freebie"
plan = "free"
keys = ["{free}"]
[policies.per_ip]
algorithm = "fixed_window"
limit = 1000000
period = "1h"
key = ["client_ip"]
[upstreams.slow]
servers = ["{upstream}"]
read_timeout = "10s"
{adaptive}
[[routes]]
name = "all"
path_prefix = "/"
upstream = "slow"
auth = "optional"
policies = ["per_ip"]
"#,
        gold = key_digest(KEY_GOLD),
        free = key_digest(KEY_FREE),
    )
}

/// What the clients of one plan saw.
#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    shed: AtomicU64,
    other: AtomicU64,
}

impl Tally {
    fn counts(&self) -> (u64, u64, u64) {
        (
            self.ok.load(Ordering::SeqCst),
            self.shed.load(Ordering::SeqCst),
            self.other.load(Ordering::SeqCst),
        )
    }

    fn reset(&self) {
        self.ok.store(0, Ordering::SeqCst);
        self.shed.store(0, Ordering::SeqCst);
        self.other.store(0, Ordering::SeqCst);
    }
}

/// `n` clients on keep-alive connections sending GETs (with `key`, if any) until `stop`;
/// a shed one pauses 5 ms (a real client would wait its Retry-After) before the next.
fn clients(
    n: usize,
    addr: SocketAddr,
    key: Option<&'static str>,
    stop: &Arc<AtomicBool>,
    tally: &Arc<Tally>,
) -> Vec<thread::JoinHandle<()>> {
    (0..n)
        .map(|_| {
            let (stop, tally) = (stop.clone(), tally.clone());
            thread::spawn(move || {
                let mut conn: Option<(TcpStream, BufReader<TcpStream>)> = None;
                while !stop.load(Ordering::Relaxed) {
                    let status = one(&mut conn, addr, key);
                    match status {
                        200 => tally.ok.fetch_add(1, Ordering::Relaxed),
                        503 => {
                            thread::sleep(Duration::from_millis(5));
                            tally.shed.fetch_add(1, Ordering::Relaxed)
                        }
                        _ => tally.other.fetch_add(1, Ordering::Relaxed),
                    };
                }
            })
        })
        .collect()
}

/// One request on the client's connection (opened again when needed): its status, 0 on
/// a broken connection.
fn one(
    conn: &mut Option<(TcpStream, BufReader<TcpStream>)>,
    addr: SocketAddr,
    key: Option<&str>,
) -> u16 {
    if conn.is_none() {
        let Ok(s) = TcpStream::connect(addr) else {
            return 0;
        };
        let _ = s.set_nodelay(true);
        let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
        let reader = BufReader::new(s.try_clone().expect("clone"));
        *conn = Some((s, reader));
    }
    let Some((s, reader)) = conn.as_mut() else {
        return 0;
    };
    let key = key.map_or(String::new(), |k| format!("x-api-key: {k}\r\n"));
    let req = format!("GET /work HTTP/1.1\r\nHost: localhost\r\n{key}\r\n");
    let status = s
        .write_all(req.as_bytes())
        .ok()
        .and_then(|()| read_response(reader));
    if status.is_none() {
        *conn = None;
    }
    status.unwrap_or(0)
}

/// Reads one response with a Content-Length body; its status.
fn read_response(reader: &mut BufReader<TcpStream>) -> Option<u16> {
    let mut line = String::new();
    reader.read_line(&mut line).ok().filter(|n| *n > 0)?;
    let status = line.split_whitespace().nth(1)?.parse().ok()?;
    let mut length = 0;
    loop {
        let mut h = String::new();
        reader.read_line(&mut h).ok().filter(|n| *n > 0)?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                length = v.trim().parse().ok()?;
            }
        }
    }
    let mut body = vec![0u8; length];
    reader.read_exact(&mut body).ok()?;
    Some(status)
}

fn median(mut v: Vec<Duration>) -> Duration {
    assert!(!v.is_empty(), "no latencies");
    v.sort_unstable();
    v[v.len() / 2]
}

fn limit(s: &Sluice) -> f64 {
    s.metric("sluice_upstream_concurrency_limit{upstream=\"slow\"}")
}

/// The limit, read every 250 ms for `d`.
fn limits_over(s: &Sluice, d: Duration) -> Vec<f64> {
    let end = Instant::now() + d;
    let mut out = Vec::new();
    while Instant::now() < end {
        out.push(limit(s));
        thread::sleep(Duration::from_millis(250));
    }
    out
}

fn stop_all(stop: &AtomicBool, handles: Vec<thread::JoinHandle<()>>) {
    stop.store(true, Ordering::SeqCst);
    for h in handles {
        let _ = h.join();
    }
}

/// The two tests load the machine: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

const WORKERS: usize = 8;
const SERVICE: Duration = Duration::from_millis(20);

#[test]
fn without_adaptive_the_upstreams_queue_grows() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let up = Queueing::start(WORKERS, SERVICE);
    let s = Sluice::start(&config(up.addr, None));
    let (stop, tally) = (Arc::new(AtomicBool::new(false)), Arc::new(Tally::default()));
    let handles = clients(64, s.addr, None, &stop, &tally);
    thread::sleep(Duration::from_secs(1));
    up.take();
    thread::sleep(Duration::from_secs(3));
    let m = median(up.take());
    stop_all(&stop, handles);
    let (ok, shed, other) = tally.counts();
    eprintln!("without adaptive: upstream median {m:?}; ok {ok}, shed {shed}, other {other}");
    assert_eq!(shed, 0, "nothing is shed without adaptive");
    assert!(
        m >= SERVICE * 4,
        "64 clients on 8 workers queue: median {m:?}"
    );
    assert!(!s.metrics().contains("sluice_upstream_concurrency_limit{"));
}

#[test]
fn adaptive_keeps_the_upstreams_queue_short_sheds_the_smaller_share_first_and_recovers() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let up = Queueing::start(WORKERS, SERVICE);
    let s = Sluice::start(&config(
        up.addr,
        Some("tolerance = 1.2\nprobe_every = \"60s\"\nshares = { gold = 1.0, free = 0.6 }"),
    ));
    // 0. Light load while the first window at min_limit measures the best latency.
    let (stop, anon) = (Arc::new(AtomicBool::new(false)), Arc::new(Tally::default()));
    let mut handles = clients(4, s.addr, None, &stop, &anon);
    let probed = s.wait_for(Duration::from_secs(5), || {
        s.metric("sluice_upstream_latency_best_seconds{upstream=\"slow\"}") > 0.0
    });
    assert!(probed, "the first probe ended");
    // 1. 64 anonymous clients (share 1.0): the limit settles, the upstream's queue is short.
    handles.extend(clients(60, s.addr, None, &stop, &anon));
    thread::sleep(Duration::from_secs(3));
    up.take();
    let limits = limits_over(&s, Duration::from_secs(5));
    let m = median(up.take());
    stop_all(&stop, handles);
    let mut sorted = limits.clone();
    sorted.sort_by(f64::total_cmp);
    let settled = sorted[sorted.len() / 2];
    let within = limits.iter().filter(|l| (6.0..=24.0).contains(*l)).count();
    let (ok, shed, other) = anon.counts();
    let best = s.metric("sluice_upstream_latency_best_seconds{upstream=\"slow\"}");
    eprintln!(
        "adaptive: best {best}; upstream median {m:?}; limit median {settled}, {within}/{} in 6-24: {limits:?}; ok {ok}, shed {shed}, other {other}",
        limits.len()
    );
    assert!(
        m <= SERVICE * 2,
        "the upstream's queue stays short: median {m:?}"
    );
    assert!((6.0..=24.0).contains(&settled), "{limits:?}");
    assert!(within * 10 >= limits.len() * 7, "{limits:?}");
    assert!(
        shed > 0,
        "64 clients are more than the limit: some are shed"
    );
    assert_eq!(other, 0, "every answer is 200 or 503");
    assert!((0.019..0.040).contains(&best), "best latency {best}");
    // A shed request is no decision and charges nothing: every decision is an answer.
    let decided =
        s.metric("sluice_decisions_total{decision=\"allowed\",policy=\"per_ip\",route=\"all\"}");
    assert_eq!(decided as u64, ok, "decisions: admitted requests only");
    assert_eq!(
        s.metric("sluice_shed_total{plan=\"anonymous\",upstream=\"slow\"}") as u64,
        shed
    );

    // 2. Overload by the free plan (56 clients) beside 8 gold ones: free is shed first,
    // gold keeps being served.
    let (stop, gold, free) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(Tally::default()),
        Arc::new(Tally::default()),
    );
    let mut handles = clients(56, s.addr, Some(KEY_FREE), &stop, &free);
    handles.extend(clients(8, s.addr, Some(KEY_GOLD), &stop, &gold));
    thread::sleep(Duration::from_secs(2));
    gold.reset();
    free.reset();
    thread::sleep(Duration::from_secs(5));
    let (g, f) = (gold.counts(), free.counts());
    eprintln!("shares: gold ok/shed/other {g:?}, free {f:?}");
    assert!(
        g.0 * 100 >= (g.0 + g.1 + g.2) * 99,
        "gold keeps >= 99%: {g:?}"
    );
    assert!(f.1 * 10 >= f.0 + f.1, "free is shed: {f:?}");
    assert!(s.metric("sluice_shed_total{plan=\"free\",upstream=\"slow\"}") >= f.1 as f64);

    // 3. The upstream slows to 60 ms a request: the limit falls (the best is still 20 ms);
    // then it recovers (2 ms a request): the limit climbs back within 5 s, the clients on.
    up.set_service(Duration::from_millis(60));
    let fell = s.wait_for(Duration::from_secs(3), || limit(&s) <= 8.0);
    eprintln!("slowdown: limit {}", limit(&s));
    assert!(fell, "the limit falls on a slowdown: {}", limit(&s));
    up.set_service(Duration::from_millis(2));
    let recovered = Instant::now();
    let back = s.wait_for(Duration::from_secs(5), || limit(&s) > settled);
    let took = recovered.elapsed();
    stop_all(&stop, handles);
    eprintln!(
        "recovery: limit {} after {took:?} (settled at {settled})",
        limit(&s)
    );
    assert!(back, "the limit climbs back within 5 s: {}", limit(&s));

    // Every slot came back once the clients stopped.
    assert!(s.wait_for(Duration::from_secs(2), || s
        .metric("sluice_upstream_in_flight{upstream=\"slow\"}")
        == 0.0));
}

fn in_flight(s: &Sluice, upstream: &str) -> f64 {
    s.metric(&format!(
        "sluice_upstream_in_flight{{upstream=\"{upstream}\"}}"
    ))
}

#[test]
fn every_way_a_request_ends_gives_its_slot_back() {
    let up = common::http::Scripted::start(|conn, req| match req.target.as_str() {
        "/ws" => {
            let head = "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n";
            if conn.write_all(head.as_bytes()).is_err() {
                return false;
            }
            // Echoes until the client closes.
            let mut buf = [0u8; 64];
            while let Ok(n @ 1..) = conn.read(&mut buf) {
                if conn.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            false
        }
        path => {
            if path == "/slow" {
                thread::sleep(Duration::from_millis(600));
            }
            conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
                .is_ok()
        }
    });
    let gone = TcpListener::bind("127.0.0.1:0").expect("bind");
    let gone_addr = gone.local_addr().expect("addr");
    drop(gone); // nothing listens there
    let s = Sluice::start(&format!(
        r#"
[server]
listen = ["{{listen}}"]
access_log = "off"
[admin]
listen = "{{admin}}"
[upstreams.up]
servers = ["{}"]
adaptive = {{}}
[upstreams.gone]
servers = ["{gone_addr}"]
adaptive = {{}}
[[routes]]
name = "gone"
path_prefix = "/gone"
upstream = "gone"
[[routes]]
name = "all"
path_prefix = "/"
upstream = "up"
"#,
        up.addr
    ));
    assert_eq!(s.get("/ok").status, 200);
    assert_eq!(s.get("/gone").status, 502, "{}", s.stderr());
    assert_eq!((in_flight(&s, "up"), in_flight(&s, "gone")), (0.0, 0.0));

    // A client that goes away while its request is at the upstream.
    let mut c = TcpStream::connect(s.addr).expect("connect");
    c.write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("send");
    assert!(s.wait_for(Duration::from_secs(2), || in_flight(&s, "up") == 1.0));
    drop(c);
    assert!(s.wait_for(Duration::from_secs(3), || in_flight(&s, "up") == 0.0));

    // A WebSocket session holds its slot while open.
    let mut ws = TcpStream::connect(s.addr).expect("connect");
    ws.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    ws.write_all(
        b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
    )
    .expect("handshake");
    let mut reader = BufReader::new(ws.try_clone().expect("clone"));
    let mut status = String::new();
    reader.read_line(&mut status).expect("status line");
    assert!(status.contains(" 101 "), "{status}");
    let mut line = String::new();
    while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
        line.clear();
    }
    ws.write_all(b"ping").expect("send");
    let mut echo = [0u8; 4];
    reader.read_exact(&mut echo).expect("echo");
    assert_eq!(&echo, b"ping");
    assert_eq!(in_flight(&s, "up"), 1.0, "an open WebSocket counts");
    drop(reader);
    drop(ws);
    assert!(
        s.wait_for(Duration::from_secs(3), || in_flight(&s, "up") == 0.0),
        "closed, its slot is back: {}",
        in_flight(&s, "up")
    );
}

#[test]
fn a_reload_keeps_the_learnt_limit_unless_its_numbers_change() {
    let up = common::http::Upstream::start("up");
    let conf = |adaptive: &str, route: &str| {
        format!(
            "[server]\nlisten = [\"{{listen}}\"]\naccess_log = \"off\"\n[admin]\nlisten = \"{{admin}}\"\n\
             [upstreams.up]\nservers = [\"{}\"]\nadaptive = {{ {adaptive} }}\n\
             [[routes]]\nname = \"{route}\"\npath_prefix = \"/\"\nupstream = \"up\"\n",
            up.addr
        )
    };
    let s = Sluice::start(&conf("", "a"));
    let limit = || s.metric("sluice_upstream_concurrency_limit{upstream=\"up\"}");
    assert_eq!(limit(), 4.0, "the first window probes at min_limit");
    // A second of requests: the probe ends, the limit moves off its initial 20.
    let until = Instant::now() + Duration::from_millis(1200);
    while Instant::now() < until {
        assert_eq!(s.get("/").status, 200);
    }
    let learnt = limit();
    assert!(learnt > 20.0, "fast answers raise the limit: {learnt}");
    // Another route, the same numbers: the limit and the best latency carry over.
    let reloads = || s.metric("sluice_config_reloads_total{result=\"success\"}");
    s.reload(&conf("", "b"));
    assert!(s.wait_for(Duration::from_secs(5), || reloads() == 1.0));
    assert_eq!(
        limit(),
        learnt,
        "kept across a reload with the same numbers"
    );
    // New numbers: a new controller, which starts by probing.
    s.reload(&conf("window = \"200ms\"", "c"));
    assert!(s.wait_for(Duration::from_secs(5), || reloads() == 2.0));
    assert_eq!(limit(), 4.0, "new numbers start again");
}

#[test]
fn a_shed_request_is_503_with_retry_after_or_grpc_unavailable() {
    let up = common::http::Scripted::start(|conn, req| {
        if req.target == "/slow" {
            thread::sleep(Duration::from_millis(1500));
        }
        conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
            .is_ok()
    });
    let s = Sluice::start(&format!(
        "[server]\nlisten = [\"{{listen}}\"]\naccess_log = \"off\"\n[admin]\nlisten = \"{{admin}}\"\n\
         [upstreams.api]\nservers = [\"{}\"]\n\
         adaptive = {{ min_limit = 1, max_limit = 1, queue = \"0s\" }}\n\
         [[routes]]\nname = \"all\"\npath_prefix = \"/\"\nupstream = \"api\"\n",
        up.addr
    ));
    let addr = s.addr;
    let holder = thread::spawn(move || common::http::get(addr, "/slow", &[]).status);
    assert!(s.wait_for(Duration::from_secs(2), || s
        .metric("sluice_upstream_in_flight{upstream=\"api\"}")
        == 1.0));
    let r = s.get("/other");
    assert_eq!(r.status, 503);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let body: serde_json::Value = serde_json::from_str(&r.body).expect("json");
    assert_eq!(body["title"], "Service Unavailable");
    assert_eq!(body["status"], 503);
    let detail = body["detail"].as_str().unwrap_or("");
    assert!(
        detail.contains("upstream \"api\" is overloaded"),
        "{detail}"
    );
    let grpc = s.get_with("/pkg.Svc/Call", &[("content-type", "application/grpc")]);
    assert_eq!(grpc.status, 200);
    assert_eq!(grpc.header("grpc-status"), Some("14"), "UNAVAILABLE");
    assert!(grpc
        .header("grpc-message")
        .is_some_and(|m| m.contains("overloaded")));
    assert_eq!(
        holder.join().expect("holder"),
        200,
        "the admitted one is served"
    );
    assert_eq!(
        s.metric("sluice_shed_total{plan=\"anonymous\",upstream=\"api\"}"),
        2.0
    );
}

#[test]
fn a_retry_runs_in_its_requests_slot_and_a_shed_request_is_never_retried() {
    use common::http::Scripted;
    let bad = Scripted::start(|conn, _| {
        conn.write_all(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 5\r\n\r\ndown\n")
            .is_ok()
    });
    let good = Scripted::start(|conn, req| {
        if req.target == "/slow" {
            thread::sleep(Duration::from_millis(1500));
        }
        conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
            .is_ok()
    });
    // One slot: a retry that needed a slot of its own could never run. (A short queue: a
    // request's slot comes back just after its answer, maybe after the next one arrives.)
    let s = Sluice::start(&format!(
        "[server]\nlisten = [\"{{listen}}\"]\naccess_log = \"off\"\n[admin]\nlisten = \"{{admin}}\"\n\
         [upstreams.api]\nservers = [\"{}\", \"{}\"]\n\
         retries = {{ attempts = 1, on = [\"503\"] }}\n\
         adaptive = {{ min_limit = 1, max_limit = 1, queue = \"200ms\" }}\n\
         [[routes]]\nname = \"all\"\npath_prefix = \"/\"\nupstream = \"api\"\n",
        bad.addr, good.addr
    ));
    let retries = || s.metric("sluice_upstream_retries_total{reason=\"503\",upstream=\"api\"}");
    for i in 0..4 {
        let r = s.get(&format!("/x{i}"));
        assert_eq!(r.status, 200, "{i}: {}", r.body);
    }
    assert!(
        retries() >= 1.0,
        "some went to the 503 server first and were retried"
    );
    assert_eq!(
        s.metric("sluice_shed_total{plan=\"anonymous\",upstream=\"api\"}"),
        0.0
    );
    // The one slot held at the good server: a second request is shed, and reaches no server.
    let addr = s.addr;
    let good_before = good.hits();
    let holder = thread::spawn(move || common::http::get(addr, "/slow", &[]).status);
    assert!(s.wait_for(Duration::from_secs(3), || good.hits() > good_before));
    let (hits, retried) = (bad.hits() + good.hits(), retries());
    let r = s.get("/y");
    assert_eq!(r.status, 503);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(
        bad.hits() + good.hits(),
        hits,
        "a shed request reaches no server"
    );
    assert_eq!(retries(), retried, "nor is it retried");
    assert_eq!(holder.join().expect("holder"), 200);
    assert_eq!(
        s.metric("sluice_shed_total{plan=\"anonymous\",upstream=\"api\"}"),
        1.0
    );
}
